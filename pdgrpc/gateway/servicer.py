"""``sglang.grpc.scheduler.SglangScheduler`` served by pdgrpc's prefill and decode servers.

smg, SGLang's model gateway, fronts gRPC workers over this protocol. In its PD mode it
sends the same ``Generate`` to a prefill and a decode worker at once, with
``disaggregated_params{bootstrap_host, bootstrap_port, bootstrap_room}``; only the
decode leg's tokens reach the client, and smg holds the decode stream back until the
prefill leg's call ends.

* **Prefill leg** (:class:`PrefillLeg`): the request becomes a ``PrefillRequest`` for
  the controller's own ``Prefill`` handler (same dp-rank choice and registration, same
  failures), called in-process with this call's context. The call ends with one
  ``complete`` as soon as the decode acknowledged the metadata row.
* **Decode leg** (:class:`DecodeLeg`): the request becomes a ``DecodeRequest`` whose
  prefill bootstrap is ``bootstrap_host:bootstrap_port``, run by the decode's own
  ``Decode`` handler in-process. Every output token, the first included, goes out as a
  ``chunk``; then ``complete`` with ``finish_reason`` (``stop``/``length``),
  ``matched_token_id`` (EOS or a stop token id) or ``matched_stop_str`` and the token
  counts (:mod:`pdgrpc.gateway.stream`). A stop ends the request early: the inner call
  is closed, which frees its pages and slot.
* **Abort(request_id)** cancels that request's ``Generate`` handler, so the inner call
  is cancelled exactly as when pdgrpc's router cancels (the decode aborts the room and
  quarantines its pages until the prefill acknowledged; the prefill stops computing).
  Only the caller that started the request (:func:`~pdgrpc.rpc.security.peer_identity`:
  its certificate's name under mTLS) may abort it; an unknown id, or another caller's,
  is a no-op whose reply says no such request runs here. A room belongs to one running
  request: a second request on it is refused ALREADY_EXISTS, since the decode leg's abort
  ends its room's stream.
* **Colocated** (:class:`ColocatedLeg`): smg's non-PD worker. The request (without
  ``disaggregated_params``) runs on the colocated server's own scheduler, streamed the
  same way as a decode leg.
* ``HealthCheck``, ``GetModelInfo``, ``GetServerInfo``, ``GetLoads`` and
  ``GetTokenizer`` describe this worker (model facts and tokenizer files come from the
  engine's tokenizer, :class:`~pdgrpc.engine.base.Tokenizer`, whatever the engine).
* ``SubscribeKvEvents`` (prefill only): the instance's merged prefix cache events
  (:mod:`pdgrpc.serving.kv_events`) in smg's form -- the replay after
  ``start_sequence_number`` or a snapshot, then live batches. Each batch carries the
  ``EngineLoad`` that ``GetLoads`` reports; while no event flows, a ``load_only`` batch
  repeating the last sequence number goes out when the load changes and at least every
  :data:`KV_HEARTBEAT_S` (from the subscription on when the subscriber asks for
  ``load_records_before_first_batch``, else once a first batch went out). A stored chain
  is one ``KvBlocksStored`` per run of parent-linked blocks; ``block_size`` is the page's.
  The decode and colocated workers, a prefill started with ``--no-smg-kv-events``, and
  the other RPCs answer UNIMPLEMENTED (smg logs a warning and routes without KV events).

Request conversion and rooms: :mod:`pdgrpc.gateway.requests`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from pdgrpc.engine.base import InvalidRequest
from pdgrpc.engine.tokenizer_files import TokenizerFilesError
from pdgrpc.errors import RequestFailed
from pdgrpc.gateway.requests import ROOM_BASE, GatewayRequest, convert
from pdgrpc.gateway.statuses import Refusal, ending
from pdgrpc.gateway.stream import OutputStream
from pdgrpc.gateway.tokenizer import tokenizer_zip
from pdgrpc.rpc.limits import MAX_ABORT_REASON_CHARS
from pdgrpc.rpc.security import peer_identity
from pdgrpc.state.kv_event_log import Cleared, EventBatch, Removed, Stored, stored_runs
from pdgrpc.v1 import common_pb2, decode_pb2, prefill_pb2

if TYPE_CHECKING:
    from pdgrpc.engine.base import Tokenizer
    from pdgrpc.serving.kv_events import KvEventFeed

__all__ = ["SERVICE_NAME", "ColocatedLeg", "DecodeLeg", "PrefillLeg", "WorkerInfo", "add_to_server", "model_info"]

log = logging.getLogger("pdgrpc.gateway")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
_TOKENIZER_CHUNK = 64 * 1024  # bytes per GetTokenizer message
# A KV event stream with no event checks the load this often, and sends a load_only batch
# at least every KV_HEARTBEAT_S: smg reads the worker's load from the stream, not GetLoads.
KV_IDLE_S = 0.25
KV_HEARTBEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What this worker tells smg about itself."""

    mode: str  # "prefill" | "decode" | "null" (colocated)
    served_model_name: str
    transport: str  # pdgrpc transport name; smg requires prefill and decode to agree
    max_seq_len: int  # tokens
    max_prompt_tokens: int  # tokens
    max_running_requests: int  # requests
    bootstrap_port: int  # the prefill's BootstrapService port (0 on a decode)
    tokenizer: "Tokenizer"  # the served model's: ids, vocabulary, EOS, files for GetTokenizer
    room_key: bytes = dataclasses.field(default=b"", repr=False)  # the cluster's smg room key (requests.room_secret)


