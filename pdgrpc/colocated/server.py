"""``python -m pdgrpc.colocated``: GenerateService served by one colocated engine.

The baseline that ``bench e2e`` compares disaggregated serving with: the same
``GenerateService`` a client calls on the router, answered by a single process that runs
prefill and decode on one :class:`~pdgrpc.engine.reference.ReferenceEngine` -- no room,
no handshake, no KV transfer. Same engine flags, same chunked prefill, the same
continuous batching of decode steps, so the difference in TTFT and tokens/s is the cost
(or gain) of disaggregation. With ``--trace``, a request's span ``colocated`` holds the
hops ``colocated.queue`` (until the compute thread has its prompt) and ``compute`` (its
chunked prefill), the names a prefill worker's hops have, so the two computes compare.

Scheduler: one asyncio task; the engine runs on one dedicated thread (it is not
thread-safe). Each iteration admits waiting requests whose pages fit (prefilling each in
``--chunk-size`` chunks, which yields its first token), then runs one ``decode_step`` over
every running request. A client that cancels is dropped at the next iteration and its
pages freed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import logging
import time
from typing import AsyncIterator, Sequence

import grpc

from pdgrpc.argtypes import port
from pdgrpc.engine.base import (
    DecodeRequest, Engine, InvalidRequest, PrefillRequest, SampledToken, SamplingParams, stop_reason,
)
from pdgrpc.engine.colocated import prefill as prefill_chunks
from pdgrpc.errors import EngineError, PdgrpcError
from pdgrpc.gateway import add_gateway_arguments, colocated_service
from pdgrpc.gateway.statuses import Refusal, ending
from pdgrpc.rpc import tracing
from pdgrpc.rpc.drain import Drain, add_drain_arguments
from pdgrpc.rpc.open_calls import DEFAULT_PER_CLIENT, OpenCalls, limit_arg
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.rpc.server import ServiceSpec, run, serve_until_signal, start_server
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.serving.engines import build_engine, check_engine_args
from pdgrpc.serving.flags import MAX_CHUNK_TOKENS, add_engine_arguments, add_logging_arguments, chunk_tokens, tune_malloc_from_args
from pdgrpc.serving.launch import Role
from pdgrpc.serving.prompts import DEFAULT_MAX_NEW_TOKENS, request_ids, with_seed
from pdgrpc.serving.threads import compute_executor
from pdgrpc.v1 import generate_pb2, generate_pb2_grpc

__all__ = ["ROLE", "ColocatedServer", "Job", "build_parser", "serve"]

log = logging.getLogger("pdgrpc.colocated")

_DONE = object()


@dataclasses.dataclass
class Job:
    """One admitted request. Read its tokens with :meth:`stream`; set ``cancelled`` to
    drop it (its pages are freed at the scheduler's next iteration)."""

    ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    out: asyncio.Queue  # (SampledToken, finish_reason | "") items, then _DONE / an exception
    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    trace: tracing.Hops | None = None  # the request's span, until its first token

    async def stream(self) -> AsyncIterator[tuple[SampledToken, str]]:
        """``(token, finish_reason or "")`` until the request ends; raises what failed it."""
        while True:
            item = await self.out.get()
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def fail(self, exc: Exception) -> None:
        """End the stream with ``exc`` (raised to its reader)."""
        self.out.put_nowait(exc)


class ColocatedServer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self, engine: Engine, chunk_tokens: int, compute_nice: int = 0, max_requests_per_client: int = DEFAULT_PER_CLIENT,
    ) -> None:
        """``max_requests_per_client``: GenerateService calls one client holds open at once
        (a queued request holds the server's memory; smg's facade admits its own)."""
        self.engine = engine
        self._open = OpenCalls(max_requests_per_client, "Generate", "--max-requests-per-client")
        self.chunk_tokens = chunk_tokens
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._wake = asyncio.Event()
        self._thread = compute_executor("engine", compute_nice)
        self._task = asyncio.ensure_future(self._loop())

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]  # grpc.aio allows a context.write() streaming handler that returns None
        async with self._open.held(context):
            await self._generate(request, context)

    async def _generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        arrived = time.perf_counter()
        trace = tracing.server("colocated", context.invocation_metadata()) if tracing.enabled else None
        try:
            ids = tuple(request_ids(request, self.engine.tokenizer))
            seeded = with_seed(request.sampling)
            sampling = sampling_from_proto(seeded)
            max_new = seeded.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
            self.validate(ids, max_new, "input_ids" if request.input_ids else "messages" if request.messages else "prompt")
        except EngineError as exc:
            bad = ending(Refusal.BAD_REQUEST, str(exc))
            if trace is not None:
                trace.end(bad.message)
            await context.abort(bad.code, bad.message)
            return
        job = self.admit(ids, sampling, max_new)
        job.trace = trace
        text = self.engine.tokenizer.stream_decoder()
        first = True
        try:
            async for tok, reason in job.stream():
                msg = generate_pb2.GenerateResponse(token_ids=[tok.token_id], text=text.feed([tok.token_id]), finish_reason=reason)
                if reason:
                    msg.text += text.flush()
                if first:
                    first = False
                    msg.ttft_seconds = time.perf_counter() - arrived
                    msg.seed = seeded.seed
                await context.write(msg)
                if trace is not None:  # the first token is out: the span ends
                    trace.end()
                    trace = None
        except Exception as exc:  # noqa: BLE001 - the engine failed this request
            failed = ending(Refusal.ENGINE_FAILED, f"colocated engine failed: {exc}")
            if trace is not None:
                trace.end(failed.message)
            await context.abort(failed.code, failed.message)
        finally:
            job.cancelled = True  # no-op when finished; else the loop drops it and frees its pages
            if trace is not None:  # still open: cancelled before its first token
                trace.end("cancelled by client")

    def active_requests(self) -> int:
        """Requests queued or generating."""
        return len(self._pending) + len(self._running)

    def validate(self, ids: Sequence[int], max_new_tokens: int, field: str) -> None:
        """Raise :class:`InvalidRequest` naming ``field`` (the prompt's, as the client sent
        it) unless the request fits the engine and, once every other request is done, its
        KV pool (else no wait would ever admit it)."""
        self.engine.validate_request(ids, max_new_tokens, field)
        needed = self.engine.pages_needed(len(ids) + max_new_tokens - 1)
        if needed > self.engine.num_pages:
            raise InvalidRequest(
                f"max_new_tokens: prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) needs {needed} KV pages, "
                f"the pool has {self.engine.num_pages}"
            )

    def admit(self, ids: tuple[int, ...], sampling: SamplingParams, max_new_tokens: int) -> Job:
        """Queue a request :meth:`validate` passed; read it with :meth:`Job.stream`."""
        job = Job(ids, sampling, max_new_tokens, asyncio.Queue())
        self._pending.append(job)
        self._wake.set()
        return job

    # ---- scheduler ------------------------------------------------------------------------

    async def _engine(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _emit(self, job: Job, tok: SampledToken) -> bool:
        """Queue a token for the client; True when the job is finished (pages freed)."""
        job.tokens.append(tok.token_id)
        reason = stop_reason(tok.token_id, len(job.tokens), job.max_new_tokens, job.sampling, self.engine.tokenizer.eos_token_ids)
        job.out.put_nowait((tok, reason or ""))
        if reason is not None:
            self._finish(job)
            job.out.put_nowait(_DONE)
            return True
        return False

    def _finish(self, job: Job) -> None:
        if job.pages:
            self.engine.free_pages(job.pages)
            job.pages = []

    async def _loop(self) -> None:
        while True:
            for j in self._running:
                if j.cancelled:  # the client went away mid-stream
                    self._finish(j)
            self._running = [j for j in self._running if not j.cancelled]
            if not self._pending and not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            while self._pending:
                job = self._pending[0]
                if job.cancelled:
                    self._pending.popleft()
                    continue
                # Pages for every KV the request writes: the prompt and all generated tokens but the last.
                pages = self.engine.alloc_pages(self.engine.pages_needed(len(job.ids) + job.max_new_tokens - 1))
                if pages is None:
                    if not self._running:
                        self._pending.popleft()
                        job.fail(InvalidRequest("the request needs more KV pages than the pool has"))
                        continue
                    break
                self._pending.popleft()
                job.pages = pages
                if job.trace is not None:
                    job.trace.hop("colocated.queue")
                try:
                    first = await self._engine(prefill_chunks, self.engine, PrefillRequest(job.ids, tuple(pages), job.sampling), self.chunk_tokens)
                except Exception as exc:  # noqa: BLE001 - reported to that client
                    self._finish(job)
                    job.fail(exc)
                    continue
                if job.trace is not None:
                    job.trace.hop("compute")
                if not self._emit(job, first):
                    self._running.append(job)
            live = [j for j in self._running if not j.cancelled]
            if not live:
                continue
            batch = [
                DecodeRequest(j.tokens[-1], len(j.ids) + len(j.tokens) - 1, tuple(j.pages), j.sampling) for j in live
            ]
            outs = await self._engine(self.engine.decode_step, batch)
            finished = {id(j) for j, tok in zip(live, outs) if not j.cancelled and self._emit(j, tok)}
            self._running = [j for j in self._running if id(j) not in finished]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.colocated", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=port, default=0, help="TCP port; 0 picks a free one (default: %(default)s)")
    p.add_argument(
        "--chunk-size", type=chunk_tokens, default=512,
        help=f"prompt tokens per prefill chunk, as on a prefill server; at most {MAX_CHUNK_TOKENS} (default: %(default)s)",
    )
    p.add_argument(
        "--max-requests-per-client", type=limit_arg, default=DEFAULT_PER_CLIENT, metavar="N",
        help="GenerateService calls one client (its mTLS certificate's name, else its host) holds open at once; one "
        "more is refused RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    add_engine_arguments(p)
    add_gateway_arguments(p, rooms=False)  # no rooms: no --smg-room-key-file
    add_logging_arguments(p)
    add_security_arguments(p)
    add_drain_arguments(p)
    tracing.add_tracing_arguments(p)
    return p


async def _main(ns: argparse.Namespace) -> None:
    server_impl = ColocatedServer(build_engine(ns), ns.chunk_size, ns.compute_nice, ns.max_requests_per_client)
    name = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
    services: list[ServiceSpec] = [(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(server_impl, s))]
    drain = Drain()
    gateway = colocated_service(server_impl, ns, drain)  # smg's worker protocol (non-PD), with pdgrpc[gateway]
    if gateway is not None:
        services.append(gateway)
    server = await start_server(
        services, host=ns.host, port=ns.port, what="pdgrpc colocated", drain=drain, gateway_listen=getattr(ns, "gateway_listen", None),
        gateway_uids=getattr(ns, "gateway_uid", ()),
    )
    server.on_stop(server_impl.close)
    await serve_until_signal(server, drain_timeout=ns.drain_timeout)


def serve(ns: argparse.Namespace) -> int:
    tune_malloc_from_args(ns)
    try:
        run(_main(ns))
    except PdgrpcError as exc:  # a configuration refused at start (a non-loopback --host without TLS or a token)
        log.error("%s", exc)
        return 2
    return 0


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: "colocated", check=check_engine_args)
