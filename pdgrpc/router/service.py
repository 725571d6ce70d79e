"""``GenerateService`` of the router: one client request -> one prefill call + one decode call.

What one ``Generate`` does::

    client --Generate--> router --Prefill (unary)----------> prefill controller
                                \\-Decode (server stream)---> decode   (both sent at once)
           <--tokens---------- router <--tokens------------- decode

1. Pick a prefill and a decode (by ``--policy``: for each role, the instance whose cache
   holds the longest prefix of the prompt, by default; see :mod:`pdgrpc.router.policy`), draw ``bootstrap_room``
   (random 63-bit from :mod:`secrets`, never 0: 0 means "not written" in a metadata row)
   and the room's secret, which only these two get (:mod:`pdgrpc.serving.room_proof`);
   a request that names no sampling seed gets a random one (:func:`~pdgrpc.serving.prompts.with_seed`).
2. Start ``Prefill`` and ``Decode`` at once: decode allocates pages and handshakes with
   the prefill worker while the prefill computes, so neither waits for the other. Or,
   when the decode lacks little of the prompt or every prefill is busy
   (:func:`~pdgrpc.state.local_prefill.prefill_where`), only ``Decode``, with
   ``local_prefill``: the decode computes the prompt itself (local prefill).
3. Relay the decode's stream, turning token ids into text deltas with an incremental
   UTF-8 decoder (a multi-byte character split across two messages is sent whole, with
   the later message). The first message carries TTFT, room and the sampling seed (the
   caller's, else the one drawn at step 1, once for every attempt); the message relaying
   the decode's first carries the KV figures (bytes, transfer and data-plane time, cached
   tokens). Under ``--first-token prefill`` (the default) the prefill call is
   ``PrefillStream``, whose first message is the first token, sampled before its KV
   left: it goes to the client at once, and the decode's first message repeats it
   (checked), so its figures go with the client's next message. The decode's path to
   its first token (the KV's last write, the commit, its stream) leaves the time to
   first token. A request with one token left waits for the decode, whose message says
   why it ended.
4. Failures travel both ways. A failed prefill (refused prompt, dp-rank conflict, transfer
   failure) cancels the decode call -- the decode aborts the room and frees its pages --
   and the client gets the prefill's status code with a message naming the prefill; a
   prefill that failed as a decode's death fails it (ABORTED: its transfer failed) first
   gives the decode's stream a moment to end by itself, so a dead decode is the side
   blamed. A failed decode cancels the prefill call likewise. A client that cancels (or
   whose deadline passes) cancels both calls, so both sides release everything.
5. A call that fails UNAVAILABLE (its server is gone or unreachable, or a worker behind
   it died) before the first token reached the client is retried: the request goes
   again, with a fresh room and secret, to another instance of that role (the other
   side is picked afresh too), after the failed attempt's calls are cancelled; up to
   ``retries`` times (``--retries``, default 1) and within the request's deadline. No
   other failure is retried, nor one with no other instance to go to; after the first
   token a stream migrates instead (step 6).
6. A stream whose decode fails after tokens reached the client -- UNAVAILABLE (gone,
   unreachable, drained past its timeout), a peer failure, a reset stream -- migrates: the
   request runs again on another prefill and decode, with ``input_ids`` = prompt + the
   tokens already relayed, ``max_new_tokens`` less those, the same sampling seed and a new
   room. Sampling draws each token from (seed, absolute position), so the new pair
   produces exactly the tokens the first would have, and the client's stream goes on with
   no duplicate and no gap; the text decoder carries over too (a character split across
   the failure is sent whole). Up to ``migration_limit`` times per request
   (``--migration-limit``, default 1) and only while prompt + generated tokens fit
   ``migration_max_seq_len``; past that the failure reaches the client as before.
7. An instance whose call failed UNAVAILABLE is then passed over for ``eject_s`` seconds
   (``--eject-s``): see :mod:`pdgrpc.state.ejections`.

The prefill's status wins when both fail: a decode that sees its prefill abort reports a
generic ABORTED, while the prefill knows the cause (e.g. the prompt is too long).

What decides steps 4 to 7 -- which side failed, whether the request goes again, under
which reason -- is the pure :class:`~pdgrpc.state.route_fate.RouteFate`; this servicer
classifies each call's status once (UNAVAILABLE, INTERNAL, ABORTED, a refusal of the
request as invalid, or another) and executes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import secrets
import time
from typing import Any, Callable, Sequence, cast

import grpc

from pdgrpc.argtypes import check_address
from pdgrpc.discovery.record import MembershipView
from pdgrpc.engine.config import DEFAULT_MAX_PROMPT_TOKENS
from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.engine.tokenizer import ByteTokenizer
from pdgrpc.errors import RequestFailed
from pdgrpc.metrics import RouterMetrics, ServerAbortReason
from pdgrpc.router.policy import DEFAULT_MARGIN, InFlight, Policy
from pdgrpc.rpc import tracing
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.local import LocalChannel
from pdgrpc.rpc.open_calls import DEFAULT_PER_CLIENT, OpenCalls, TooManyOpenCalls
from pdgrpc.rpc.security import current
from pdgrpc.rpc.errors import REQUEST_INVALID, reason_of
from pdgrpc.serving.kv_events import LOCAL_PREFILL
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.serving.prompts import DEFAULT_MAX_NEW_TOKENS, request_ids, with_seed
from pdgrpc.state.ejections import Ejections
from pdgrpc.state.local_prefill import (
    DEFAULT_LOCAL_PREFILL_QUEUE, DEFAULT_LOCAL_PREFILL_TOKENS, LocalPrefillRule, prefill_where,
)
from pdgrpc.state.outcomes import AbortReason
from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.state.prefix_leaders import leader_wait_s
from pdgrpc.state.room import ROOM_BASE, ROOM_SPAN, Room
from pdgrpc.state.routing import candidates
from pdgrpc.state.route_fate import (
    AttemptFailed, Blame, CallEnd, Ending, Fail, Finish, NoInstance, PrefillCall, Relayed, Reroute, Rerouted, RouteFate,
    RouteLimits, Side, Succeeded, blame_decode, decode_outlives, prefill_failure,
)
from pdgrpc.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2, prefill_pb2_grpc

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "FIRST_TOKEN_FROM", "MAX_RETRIES", "PrefillBackend", "RouterConfig", "GenerateServicer", "draw_room", "parse_decode", "parse_prefill"]

log = logging.getLogger("pdgrpc.router")

# How long, after the decode stream ended, the router waits for the prefill's reply
# before cancelling it (the prefill replies once the decode acknowledged the KV, which
# precedes the decode's first token, so this is normally already done).
_PREFILL_TAIL_S = 5.0
# A client's open Generate calls: half of what each prefill and decode lets the router, one
# client to them, hold open there, so that no one of its clients holds all of it.
DEFAULT_REQUESTS_PER_CLIENT = DEFAULT_PER_CLIENT // 2
# When one side fails, a failure of the other arriving this soon after is taken as the cause.
_CAUSE_WINDOW_S = 0.5
# Where the client's first token comes from (RouterConfig.first_token; module doc, step 3).
FIRST_TOKEN_FROM = ("prefill", "decode")
# Most times one request is sent again (RouterConfig.retries): each retry goes to another
# instance, so more than a cluster's instances retries nothing new, and a larger value is a
# typing error rather than a deployment.
MAX_RETRIES = 100


def draw_room(randbits: Callable[[int], int] | None = None) -> Room:
    """A random 63-bit bootstrap room, never 0 (0 means "not written" in a metadata row)
    and never in the band that rooms of requests from smg map to
    (:data:`pdgrpc.state.room.ROOM_BASE`), so the two never share a room."""
    draw = randbits or secrets.randbits
    while True:
        room = draw(63)
        if room and not ROOM_BASE <= room < ROOM_BASE + ROOM_SPAN:
            return Room(room)


@dataclasses.dataclass(frozen=True)
class PrefillBackend:
    """A prefill instance: its PrefillService address and its BootstrapService address
    (the same address when bootstrap is embedded in the prefill's server); ``local``: its
    local socket (:mod:`pdgrpc.rpc.local`), "" when it serves none."""

    address: str
    bootstrap: str
    local: str = ""


def parse_prefill(spec: str) -> PrefillBackend:
    """``HOST:PORT[,bootstrap=HOST:PORT][,local=PATH]`` -> :class:`PrefillBackend`."""
    head, *opts = [s.strip() for s in spec.split(",")]
    check_address(head, "--prefill")
    bootstrap, local = head, ""
    for opt in opts:
        key, sep, value = opt.partition("=")
        if key == "bootstrap" and sep:
            check_address(value, "--prefill bootstrap=")
            bootstrap = value
        elif key == "local" and sep and value:
            local = value
        else:
            raise ValueError(f"--prefill {spec!r}: unknown option {opt!r} (expected bootstrap=HOST:PORT or local=PATH)")
    return PrefillBackend(head, bootstrap, local)


def parse_decode(spec: str) -> tuple[str, str]:
    """``HOST:PORT[,local=PATH]`` -> (the address, its local socket or "")."""
    head, *opts = [s.strip() for s in spec.split(",")]
    check_address(head, "--decode")
    local = ""
    for opt in opts:
        key, sep, value = opt.partition("=")
        if key != "local" or not sep or not value:
            raise ValueError(f"--decode {spec!r}: unknown option {opt!r} (expected local=PATH)")
        local = value
    return head, local


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    prefills: tuple[PrefillBackend, ...]
    decodes: tuple[str, ...]
    request_timeout: float = 300.0  # seconds; caps every request (client deadlines cap it further)
    discovery: bool = False  # backends come from etcd (--discovery); the static lists may be empty
    model: str = ""  # checkpoint directory whose tokenizer encodes prompts ("": the byte tokenizer)
    # Longest prompt forwarded (tokens): the engines' --max-prompt-tokens. A longer one is
    # refused here, before a prefill or decode spends anything on it.
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    # Times a request is sent again, with a fresh room, to another instance of the role
    # whose call failed UNAVAILABLE (gone, unreachable, its worker died) before the first
    # token reached the client. After a token a stream migrates instead (migration_limit).
    retries: int = 1
    # Seconds an instance whose call failed UNAVAILABLE is passed over by new requests and
    # retries (pdgrpc.state.ejections); 0: never.
    eject_s: float = 5.0
    # Which prefill a request goes to (pdgrpc.router.policy): round_robin, least_load or
    # cache_aware; and how many more calls in flight than the least loaded instance a
    # cache_aware pick may have before the least loaded one is taken instead.
    policy: str = "cache_aware"
    cache_aware_margin: int = DEFAULT_MARGIN
    # Times one request's running stream may move to another prefill and decode after its
    # decode failed past the first token (module doc, step 6); 0: never.
    migration_limit: int = 1
    # Longest prompt + generated tokens a stream migrates with (the new prefill computes
    # them all); 0: max_prompt_tokens, the most a prefill takes.
    migration_max_seq_len: int = 0
    # Local prefill (pdgrpc.state.local_prefill): the decode computes a prompt whose part
    # its cache lacks is at most this many tokens (0: never for that reason), or any
    # prompt when every prefill has more than local_prefill_queue calls in flight and
    # the decode fewer local prompts than that (0: never).
    local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS
    local_prefill_queue: int = DEFAULT_LOCAL_PREFILL_QUEUE
    # Generate calls one client (pdgrpc.rpc.security.peer_identity) holds open at once.
    max_requests_per_client: int = DEFAULT_REQUESTS_PER_CLIENT
    # Local sockets of the decodes, by address (a prefill's is PrefillBackend.local): the
    # router calls those over them instead of gRPC (pdgrpc.rpc.local).
    decode_sockets: tuple[tuple[str, str], ...] = ()
    # Where the client's first token comes from: "prefill" (sent ahead, PrefillStream) or
    # "decode" (with its KV committed); module doc, step 3.
    first_token: str = "prefill"

    def __post_init__(self) -> None:
        if not self.prefills and not self.discovery:
            raise ValueError("the router needs at least one --prefill (or --discovery)")
        if not self.decodes and not self.discovery:
            raise ValueError("the router needs at least one --decode (or --discovery)")
        for d in self.decodes:
            check_address(d, "--decode")
        if not 0 < self.request_timeout < math.inf:  # a deadline of inf fails every call at once
            raise ValueError(f"--request-timeout must be a finite number of seconds > 0, got {self.request_timeout}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        if not 0 <= self.retries <= MAX_RETRIES:
            raise ValueError(f"--retries must be in [0, {MAX_RETRIES}], got {self.retries}")
        if not 0 <= self.eject_s <= 3600:
            raise ValueError(f"--eject-s must be between 0 and 3600 seconds, got {self.eject_s}")
        Policy(self.policy, PrefixIndex(), self.cache_aware_margin)  # names a bad --policy or margin
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.migration_max_seq_len < 0:
            raise ValueError(f"--migration-max-seq-len must be >= 0, got {self.migration_max_seq_len}")
        self.local_prefill  # names a bad --local-prefill-tokens or --local-prefill-queue
        if self.first_token not in FIRST_TOKEN_FROM:
            raise ValueError(f"--first-token must be one of {', '.join(FIRST_TOKEN_FROM)}, got {self.first_token!r}")

    @property
    def local_prefill(self) -> LocalPrefillRule:
        return LocalPrefillRule(self.local_prefill_tokens, self.local_prefill_queue)

    @property
    def migration_seq_len(self) -> int:
        """The longest prompt + generated tokens a stream migrates with."""
        return self.migration_max_seq_len or self.max_prompt_tokens


class _AttemptFailed(Exception):
    """``failure`` (what the client gets if the request ends here) ended an attempt;
    ``end`` is how the failed call counts for the request's fate."""

    def __init__(self, failure: RequestFailed, end: CallEnd) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.end = end


_ENDINGS = {
    grpc.StatusCode.UNAVAILABLE: Ending.UNREACHABLE,
    # The router reads no status of a call it cancelled itself: a CANCELLED comes from a
    # server that stopped under the call (one that drained took it in as it stopped).
    grpc.StatusCode.CANCELLED: Ending.UNREACHABLE,
    grpc.StatusCode.INTERNAL: Ending.BROKEN,
    grpc.StatusCode.ABORTED: Ending.ABORTED,
    **{code: Ending.INVALID for code in REQUEST_INVALID},
}


def _ending(code: grpc.StatusCode) -> Ending:
    """A call's status as the request's fate reads it (the one place the router reads a code)."""
    return _ENDINGS.get(code, Ending.ANSWERED)


def _client_code(code: grpc.StatusCode) -> grpc.StatusCode:
    # An upstream CANCELLED the client did not ask for (a server shutting down) would read
    # as "you cancelled" to the client; it is an aborted request.
    return grpc.StatusCode.ABORTED if code == grpc.StatusCode.CANCELLED else code


def _failed(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is not None


def _succeeded(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None


def _cancel_after_prefill(prefill_fut: asyncio.Future[Any], decode_call: grpc.aio.UnaryStreamCall) -> None:
    """Cancel the decode call of a prefill that failed: at once, or after
    :data:`_CAUSE_WINDOW_S` when :func:`~pdgrpc.state.route_fate.decode_outlives` says so."""
    if not _failed(prefill_fut):
        return
    failure = prefill_fut.exception()
    if isinstance(failure, _AttemptFailed) and decode_outlives(failure.end):
        asyncio.get_running_loop().call_later(_CAUSE_WINDOW_S, decode_call.cancel)
    else:
        decode_call.cancel()


def _describe(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return code or grpc.StatusCode.UNKNOWN, details or ""


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Routes each ``Generate`` to one prefill and one decode; see the module doc."""

    def __init__(
        self, config: RouterConfig, pool: ChannelPool | None = None, metrics: RouterMetrics | None = None,
        view: MembershipView | None = None, index: PrefixIndex | None = None,
        decode_capabilities: Callable[[str], frozenset[str]] = lambda address: frozenset(),
    ) -> None:
        """``index``: the prefills' and decodes' cached prefixes, which ``cache_aware`` reads
        (its feeds, :class:`~pdgrpc.router.kv_events.KvEventFollower`, keep it current);
        ``decode_capabilities``: what a decode advertises (its feed's
        :meth:`~pdgrpc.router.kv_events.KvEventFollower.capabilities`)."""
        self.config = config
        # Without a feed the index stays empty: cache_aware then picks as least_load does.
        index = index if index is not None else PrefixIndex()
        self._index = index
        self._local_rule = config.local_prefill
        # Prompts each decode computes locally whose first token has not come yet.
        self._local_prefills = InFlight()
        self._decode_capabilities = decode_capabilities
        self.policy = Policy(config.policy, index, config.cache_aware_margin)
        self.decode_policy = Policy("cache_aware" if config.policy == "cache_aware" else "round_robin", index, config.cache_aware_margin)
        self.metrics = metrics or RouterMetrics()
        self._open = OpenCalls(config.max_requests_per_client, "Generate", "--max-requests-per-client")
        # With discovery, each channel to an instance expects its record's signer in every handshake.
        # Tested against None: a pool that holds no channel yet is falsy (it has a length).
        self._pool = pool if pool is not None else ChannelPool(server_names=None if view is None else view.server_name)
        # The servers this router calls over their local sockets (pdgrpc.rpc.local), by address.
        token = current().call_metadata()
        self._sockets = {
            address: LocalChannel(path, token)
            for address, path in [*((p.address, p.local) for p in config.prefills), *config.decode_sockets] if path
        }
        # With discovery: the live view from etcd, read on every request.
        self._view = view
        self._turn = 0
        self._ejections = Ejections(config.eject_s, time.monotonic)
        self._limits = RouteLimits(config.retries, config.migration_limit, config.migration_seq_len)
        self._tokenizer: Any = ByteTokenizer()
        if config.model:  # the checkpoint's tokenizer (torch-free: tokenizers only)
            from pdgrpc.engine.hf.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(config.model)
        self.active = 0  # requests in flight (for logs and tests)
        # Prefill calls in flight under cache_aware, by their prompt's ticket in the index.
        self._leaders: dict[int, asyncio.Future[prefill_pb2.PrefillResponse | None]] = {}

    async def close(self) -> None:
        await self._pool.close()
        for channel in self._sockets.values():
            await channel.close()

    def _channel(self, side: Side, address: str) -> Any:
        """What makes a ``side`` call to ``address`` now: its local socket's channel, else
        its gRPC channel. Raises :class:`_AttemptFailed` (INTERNAL, an internal error) when
        the router cannot make the channel, e.g. the TLS files it reads are unreadable: the
        router's own failure, which no retry on another instance would mend."""
        local = self._sockets.get(address)
        if local is not None:
            return local
        try:
            return self._pool.get(address)
        except Exception as exc:
            end = CallEnd(side, Ending.ANSWERED, ServerAbortReason.INTERNAL_ERROR)
            message = f"{side.value} {address}: the router cannot open a channel to it: {exc}"
            raise _AttemptFailed(RequestFailed(grpc.StatusCode.INTERNAL, message, end.reason), end) from None

    def _sent(self, side: Side, address: str) -> None:
        """A ``side`` call to ``address`` went out (counted by path)."""
        self.metrics.on_call(side.value, address in self._sockets)

    # ---- request checks -----------------------------------------------------------------

    def _too_long(self, n: int, at_least: bool = False) -> RequestFailed:
        limit = self.config.max_prompt_tokens
        return RequestFailed(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt has {'at least ' if at_least else ''}{n} tokens, over max_prompt_tokens={limit} "
            "(the router's --max-prompt-tokens)",
        )

    def _input_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        # Checked before anything walks the prompt: a 16 M-token request costs nothing here.
        limit = self.config.max_prompt_tokens
        if len(request.input_ids) > limit:
            raise self._too_long(len(request.input_ids))
        if isinstance(self._tokenizer, ByteTokenizer) and not request.input_ids and len(request.prompt) >= limit:
            # The byte tokenizer gives at least one token per character, plus BOS.
            raise self._too_long(len(request.prompt) + 1, at_least=True)
        # Text and chat messages are tokenized here, in the router (see pdgrpc.serving.prompts);
        # the message size limit (pdgrpc.rpc.limits) bounds what that costs.
        try:
            ids = request_ids(request, self._tokenizer)
        except InvalidRequest as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if len(ids) > limit:
            raise self._too_long(len(ids))
        return ids

    @staticmethod
    def _sampling(request: generate_pb2.GenerateRequest) -> common_pb2.SamplingParams:
        sampling = with_seed(request.sampling)  # drawn here, once: both legs, every retry and migration sample alike
        if sampling.max_new_tokens == 0:
            sampling.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        # Checked here, where the request enters: a client's bad field is refused as the
        # client's mistake, before a prefill and a decode each take a room for it.
        try:
            sampling_from_proto(sampling)
        except InvalidRequest as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return sampling

    def pick(self, prompt: Sequence[int], avoid: tuple[Side, str] | None = None) -> tuple[PrefillBackend, str]:
        """The prefill and decode for the next request, among the static lists or the live,
        compatible instances of the discovery view, passing over the ejected ones
        (:mod:`pdgrpc.state.ejections`) unless every instance of the role is, and for a
        retry the instance ``avoid`` of that side, each by its role's policy
        (:mod:`pdgrpc.router.policy`). Raises :class:`RequestFailed` (UNAVAILABLE) when a
        role has no instance to go to."""
        if self._view is None:
            prefills, decodes = self.config.prefills, self.config.decodes
        else:
            prefills = tuple(PrefillBackend(p.address, p.bootstrap) for p in self._view.instances("prefill"))
            decodes = tuple(d.address for d in self._view.instances("decode"))
            for role, live in (("prefill", prefills), ("decode", decodes)):
                if not live:
                    raise RequestFailed(
                        grpc.StatusCode.UNAVAILABLE, f"no live {role} instance is registered in etcd under {self._view.prefix}"
                    )
        turn, self._turn = self._turn, self._turn + 1
        p = self._choose(Side.PREFILL, self.policy, [p.address for p in prefills], turn, prompt, avoid)
        d = self._choose(Side.DECODE, self.decode_policy, decodes, turn, prompt, avoid)
        return prefills[p], decodes[d]

    def _choose(
        self, side: Side, policy: Policy, addresses: Sequence[str], turn: int, prompt: Sequence[int],
        avoid: tuple[Side, str] | None,
    ) -> int:
        failed = avoid[1] if avoid is not None and avoid[0] is side else None
        pool = candidates(addresses, self._ejections.now(side.value), () if failed is None else (failed,))
        if not pool:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no {side.value} instance but {failed}, which failed")
        return pool[policy.choose([addresses[i] for i in pool], turn, prompt)]

    def _local(self, prompt: Sequence[int], decode: str) -> bool:
        """Whether ``decode`` computes ``prompt`` itself (local prefill): by
        :func:`~pdgrpc.state.local_prefill.prefill_where`, over what the index says the
        decode holds and this router's Prefill calls in flight. Only a decode that
        advertises local prefill on its KV event stream takes part: an older one would
        refuse a request without a prefill."""
        if self._view is None:
            prefills: Sequence[str] = [p.address for p in self.config.prefills]
        else:
            prefills = [p.address for p in self._view.instances("prefill")]
        can = LOCAL_PREFILL in self._decode_capabilities(decode)
        matched = self._index.match(prompt).get(decode, 0) if can else 0
        loads = [self.policy.load(p) for p in prefills]
        where = prefill_where(self._local_rule, len(prompt), matched, can, loads, self._local_prefills.load(decode))
        return where.local

    def _eject(self, side: Side, address: str, reason: str) -> None:
        if self._ejections.eject(side.value, address):
            self.metrics.on_eject()
            log.warning("ejecting %s %s for %.1f s: %s", side.value, address, self._ejections.seconds, reason)

    def _recovered(self, prefill: PrefillBackend | None, decode: str, sent: float) -> None:
        """``decode``, and ``prefill`` unless None, answered calls sent at ``sent``. Only an
        instance that answered is readmitted: a request that called no prefill (a local
        prefill) says nothing of the one it was paired with."""
        answered = [("decode", decode)] if prefill is None else [("prefill", prefill.address), ("decode", decode)]
        for role, address in answered:
            if self._ejections.recovered(role, address, sent):
                log.info("%s %s answered again; no longer ejected", role, address)

    # ---- the RPC ------------------------------------------------------------------------

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]  # grpc.aio allows a context.write() streaming handler that returns None
        async with self._open.held(context, self._refused_open):
            await self._generate(request, context)

    def _refused_open(self, exc: TooManyOpenCalls) -> None:
        self.metrics.on_refused()
        log.warning("refused a Generate call: %s", exc)

    async def _generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        arrived = time.perf_counter()
        # Until the first token reached the client; the prefill and decode spans are its children.
        trace = tracing.server("router", context.invocation_metadata()) if tracing.enabled else None
        room = draw_room()
        request_id = request.request_id or f"r{room:016x}"
        try:
            input_ids = self._input_ids(request)
            sampling = self._sampling(request)
            prefill, decode = self.pick(input_ids)
        except RequestFailed as f:
            self.metrics.on_refused()
            request_event(log, room, "refused", level=logging.WARNING, request_id=request_id, reason=f.message)
            if trace is not None:
                trace.end(f.message)
            await context.abort(f.code, f.message)
            return
        routed = request.routed_dp_rank if request.HasField("routed_dp_rank") else None
        timeout = self.config.request_timeout
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        deadline = time.monotonic() + timeout
        fate = RouteFate(input_ids, sampling.max_new_tokens, self._limits)
        text = self._tokenizer.stream_decoder()  # carries over a migration: a split character is sent whole
        self.active += 1
        outcome = "cancelled by client"
        try:
            while True:
                sent = time.monotonic()  # the ejections' clock: a success ends only a later ejection
                try:
                    reply = await self._attempt(
                        context, arrived, room, request_id, fate, text, sampling, routed, prefill, decode,
                        deadline - time.monotonic(), trace,
                    )
                    fate.handle(Succeeded())
                    self._recovered(None if reply is None else prefill, decode, sent)  # reply: the prefill's answer
                    break
                except _AttemptFailed as b:
                    verdict = fate.handle(AttemptFailed(b.end, time.monotonic() < deadline))
                    assert verdict is not None
                    if fate.eject is not None:
                        self._eject(fate.eject, prefill.address if fate.eject is Side.PREFILL else decode, b.failure.message)
                    if isinstance(verdict, Finish):  # the client has every token already
                        reply = None
                        break
                    again = None if isinstance(verdict, Fail) else self._another(
                        verdict.side, prefill.address if verdict.side is Side.PREFILL else decode, verdict.input_ids
                    )
                    if again is None:
                        if isinstance(verdict, Reroute):
                            fate.handle(NoInstance())
                        raise b.failure from None
                    assert isinstance(verdict, Reroute)
                    fate.handle(Rerouted())
                    if verdict.migration is None:
                        self.metrics.on_retry()
                        what = "retrying"
                    else:
                        self.metrics.on_migration(verdict.migration)
                        what = f"migrating after {len(fate.generated)} token(s)"
                    prefill, decode = again
                    new_room = draw_room()
                    request_event(
                        log, room, f"{what} on prefill {prefill.address} and decode {decode}", level=logging.WARNING,
                        request_id=request_id, failed=b.end.side.value, reason=b.failure.message, next_room=new_room,
                    )
                    room = new_room
            outcome = "finished"
            self.metrics.on_finished()
            request_event(
                log, room, "finished", request_id=request_id, tokens=len(fate.generated), migrations=fate.migrations,
                seconds=f"{time.perf_counter() - arrived:.3f}",
                prefill_dp_rank="-" if reply is None else reply.dp_rank,
                bytes_transferred="-" if reply is None else reply.bytes_transferred,
            )
        except RequestFailed as f:
            outcome = "failed"
            self.metrics.on_abort(f.reason)
            request_event(log, room, "failed", level=logging.WARNING, request_id=request_id, code=f.code.name, reason=f.message)
            if trace is not None:
                trace.end(f.message)
            await context.abort(f.code, f.message)
        except Exception as exc:
            if context.cancelled():  # a write that met the client's cancel: that is how it ended
                raise
            # A bug: the client is told INTERNAL and why, the log has the traceback, and the
            # count is an internal error's, not a cancel's.
            outcome = "failed"
            self.metrics.on_abort(ServerAbortReason.INTERNAL_ERROR)
            log.exception("room %d: the router failed the request", room)
            request_event(log, room, "failed", level=logging.ERROR, request_id=request_id, code="INTERNAL", reason=repr(exc))
            if trace is not None:
                trace.end(repr(exc))
            await context.abort(grpc.StatusCode.INTERNAL, f"the router failed the request: {exc!r}")
        finally:
            self.active -= 1
            if trace is not None:  # still open: cancelled before the first token
                trace.end(outcome)
            if outcome == "cancelled by client":
                self.metrics.on_abort(AbortReason.CANCELLED)
                request_event(log, room, "cancelled by client; prefill and decode calls cancelled", request_id=request_id)

    def _another(self, side: Side, failed: str, prompt: Sequence[int]) -> tuple[PrefillBackend, str] | None:
        """A prefill and decode for a retry whose ``side`` instance is not ``failed``; None
        when there is no other instance of that role."""
        try:
            return self.pick(prompt, avoid=(side, failed))
        except RequestFailed:
            return None

    async def _attempt(
        self, context: grpc.aio.ServicerContext, arrived: float, room: int, request_id: str, fate: RouteFate, text: Any,
        sampling: common_pb2.SamplingParams, routed: int | None, prefill: PrefillBackend, decode: str, timeout: float,
        trace: tracing.Hops | None = None,
    ) -> prefill_pb2.PrefillResponse | None:
        """One prefill call and one decode call for ``room`` that go on from ``fate``
        (prompt + generated tokens, the tokens left), or the decode call alone for a local
        prefill, the decode's tokens relayed to the client through the text decoder
        ``text``: the prefill's reply (None if it had not come, or there was no prefill
        call). ``trace``: the request's span, the parent of both calls', ended at the
        first token. Raises :class:`_AttemptFailed`; both calls are over when it returns."""
        # Goes to exactly these two peers: the decode proves it to the prefill in its
        # Handshake and AbortRoom calls (pdgrpc.serving.room_proof).
        secret = draw_secret()
        input_ids = fate.input_ids()
        if fate.started:  # a migration: the same seed, only the tokens still to come
            left = common_pb2.SamplingParams()
            left.CopyFrom(sampling)
            left.max_new_tokens = fate.remaining()
            sampling = left
        prefill_req = prefill_pb2.PrefillRequest(
            bootstrap_room=room, request_id=request_id, input_ids=input_ids, sampling=sampling, room_secret=secret
        )
        decode_req = decode_pb2.DecodeRequest(
            bootstrap_room=room, request_id=request_id, input_ids=input_ids, sampling=sampling,
            prefill_bootstrap_address=prefill.bootstrap, room_secret=secret,
        )
        # A request pinned to a prefill dp rank goes to that prefill.
        local = routed is None and self._local(input_ids, decode)
        decode_req.local_prefill = local
        if not local and self.policy.name == "cache_aware":
            timeout -= await self._after_leader(prefill.address, input_ids, timeout)
        if routed is not None:
            prefill_req.routed_dp_rank = routed
            decode_req.routed_dp_rank = routed

        # Both at once: the decode's handshake overlaps the prefill's compute. Both channels
        # first: one the router cannot make ends the attempt before either call goes out, so
        # no call is left running without its other half.
        decode_channel = self._channel(Side.DECODE, decode)
        prefill_channel = None if local else self._channel(Side.PREFILL, prefill.address)
        metadata = None if trace is None else trace.metadata()
        if trace is not None:  # the router's own work ends here: the rest of the hop is the call's way
            trace.hop("router.prepare")
        # The prefill sends the first token ahead, unless one token is left: the decode's
        # message then ends the stream and says why.
        ahead = not local and self.config.first_token == "prefill" and fate.remaining() > 1
        prefill_call: grpc.aio.Call | None = None
        if prefill_channel is not None:
            prefill_stub = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
            prefill_call = (prefill_stub.PrefillStream if ahead else prefill_stub.Prefill)(
                prefill_req, timeout=timeout, metadata=metadata)
        # Linux wakes the reader of a local socket on the writer's core, behind it: the
        # prefill's chain to its compute steps in first, and the decode, which only has
        # to handshake before the compute ends, after it. (A gRPC call is not sent yet.)
        if prefill_call is not None and prefill.address in self._sockets:
            os.sched_yield()
        decode_call = decode_pb2_grpc.DecodeServiceStub(decode_channel).Decode(decode_req, timeout=timeout, metadata=metadata)
        if prefill_call is not None:
            self._sent(Side.PREFILL, prefill.address)
        self._sent(Side.DECODE, decode)
        # Deferred: a local socket's calls are written already, a gRPC call's send is queued
        # on the loop; both go out before this line.
        request_event(
            log, room, "admitted", request_id=request_id, prompt_tokens=len(input_ids),
            max_new_tokens=sampling.max_new_tokens, prefill="local" if local else prefill.address, decode=decode,
            routed_dp_rank="-" if routed is None else routed, defer=True,
        )
        prefill_fut: asyncio.Future[prefill_pb2.PrefillResponse | None]
        # The first token the prefill sends ahead, once it is there.
        first_token: asyncio.Future[list[int]] | None = asyncio.get_running_loop().create_future() if ahead else None
        if prefill_call is None:  # local prefill: nothing to wait for, nothing to fail
            prefill_fut = asyncio.get_running_loop().create_future()
            prefill_fut.set_result(None)
        else:
            prefill_fut = asyncio.ensure_future(self._await_prefill(prefill_call, prefill.address, first_token))
            self.policy.started(prefill.address)
            prefill_fut.add_done_callback(lambda _: self.policy.finished(prefill.address))
            if self.policy.name == "cache_aware":  # the prompt counts as cached there from now on
                ticket = self._index.routed(prefill.address, input_ids, time.monotonic())
                self._leaders[ticket] = prefill_fut
                prefill_fut.add_done_callback(lambda fut: self._ended(ticket, fut))
        self.decode_policy.started(decode)
        # A local prefill counts until its first token comes (or the attempt ends).
        computed_here: asyncio.Future[None] | None = None
        if local:
            computed_here = asyncio.get_running_loop().create_future()
            self._local_prefills.started(decode)
            computed_here.add_done_callback(lambda _: self._local_prefills.finished(decode))
        try:
            await self._relay(
                context, room, arrived, fate, text, prefill_fut, decode_call, decode, trace, seed=sampling.seed,
                first_token=first_token, first_message=computed_here,
            )
            # Normally done already; its reply carries the transfer figures for the log.
            done, _ = await asyncio.wait({prefill_fut}, timeout=_PREFILL_TAIL_S)
            reply = prefill_fut.result() if done and prefill_fut.exception() is None else None
            return reply
        finally:
            # Whatever happened (success, failure, client cancel), nothing stays open upstream:
            # a cancelled Decode aborts the room and frees its pages; a cancelled Prefill
            # stops computing and releases its worker's pages.
            decode_call.cancel()
            if computed_here is not None and not computed_here.done():
                computed_here.cancel()
            self.decode_policy.finished(decode)
            if prefill_call is not None:
                prefill_call.cancel()
            if not prefill_fut.done():
                prefill_fut.cancel()
            elif not prefill_fut.cancelled():
                prefill_fut.exception()  # retrieved: a failure already handled is not "never retrieved"

    async def _after_leader(self, address: str, prompt: Sequence[int], timeout: float) -> float:
        """Wait for the Prefill call on ``address`` that computes more of ``prompt``'s
        prefix than it has cached (:meth:`~pdgrpc.state.prefix_index.PrefixIndex.leader`),
        so that this prompt finds that prefix cached instead of computing it beside it;
        the seconds waited; bounded by :func:`~pdgrpc.state.prefix_leaders.leader_wait_s`
        of ``timeout``."""
        ticket = self._index.leader(address, prompt)
        leader = self._leaders.get(ticket) if ticket is not None else None
        if leader is None:
            return 0.0
        start = time.monotonic()
        await asyncio.wait({leader}, timeout=leader_wait_s(timeout))
        return time.monotonic() - start

    def _ended(self, ticket: int, prefill_fut: asyncio.Future[Any]) -> None:
        del self._leaders[ticket]
        self._index.ended(ticket, _succeeded(prefill_fut), time.monotonic())

    @staticmethod
    async def _await_prefill(
        call: Any, address: str, first_token: asyncio.Future[list[int]] | None = None
    ) -> prefill_pb2.PrefillResponse | None:
        """The prefill's reply: ``call``'s (a Prefill call), or the last message of a
        PrefillStream call, whose first token sets ``first_token``."""
        try:
            if first_token is None:
                return cast(prefill_pb2.PrefillResponse, await call)
            reply = None
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.token_ids and not first_token.done():
                    first_token.set_result(list(msg.token_ids))
                if msg.HasField("reply"):
                    reply = msg.reply
            if reply is None:
                end = CallEnd(Side.PREFILL, Ending.ANSWERED, ServerAbortReason.PREFILL_ERROR)
                message = f"prefill {address} ended its PrefillStream without a reply"
                raise _AttemptFailed(RequestFailed(grpc.StatusCode.INTERNAL, message, end.reason), end)
            return reply
        except grpc.RpcError as exc:
            code, details = _describe(exc)
            end = prefill_failure(_ending(code))
            message = f"prefill {address} failed: {code.name}: {details}"
            raise _AttemptFailed(RequestFailed(_client_code(code), message, end.reason), end) from None

    async def _relay(
        self,
        context: grpc.aio.ServicerContext,
        room: int,
        arrived: float,
        fate: RouteFate,
        text: Any,
        prefill_fut: asyncio.Future[prefill_pb2.PrefillResponse | None],
        decode_call: grpc.aio.UnaryStreamCall,
        decode_address: str,
        trace: tracing.Hops | None = None,
        seed: int = 0,
        first_token: asyncio.Future[list[int]] | None = None,
        first_message: asyncio.Future[None] | None = None,
    ) -> None:
        """Forward the decode's messages to the client until the stream ends, recording
        them in ``fate``; raise :class:`_AttemptFailed` as soon as either side fails.
        ``first_token``: the prefill's first token, relayed ahead of the decode's first
        message if it comes first. ``first_message``: set when the decode's first message
        comes."""
        first = not fate.started  # the client's first message carries the request's figures
        figures = first  # and the message relaying the decode's first, the KV's
        got = False
        ahead: list[int] = []  # tokens relayed ahead, which the decode's first message repeats
        held: Any = None  # that message, when it repeats them alone: its figures go with the next
        # A prefill that fails cancels the decode call, which ends the pending read: every
        # message is read straight from the call, with no task or wait racing the two,
        # except the decode's first while the prefill's first token may come before it.
        prefill_fut.add_done_callback(lambda fut: _cancel_after_prefill(fut, decode_call))
        pending: asyncio.Future[Any] | None = None
        try:
            if first_token is not None:
                pending = asyncio.ensure_future(decode_call.read())
                await asyncio.wait({pending, first_token}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done() and first_token.done():
                    ahead = first_token.result()
                    out = generate_pb2.GenerateResponse(token_ids=ahead, text=text.feed(ahead))
                    if first:
                        first = False
                        self._first_figures(out, arrived, room, seed)
                    self.metrics.on_tokens(len(ahead))
                    await context.write(out)
                    fate.handle(Relayed(ahead))
                    if trace is not None:
                        trace.end()
            while True:
                try:
                    if pending is not None:
                        msg, pending = await pending, None
                    else:
                        msg = await decode_call.read()
                except grpc.RpcError as exc:
                    raise await self._decode_failure(exc, decode_address, prefill_fut) from None
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if _failed(prefill_fut) and (task is None or not task.cancelling()):
                        cause = prefill_fut.exception()
                        assert isinstance(cause, _AttemptFailed)
                        raise cause from None
                    raise
                if msg is grpc.aio.EOF:
                    if not got:
                        message = f"decode {decode_address} ended the stream without a token"
                        end = CallEnd(Side.DECODE, Ending.ANSWERED, ServerAbortReason.DECODE_ERROR)
                        raise _AttemptFailed(RequestFailed(grpc.StatusCode.INTERNAL, message, end.reason), end)
                    return
                ids = list(msg.token_ids)
                got = True
                if first_message is not None and not first_message.done():
                    first_message.set_result(None)
                if ahead:
                    ids = self._past_ahead(ahead, ids, decode_address)
                    ahead = ahead[len(msg.token_ids):]
                    if not ids and not msg.finish_reason:
                        held = msg
                        continue
                out = generate_pb2.GenerateResponse(token_ids=ids, text=text.feed(ids), finish_reason=msg.finish_reason)
                if msg.finish_reason:
                    out.text += text.flush()
                if first:
                    first = False
                    self._first_figures(out, arrived, room, seed)
                if figures:
                    figures = False
                    kv = held or msg
                    out.bytes_transferred = kv.bytes_transferred
                    out.transfer_seconds = kv.transfer_seconds
                    out.data_plane_seconds = kv.data_plane_seconds
                    out.cached_tokens = kv.cached_tokens
                self.metrics.on_tokens(len(ids))
                await context.write(out)
                fate.handle(Relayed(ids, bool(msg.finish_reason)))  # what the client has: a migration goes on from here
                if trace is not None:  # the first token is out (later: a no-op)
                    trace.end()
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _first_figures(self, out: generate_pb2.GenerateResponse, arrived: float, room: int, seed: int) -> None:
        """What the client's first message carries: TTFT, the room and the seed."""
        out.ttft_seconds = time.perf_counter() - arrived
        self.metrics.on_first_token(out.ttft_seconds)
        out.bootstrap_room = room
        out.seed = seed

    @staticmethod
    def _past_ahead(ahead: list[int], ids: list[int], decode_address: str) -> list[int]:
        """The decode's tokens ``ids`` past those relayed ``ahead`` from the prefill, which
        they repeat: both are the metadata row's token, so a difference is a broken decode."""
        n = min(len(ahead), len(ids))
        if ids[:n] != ahead[:n]:
            message = f"decode {decode_address} sent tokens {ids[:n]} where the prefill's first token was {ahead[:n]}"
            end = CallEnd(Side.DECODE, Ending.ANSWERED, ServerAbortReason.DECODE_ERROR)
            raise _AttemptFailed(RequestFailed(grpc.StatusCode.INTERNAL, message, end.reason), end)
        return ids[n:]

    @staticmethod
    async def _decode_failure(
        exc: grpc.RpcError, address: str, prefill_fut: asyncio.Future[prefill_pb2.PrefillResponse | None]
    ) -> _AttemptFailed:
        """What ended the decode call ``exc``, put down to the side that failed
        (:func:`~pdgrpc.state.route_fate.blame_decode`)."""
        code, details = _describe(exc)
        decode_msg = f"decode {address} failed: {code.name}: {details}"
        ending, said = _ending(code), reason_of(exc)
        waited = False
        while True:
            cause = prefill_fut.exception() if prefill_fut.done() and not prefill_fut.cancelled() else None
            assert cause is None or isinstance(cause, _AttemptFailed)
            prefill = PrefillCall.RUNNING if not prefill_fut.done() else PrefillCall.FAILED if cause else PrefillCall.ANSWERED
            found = blame_decode(ending, said, prefill, None if cause is None else cause.end, waited)
            if found is not None:
                break
            await asyncio.wait({prefill_fut}, timeout=_CAUSE_WINDOW_S)
            waited = True
        blame, end = found
        if blame is Blame.PREFILL_CAUSE:
            assert cause is not None
            prior = cause.failure
            return _AttemptFailed(RequestFailed(prior.code, f"{prior.message} (and {decode_msg})", prior.reason), end)
        return _AttemptFailed(RequestFailed(_client_code(code), decode_msg, end.reason), end)


def service_names() -> Sequence[str]:
    return [generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name]