def model_info(i: WorkerInfo) -> Any:
    """``GetModelInfoResponse`` of a worker: the served model's vocabulary, EOS and BOS ids and
    type from its tokenizer, the context from the engine. ``tokenizer_path`` stays empty, so
    smg fetches the tokenizer through ``GetTokenizer`` rather than from a path of this host."""
    tok = i.tokenizer
    reply = pb.GetModelInfoResponse(
        model_path=i.served_model_name, served_model_name=i.served_model_name, is_generation=True,
        max_context_length=i.max_seq_len, vocab_size=tok.vocab_size, model_type=tok.model_type,
        eos_token_ids=sorted(tok.eos_token_ids), max_req_input_len=i.max_prompt_tokens,
    )
    if tok.bos_token_id >= 0:
        reply.bos_token_id = tok.bos_token_id
    return reply


@dataclasses.dataclass(frozen=True)
class _Held:
    """What a running request holds in its servicer: its abort's key (None without a
    request_id) and its room (0 without one)."""

    key: tuple[str, str] | None
    room: int


async def _abort(context: grpc.aio.ServicerContext, failure: RequestFailed) -> None:
    """End the call with ``failure``'s status (context.abort raises)."""
    await context.abort(failure.code, failure.message)


class _Base(pb_grpc.SglangSchedulerServicer):
    def __init__(self, info: Callable[[], WorkerInfo], active: Callable[[], int], healthy: Callable[[], bool]) -> None:
        self.info = info
        self._active = active
        self._healthy = healthy
        # (caller, request_id) -> its abort (False: too early or late): ids are each
        # caller's own, and only it may abort one.
        self._running: dict[tuple[str, str], Callable[[str], bool]] = {}
        # The rooms of the requests running here: a decode leg's abort ends its room's
        # stream, so a room is one request's alone, whoever started it.
        self._rooms: set[int] = set()
        self._started = time.time()
        # The tokenizer's bundle, built once: the files do not change while serving, and
        # building it costs a large tokenizer's whole compression per call.
        self._bundle: asyncio.Future[tuple[bytes, str]] | None = None

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        ok = self._healthy()
        return pb.HealthCheckResponse(healthy=ok, message="serving" if ok else "not serving (starting, draining, stopping or a worker is dead)")

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return model_info(self.info())

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        i = self.info()
        args = struct_pb2.Struct()
        args.update({
            "disaggregation_mode": i.mode,
            "disaggregation_transfer_backend": f"pdgrpc-{i.transport}",
            "disaggregation_bootstrap_port": i.bootstrap_port,
            "max_running_requests": i.max_running_requests,
            "served_model_name": i.served_model_name,
            "context_length": i.max_seq_len,
        })
        return pb.GetServerInfoResponse(
            server_args=args, active_requests=self._active(), uptime_seconds=time.time() - self._started,
            server_type="grpc", sglang_version="pdgrpc",
        )

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        n, most = self._load()
        load = pb.SchedulerLoad(dp_rank=0, num_running_reqs=n, num_total_reqs=n, max_running_requests=most)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), version="pdgrpc", dp_rank_count=1, loads=[load],
            aggregate=pb.AggregateMetrics(total_running_reqs=n, total_reqs=n),
        )

    def _load(self) -> tuple[int, int]:
        """Requests running here, and the most this worker runs at once."""
        return self._active(), self.info().max_running_requests

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        if self._bundle is None:  # reads and compresses files: off the event loop
            self._bundle = asyncio.ensure_future(asyncio.to_thread(lambda: tokenizer_zip(self.info().tokenizer.hf_files())))
        try:
            data, sha = await asyncio.shield(self._bundle)
        except TokenizerFilesError as exc:
            self._bundle = None  # the files may be fixed: look again next time
            await _abort(context, ending(Refusal.NO_TOKENIZER, f"GetTokenizer: {exc}"))
            return
        for start in range(0, len(data), _TOKENIZER_CHUNK):
            end = start + _TOKENIZER_CHUNK
            yield smg_common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha if end >= len(data) else "")

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        if len(request.reason) > MAX_ABORT_REASON_CHARS:
            why = f"Abort: reason: {len(request.reason)} characters, over the limit of {MAX_ABORT_REASON_CHARS}"
            await _abort(context, ending(Refusal.BAD_REQUEST, why))
        caller = peer_identity(context)
        abort = self._running.get((caller, request.request_id))
        if abort is None:  # another caller's request gets this answer too: no telling which ids run
            owners = [c for c, rid in self._running if rid == request.request_id]
            if owners:
                log.warning("abort of request %s by %s refused: %s started it", request.request_id, caller, ", ".join(owners))
            return pb.AbortResponse(success=False, message=f"no request {request.request_id!r} is running here; nothing to abort")
        log.info("abort request %s: %s", request.request_id, request.reason or "(no reason given)")
        if not abort(f"request {request.request_id} aborted by Abort: {request.reason or 'no reason given'}"):
            return pb.AbortResponse(success=False, message=f"request {request.request_id!r} is not admitted yet or already over; nothing aborted")
        return pb.AbortResponse(success=True, message="aborted")

    def _convert(self, request: Any) -> GatewayRequest:
        colocated = self.info().mode == "null"
        if colocated and request.HasField("disaggregated_params"):
            raise ending(Refusal.BAD_REQUEST, "disaggregated_params is set, but this worker is colocated (not a prefill or decode)")
        info = self.info()
        g = convert(request, disaggregated=not colocated, max_seq_len=info.max_seq_len, room_key=info.room_key)
        try:  # under smg's name: the inner handlers name their own field, input_ids
            info.tokenizer.check_ids(g.input_ids, "tokenized.input_ids")
        except InvalidRequest as exc:
            raise ending(Refusal.BAD_REQUEST, str(exc)) from None
        return g

    def _track(self, g: GatewayRequest, abort: Callable[[str], bool], context: grpc.aio.ServicerContext) -> _Held:
        """Note ``g`` as running, abortable by ``abort`` on its caller's behalf only, and
        its room as taken; what :meth:`_untrack` takes. A request whose room runs here
        already is refused, whoever started it: an abort of it would end that room's
        request. A request without an id is abortable by no Abort, so only its room is
        noted: requests without ids run side by side."""
        if g.room and g.room in self._rooms:
            raise ending(
                Refusal.DUPLICATE, f"disaggregated_params.bootstrap_room {g.room - ROOM_BASE} is already in use by a request running here",
            )
        key = (peer_identity(context), g.request_id) if g.request_id else None
        if key is not None and key in self._running:
            raise ending(Refusal.DUPLICATE, f"request_id {g.request_id!r} is already running here")
        if key is not None:
            self._running[key] = abort
        if g.room:
            self._rooms.add(g.room)
        return _Held(key, g.room)

    def _untrack(self, held: _Held | None) -> None:
        if held is None:
            return
        if held.key is not None:
            self._running.pop(held.key, None)
        self._rooms.discard(held.room)


