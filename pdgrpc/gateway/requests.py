"""smg's ``GenerateRequest`` -> what pdgrpc's prefill and decode take (pure; no I/O).

:func:`convert` checks a ``sglang.grpc.scheduler.GenerateRequest`` and turns it into a
:class:`GatewayRequest`: the bootstrap room, the prompt, pdgrpc's
:class:`pdgrpc.v1.common_pb2.SamplingParams`, and what the decode leg applies on top of
the engine (stop token ids, logprobs in the reply). Anything the engine cannot honour is
refused with :class:`~pdgrpc.errors.RequestFailed` (INVALID_ARGUMENT) naming the field,
never ignored.

**Rooms.** smg draws ``bootstrap_room`` at random in ``[0, 2**31)``, so 0 is possible,
while 0 means "not written" in pdgrpc's metadata row and pdgrpc's own router draws
63-bit rooms. Both legs therefore map smg's room ``r`` to ``ROOM_BASE + r`` with
``ROOM_BASE = 2**62``: never 0, equal on both legs (the same function of the same
number), and inside a band, ``[2**62, 2**62 + 2**31)``, from which
:func:`pdgrpc.router.service.draw_room` never draws, so a gateway request never shares a
room with a router request on the same prefill.

**Room secret.** smg sends no per-request secret, but both legs get the same
``request_id``, which smg draws at random (``cmpl-`` + 24 random characters + a UUIDv7)
and sends to those two workers only. Both legs use ``room_secret(request_id, key)`` as
the request's ``room_secret``: HMAC-SHA256 under the cluster's smg room key
(``--smg-room-key-file``, shared by the prefill and decode servers), so the decode's
Handshake and AbortRoom calls and its failure watch prove the room as a router
request's do, and a request id, which logs show, proves nothing without the key.
Without a key the secret is SHA-256 of the request id under a fixed prefix: then
whoever reads a request id can abort or watch its room. An empty ``request_id`` gives
no secret (the room is then unbound, as without one).

**Seed.** smg 1.13.0 forwards no OpenAI ``seed`` (its ``SamplingParams`` has no seed
field, and it sends no ``custom_params`` either); a raw client may put an integer ``seed``
in ``custom_params``, which is honoured. A request without one samples with a seed drawn
from its ``request_id`` (:func:`request_seed`; from its bootstrap room when the id is
empty): both legs see the same values, so the prefill's first token and the decode's tokens come from one seed; smg
draws a fresh ``request_id`` for every request, so two requests sample differently; and
for ``n > 1`` smg sends ``n`` requests whose ids end ``-0``, ``-1``, ..., each with its
own seed, so the choices differ. A request with neither id nor room (a raw call to a
colocated worker) gets a random seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import re
import secrets
from typing import Any

from pdgrpc.engine.base import InvalidRequest
from pdgrpc.errors import RequestFailed
from pdgrpc.gateway.statuses import Refusal, ending
from pdgrpc.rpc.limits import MAX_HOST_CHARS
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.state.room import ROOM_BASE, ROOM_SPAN, Room
from pdgrpc.v1 import common_pb2

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "ROOM_BASE", "GatewayRequest", "convert", "map_room", "request_seed", "room_secret"]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when max_new_tokens is unset
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_BYTES = 256  # bytes per stop string
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request: each is held for the request's life
_SEED_LIMIT = 1 << 64


@dataclasses.dataclass(frozen=True)
class GatewayRequest:
    request_id: str
    room: int  # pdgrpc room (0 when the request has no disaggregated_params)
    input_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams
    stop_token_ids: frozenset[int]
    stop_strings: tuple[bytes, ...]  # UTF-8; matched on the output bytes (the tokens are bytes)
    no_stop_trim: bool  # keep a matched stop string in the output
    return_logprob: bool
    bootstrap_address: str  # "host:port" of the prefill's BootstrapService ("" without disaggregated_params)
    routed_dp_rank: int | None
    stream: bool
    room_secret: bytes = dataclasses.field(default=b"", repr=False)  # both legs sign with it (see the module doc)


_SECRET_PREFIX = b"pdgrpc.v1 smg room secret\0"


def room_secret(request_id: str, key: bytes = b"") -> bytes:
    """The ``room_secret`` both legs of smg's request ``request_id`` use, under the
    cluster's smg room ``key`` (see the module doc)."""
    if not request_id:
        return b""
    message = _SECRET_PREFIX + request_id.encode("utf-8", errors="surrogatepass")
    return hmac.new(key, message, hashlib.sha256).digest() if key else hashlib.sha256(message).digest()