def _unimplemented(name: str) -> Callable[..., Any]:
    async def refuse(self: _Base, request: Any, context: grpc.aio.ServicerContext) -> None:
        await _abort(context, ending(Refusal.UNSUPPORTED, f"{name} is not served by pdgrpc's workers"))

    refuse.__name__ = name
    return refuse


# The methods no leg serves answer UNIMPLEMENTED from a coroutine, as the served ones do:
# grpc's generated defaults are plain functions, which the server parses for itself, so
# a request that does not parse ended UNKNOWN with a traceback at ERROR.
for _method in pb.DESCRIPTOR.services_by_name["SglangScheduler"].methods:
    if getattr(_Base, _method.name) is getattr(pb_grpc.SglangSchedulerServicer, _method.name):
        setattr(_Base, _method.name, _unimplemented(_method.name))


class PrefillLeg(_Base):
    """Serves smg's prefill leg on the prefill controller (see the module doc)."""

    def __init__(self, prefill: Any, info: Callable[[], WorkerInfo], active: Callable[[], int], healthy: Callable[[], bool],
                 kv_events: "KvEventFeed | None") -> None:
        super().__init__(info, active, healthy)
        self._prefill = prefill  # the controller's, counted per client: Prefill(PrefillRequest, context) -> PrefillResponse
        self._kv_events = kv_events  # the controller's merged log; None: not served to smg (--no-smg-kv-events)

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        if self._kv_events is None:
            await _abort(context, ending(Refusal.UNSUPPORTED, "KV events are not served to smg here (--no-smg-kv-events)"))
            return
        # Each stream costs a snapshot and a stream: smg's count against the feed's limit
        # per client, as pdgrpc's own SubscribeKvEvents do.
        async with self._kv_events.streams.held(context):
            sent: int | None = 0 if request.load_records_before_first_batch else None  # last sequence on this stream
            sample = 0
            last_load: tuple[int, int] | None = None
            last_at = 0.0
            async for batches in self._kv_events.follow(request.start_sequence_number, KV_IDLE_S):
                load = self._load()
                now = time.monotonic()
                if batches:
                    blocks = sum(len(e.blocks) for b in batches if b.snapshot is not None for e in b.events if isinstance(e, Stored))
                    for b in batches:
                        sample += 1
                        yield _smg_batch(b, _engine_load(load, sample, load_only=False), blocks)
                    sent, last_load, last_at = batches[-1].sequence_number, load, now
                elif sent is not None and (load != last_load or now - last_at >= KV_HEARTBEAT_S):
                    sample += 1
                    yield smg_common_pb2.KvEventBatch(
                        sequence_number=sent, timestamp=time.time(), load=_engine_load(load, sample, load_only=True),
                    )
                    last_load, last_at = load, now

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        aborted: list[str] = []
        # The Prefill runs in its own task so that Abort can cancel it and this handler
        # still ends the call with a status (grpc sends none for a cancelled handler).
        work: asyncio.Future[Any] | None = None

        def abort(why: str) -> bool:
            aborted.append(why)
            return work is not None and work.cancel()

        try:
            g = self._convert(request)
            key = self._track(g, abort, context)
        except RequestFailed as exc:
            await _abort(context, exc)
            return
        try:
            inner = prefill_pb2.PrefillRequest(
                bootstrap_room=g.room, request_id=g.request_id, input_ids=g.input_ids, sampling=g.sampling,
                room_secret=g.room_secret,
            )
            if g.routed_dp_rank is not None:
                inner.routed_dp_rank = g.routed_dp_rank
            work = asyncio.ensure_future(self._prefill.Prefill(inner, context))  # aborts the context on failure
            try:
                reply = await work
            except asyncio.CancelledError:
                if not aborted or not work.cancelled():
                    raise  # the caller went away: grpc ends the call
                await _abort(context, ending(Refusal.ABORTED, aborted[0]))
            yield pb.GenerateResponse(
                request_id=g.request_id,
                complete=pb.GenerateComplete(
                    finish_reason="stop", prompt_tokens=reply.prompt_tokens or len(g.input_ids), cached_tokens=reply.cached_tokens
                ),
            )
        finally:
            self._untrack(key)


class DecodeLeg(_Base):
    """Serves smg's decode leg on the decode server (see the module doc)."""

    def __init__(self, decode: Any, info: Callable[[], WorkerInfo], active: Callable[[], int], healthy: Callable[[], bool]) -> None:
        super().__init__(info, active, healthy)
        self._decode = decode  # the DecodeServicer: Decode(DecodeRequest, context) -> stream

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        scheduler = self._decode.scheduler
        try:
            g = self._convert(request)
            key = self._track(g, lambda why: scheduler.end_stream(g.room, ending(Refusal.ABORTED, why)), context)
        except RequestFailed as exc:
            await _abort(context, exc)
            return
        inner_req = decode_pb2.DecodeRequest(
            bootstrap_room=g.room, request_id=g.request_id, input_ids=g.input_ids, sampling=g.sampling,
            prefill_bootstrap_address=g.bootstrap_address, room_secret=g.room_secret,
        )
        if g.routed_dp_rank is not None:
            inner_req.routed_dp_rank = g.routed_dp_rank
        stream = self._decode.Decode(inner_req, context)
        out = OutputStream(g, self.info().tokenizer)
        try:
            async for msg in stream:
                out.cached_tokens = out.cached_tokens or msg.cached_tokens  # set on the first message
                msgs = out.step(list(msg.token_ids), list(msg.logprobs), list(msg.top_logprobs), msg.finish_reason)
                for m in msgs:
                    yield m
                if msgs and msgs[-1].HasField("complete"):  # over: EOS, length or a stop
                    return
        finally:
            # A stop token, an Abort or a client that went away: closing the inner stream
            # runs its clean-up (the room is aborted and its pages freed).
            await stream.aclose()
            self._untrack(key)