_SEED_PREFIX = b"pdgrpc.v1 smg seed\0"


def request_seed(request_id: str, room: int = 0) -> int:
    """The sampling seed of smg's request ``request_id`` when it names none (see the
    module doc); ``room`` (smg's ``bootstrap_room``, 0 without one) stands in for an
    empty ``request_id``."""
    if request_id:
        key = request_id.encode("utf-8", errors="surrogatepass")
    elif room:
        key = b"\0room" + room.to_bytes(8, "little")
    else:
        return secrets.randbits(64)
    return int.from_bytes(hashlib.sha256(_SEED_PREFIX + key).digest()[:8], "little")


def _bad(message: str) -> RequestFailed:
    return ending(Refusal.BAD_REQUEST, message)


def map_room(room: int) -> Room:
    """smg's ``bootstrap_room`` -> pdgrpc's room (see the module doc). smg's room is its
    own int32 range, checked here; the room it maps to is in range by construction."""
    if not 0 <= room < ROOM_SPAN:
        raise _bad(f"disaggregated_params.bootstrap_room must be in [0, 2**31), got {room}")
    return Room(ROOM_BASE + room)


def _unsupported(req: Any, sp: Any) -> str | None:
    """The first field set to something the engine cannot honour, as ``name (value)``."""
    checks = (
        ("sampling_params.min_p", sp.min_p, 0.0),
        ("sampling_params.frequency_penalty", sp.frequency_penalty, 0.0),
        ("sampling_params.presence_penalty", sp.presence_penalty, 0.0),
        ("sampling_params.min_new_tokens", sp.min_new_tokens, 0),
    )
    for name, value, neutral in checks:
        if value != neutral:
            return f"{name} ({value!r})"
    rep = sp.repetition_penalty
    if rep not in (0.0, 1.0):  # 0: unset; 1: neutral
        return f"sampling_params.repetition_penalty ({rep!r})"
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        return f"sampling_params.{constraint} (constrained decoding)"
    if sp.n > 1:
        return f"sampling_params.n ({sp.n}; one sample per request)"
    if len(sp.logit_bias):
        return "sampling_params.logit_bias"
    for name in ("lora_id", "custom_logit_processor"):
        if getattr(req, name):
            return name
    if req.return_hidden_states:
        return "return_hidden_states"
    if len(req.input_embeds):
        return "input_embeds"
    if len(req.token_ids_logprob):
        return "token_ids_logprob"
    if req.return_logprob and req.logprob_start_len >= 0:
        return f"logprob_start_len ({req.logprob_start_len}; prompt logprobs)"
    if req.HasField("mm_inputs"):
        return "mm_inputs"
    return None


_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a DNS name, a name of /etc/hosts, or an IPv4 address


def _bootstrap_host(host: str) -> str:
    """``disaggregated_params.bootstrap_host`` as the host part of a ``host:port`` (an IPv6
    address in brackets). A host name or an IP literal, else refused: no bootstrap answers
    at anything else, and the decode would dial it until its bootstrap deadline."""
    if len(host) > MAX_HOST_CHARS:
        raise _bad(f"disaggregated_params.bootstrap_host: {len(host)} characters, over the limit of {MAX_HOST_CHARS}")
    if _HOST_NAME.fullmatch(host):
        return host
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.IPv6Address(literal)
    except ValueError:
        raise _bad(f"disaggregated_params.bootstrap_host {host!r} is not a host name or an IP address") from None
    return f"[{literal}]"


def _stop_strings(stop: Any) -> tuple[bytes, ...]:
    out = []
    for i, text in enumerate(stop):
        data = text.encode("utf-8", errors="surrogatepass")
        if not data or len(data) > MAX_STOP_BYTES:
            raise _bad(f"sampling_params.stop[{i}] must be 1 to {MAX_STOP_BYTES} bytes of UTF-8, got {len(data)}")
        out.append(data)
    if len(out) > MAX_STOP_STRINGS:
        raise _bad(f"sampling_params.stop has {len(out)} strings, over the limit of {MAX_STOP_STRINGS}")
    return tuple(out)