class ColocatedLeg(_Base):
    """Serves smg's non-PD requests on the colocated server (see the module doc)."""

    def __init__(self, server: Any, info: Callable[[], WorkerInfo], active: Callable[[], int], healthy: Callable[[], bool]) -> None:
        super().__init__(info, active, healthy)
        self._server = server  # pdgrpc.colocated.server.ColocatedServer: admit(ids, sampling, max_new) -> Job

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        from pdgrpc.errors import EngineError
        from pdgrpc.serving.convert import sampling_from_proto

        job: Any = None

        def abort(why: str) -> bool:
            if job is None or job.cancelled:
                return False
            job.fail(ending(Refusal.ABORTED, why))
            return True

        try:
            g = self._convert(request)
            sampling = sampling_from_proto(g.sampling)
            self._server.validate(g.input_ids, g.sampling.max_new_tokens, "tokenized.input_ids")
            key = self._track(g, abort, context)
        except EngineError as exc:  # InvalidRequest among them
            await _abort(context, ending(Refusal.BAD_REQUEST, str(exc)))
            return
        except RequestFailed as exc:
            await _abort(context, exc)
            return
        job = self._server.admit(g.input_ids, sampling, g.sampling.max_new_tokens)
        stream = OutputStream(g, self.info().tokenizer)
        try:
            async for tok, reason in job.stream():
                top = [common_pb2.TopLogprobs(token_ids=tok.top_ids, logprobs=tok.top_logprobs)]
                msgs = stream.step([tok.token_id], [tok.logprob], top, reason)
                for m in msgs:
                    yield m
                if msgs and msgs[-1].HasField("complete"):
                    return
        except RequestFailed as exc:
            await _abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - the engine failed this request
            await _abort(context, ending(Refusal.ENGINE_FAILED, f"colocated engine failed: {exc}"))
        finally:
            job.cancelled = True  # no-op when finished; else the scheduler drops it and frees its pages
            self._untrack(key)


def _engine_load(load: tuple[int, int], sample: int, load_only: bool) -> Any:
    running, most = load
    return smg_common_pb2.EngineLoad(running_requests=running, max_running_requests=most, sample=sample, load_only=load_only)


def _smg_batch(b: EventBatch, load: Any, snapshot_blocks: int) -> Any:
    """``b`` as smg's ``KvEventBatch`` (see the module doc)."""
    events = []
    for e in b.events:
        if isinstance(e, Stored):
            for run in stored_runs(e.blocks):
                stored = smg_common_pb2.KvBlocksStored(blocks=[
                    smg_common_pb2.KvBlock(block_hash=x.block_hash, token_ids=x.token_ids, block_size=len(x.token_ids)) for x in run
                ])
                if run[0].parent_hash is not None:
                    stored.parent_block_hash = run[0].parent_hash
                events.append(smg_common_pb2.KvCacheEvent(stored=stored))
        elif isinstance(e, Removed):
            events.append(smg_common_pb2.KvCacheEvent(removed=smg_common_pb2.KvBlocksRemoved(block_hashes=e.block_hashes)))
        elif isinstance(e, Cleared):
            events.append(smg_common_pb2.KvCacheEvent(cleared=smg_common_pb2.KvCacheCleared()))
    out = smg_common_pb2.KvEventBatch(sequence_number=b.sequence_number, timestamp=b.timestamp, events=events, load=load)
    if b.snapshot is not None:
        out.snapshot.CopyFrom(smg_common_pb2.KvSnapshotChunk(index=b.snapshot.index, count=b.snapshot.count, blocks=snapshot_blocks))
    return out


def add_to_server(servicer: _Base, server: Any) -> None:
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