def _seed(req: Any) -> int:
    custom = req.sampling_params.custom_params
    if "seed" not in custom.fields:
        room = req.disaggregated_params.bootstrap_room if req.HasField("disaggregated_params") else 0
        return request_seed(req.request_id, room)
    value = custom["seed"]
    if not isinstance(value, float) or not value.is_integer() or not 0 <= value < _SEED_LIMIT:
        raise _bad(f"sampling_params.custom_params.seed must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def convert(req: Any, *, disaggregated: bool, max_seq_len: int, room_key: bytes = b"") -> GatewayRequest:
    """Check smg's ``GenerateRequest`` ``req`` and convert it (see the module doc).

    ``disaggregated``: this worker is a prefill or a decode, so ``disaggregated_params``
    must be there. ``max_seq_len``: caps the default ``max_new_tokens``. ``room_key``:
    the cluster's smg room key, under which the room secret is derived."""
    sp = req.sampling_params
    bad = _unsupported(req, sp)
    if bad is not None:
        raise _bad(f"{bad} is not supported by the pdgrpc engine")
    ids = tuple(req.tokenized.input_ids)
    if not ids:
        raise _bad("tokenized.input_ids is empty (the prompt needs at least one token)")
    top_k = sp.top_k
    if top_k < -1:
        raise _bad(f"sampling_params.top_k must be -1 (no cut) or >= 0, got {top_k}")
    top_n = req.top_logprobs_num
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    if sp.HasField("max_new_tokens"):
        max_new = int(sp.max_new_tokens)
        if max_new < 1:
            raise _bad(f"sampling_params.max_new_tokens must be >= 1, got {max_new} (prompt-only scoring is not supported)")
    else:
        max_new = max(1, min(DEFAULT_MAX_NEW_TOKENS, max_seq_len - len(ids)))
    sampling = common_pb2.SamplingParams(
        temperature=float(sp.temperature),
        top_k=max(0, top_k),
        top_p=float(sp.top_p),
        seed=_seed(req),
        top_logprobs=top_n if req.return_logprob else 0,
        max_new_tokens=max_new,
        ignore_eos=bool(sp.ignore_eos),
    )
    try:  # the engine's ranges, named as smg's fields
        sampling_from_proto(sampling)
    except InvalidRequest as exc:
        raise _bad(str(exc).replace("sampling.", "sampling_params.", 1)) from None
    room, address = 0, ""
    if req.HasField("disaggregated_params"):
        dp = req.disaggregated_params
        room = map_room(dp.bootstrap_room)
        if not dp.bootstrap_host:
            raise _bad("disaggregated_params.bootstrap_host is empty")
        if not 0 < dp.bootstrap_port < 65536:
            raise _bad(f"disaggregated_params.bootstrap_port must be in [1, 65535], got {dp.bootstrap_port}")
        address = f"{_bootstrap_host(dp.bootstrap_host)}:{dp.bootstrap_port}"
    elif disaggregated:
        raise _bad("disaggregated_params is not set (a prefill or decode worker needs bootstrap_host, bootstrap_port and bootstrap_room)")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"sampling_params.stop_token_ids has {len(sp.stop_token_ids)} ids, over the limit of {MAX_STOP_TOKEN_IDS}")
    routed = None
    if req.HasField("data_parallel_rank"):
        routed = int(req.data_parallel_rank)
        if routed < 0:
            raise _bad(f"data_parallel_rank must be >= 0, got {routed}")
    return GatewayRequest(
        request_id=req.request_id,
        room=room,
        input_ids=ids,
        sampling=sampling,
        stop_token_ids=frozenset(sp.stop_token_ids),
        stop_strings=_stop_strings(sp.stop),
        no_stop_trim=bool(sp.no_stop_trim),
        return_logprob=bool(req.return_logprob),
        bootstrap_address=address,
        routed_dp_rank=routed,
        stream=bool(req.stream),
        room_secret=room_secret(req.request_id, room_key) if room else b"",
    )
