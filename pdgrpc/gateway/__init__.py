"""pdgrpc's prefill and decode servers as gRPC workers behind smg, SGLang's model gateway.

smg (``pip install 'pdgrpc[gateway]'``) speaks ``sglang.grpc.scheduler.SglangScheduler``
to its workers; the servers serve it beside pdgrpc's own services when the
``smg-grpc-proto`` package is installed (:func:`prefill_service`,
:func:`decode_service`, and on the colocated server, smg's non-PD worker,
:func:`colocated_service`; ``None`` without it). See ``docs/gateway.md``.

* :mod:`pdgrpc.gateway.servicer` -- the RPCs, over the servers' own handlers.
* :mod:`pdgrpc.gateway.requests` -- smg's request -> pdgrpc's, rooms, refused fields.
* :mod:`pdgrpc.gateway.stream` -- output tokens -> smg's messages; stop ids and strings.
* :mod:`pdgrpc.gateway.tokenizer` -- the engine's tokenizer files as ``GetTokenizer``'s zip.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdgrpc.rpc.drain import Drain
    from pdgrpc.rpc.server import ServiceSpec

__all__ = [
    "DEFAULT_SERVED_MODEL_NAME", "add_gateway_arguments", "available", "colocated_service", "decode_service", "prefill_service",
    "room_key", "served_model_name",
]

DEFAULT_SERVED_MODEL_NAME = "pdgrpc-reference"
ROOM_KEY_MIN_BYTES = 32

log = logging.getLogger("pdgrpc.gateway")


def available() -> bool:
    """Whether ``smg-grpc-proto`` (the ``gateway`` extra) is installed."""
    return importlib.util.find_spec("smg_grpc_proto") is not None


def add_gateway_arguments(parser: argparse.ArgumentParser, *, rooms: bool) -> None:
    """Add the flags of a server behind smg; ``rooms``: the server's smg requests have
    bootstrap rooms (prefill, decode), so it takes ``--smg-room-key-file`` too (a colocated
    server's have none, and the flag there would be taken and never read)."""
    g = parser.add_argument_group("gateway (smg's SglangScheduler protocol; needs pdgrpc[gateway])")
    g.add_argument(
        "--served-model-name", default="",
        help="model id smg shows in /v1/models and matches the OpenAI 'model' field against. Default: the checkpoint "
        f"directory's name with --model, else {DEFAULT_SERVED_MODEL_NAME}",
    )
    if rooms:
        g.add_argument(
            "--smg-room-key-file", type=Path, metavar="FILE",
            help=f"secret file (at least {ROOM_KEY_MIN_BYTES} bytes, mode 600) shared by the prefill and decode servers "
            "behind one smg: each smg request's room secret is an HMAC of its request id under it, so a request id seen in "
            "a log proves nothing. The launcher makes one per cluster. Without it the secret is derived from the request "
            "id alone",
        )
    g.add_argument(
        "--gateway-listen", type=_gateway_listen, metavar="HOST:PORT",
        help="also serve on this loopback address (127.0.0.1:PORT; nothing else is accepted), in plaintext, for smg, "
        "which presents no credential: every caller there has the gateway role alone, so it reaches smg's worker "
        "protocol and nothing else (not RegisterWorker, Handshake, Drain...). The main listener keeps its TLS and "
        "tokens for everyone else. Only local processes of this server's user (and --gateway-uid's) are served there: "
        "the kernel names the user of each call's connection. The launcher sets it behind smg when the cluster is secured",
    )
    g.add_argument(
        "--gateway-uid", type=_uid, action="append", default=[], metavar="UID",
        help="also serve the --gateway-listen listener to local processes of this numeric user id: an smg run as "
        "another user than the server's. Repeatable",
    )


def _gateway_listen(text: str) -> str:
    """``--gateway-listen``'s value, refused at parse time unless on loopback."""
    from pdgrpc.rpc.security import loopback_address

    try:
        loopback_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _uid(text: str) -> int:
    """``--gateway-uid``'s value: a numeric user id."""
    if not text.isdigit() or int(text) >= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"expected a numeric user id (0 to {2**32 - 2}), got {text!r}")
    return int(text)


def room_key(ns: argparse.Namespace) -> bytes:
    """The smg room key ``--smg-room-key-file`` holds (b"" without the flag, with a
    warning: then a request id alone gives its room secret); ConfigError naming the flag
    for a file that is unreadable, open to others or too short."""
    from pdgrpc.errors import ConfigError
    from pdgrpc.rpc.security import read_secret

    path = getattr(ns, "smg_room_key_file", None)
    if path is None:
        log.warning("smg: no --smg-room-key-file: each request's room secret is derived from its request id alone, "
                    "so whoever reads a request id (smg and the servers log them) can abort or watch its room")
        return b""
    key = read_secret(path, "--smg-room-key-file")
    if len(key) < ROOM_KEY_MIN_BYTES:
        raise ConfigError(f"--smg-room-key-file {str(path)!r} holds {len(key)} bytes; a key needs at least {ROOM_KEY_MIN_BYTES}")
    return key


def served_model_name(ns: argparse.Namespace) -> str:
    """``--served-model-name``, else the checkpoint directory's name, else the reference engine's."""
    if getattr(ns, "served_model_name", ""):
        return str(ns.served_model_name)
    model = getattr(ns, "model", "")
    return Path(model).resolve().name if model else DEFAULT_SERVED_MODEL_NAME


def prefill_service(controller: Any, ns: argparse.Namespace, prefill: Any, drain: "Drain") -> "ServiceSpec | None":
    """The SglangScheduler service over a prefill controller (``None`` without the extra);
    ``prefill``: what serves its legs' ``Prefill`` (the controller's, counted per client);
    ``drain``: its server's, which its health reports."""
    if not available():
        return None
    from pdgrpc.gateway.servicer import SERVICE_NAME, PrefillLeg, WorkerInfo, add_to_server
    from pdgrpc.serving.engines import served_tokenizer

    tokenizer = served_tokenizer(ns)  # the workers' engine runs in their own processes
    name = served_model_name(ns)
    key = room_key(ns)

    def info() -> WorkerInfo:
        # The bootstrap's port is known once the controller's server is bound.
        port = controller.bootstrap_address.rpartition(":")[2]
        return WorkerInfo(
            mode="prefill", served_model_name=name, transport=ns.transport, max_seq_len=ns.max_seq_len,
            max_prompt_tokens=ns.max_prompt_tokens, max_running_requests=ns.num_pages * ns.dp_size,
            bootstrap_port=int(port) if port.isdigit() else 0, tokenizer=tokenizer, room_key=key,
        )

    leg = PrefillLeg(
        prefill, info, active=lambda: sum(w.in_flight for w in controller.workers),
        healthy=lambda: not drain.draining and _prefill_ready(controller, ns),
        kv_events=None if ns.no_smg_kv_events else controller.kv_events,
    )
    return SERVICE_NAME, lambda server: add_to_server(leg, server)


def _prefill_ready(controller: Any, ns: argparse.Namespace) -> bool:
    """Every worker started, reported ready (its address) and alive, and no shutdown begun."""
    workers = controller.workers
    expected = ns.dp_size * getattr(ns, "tp_size", 1)
    return len(workers) == expected and not controller.stopping and all(w.alive and w.address for w in workers)


def decode_service(decode: Any, ns: argparse.Namespace, transport: str, drain: "Drain") -> "ServiceSpec | None":
    """The SglangScheduler service over a decode server's DecodeServicer (``None`` without the
    extra); ``drain``: its server's, which its health reports."""
    if not available():
        return None
    from pdgrpc.gateway.servicer import SERVICE_NAME, DecodeLeg, WorkerInfo, add_to_server

    scheduler = decode.scheduler
    engine = scheduler.engine
    fixed = WorkerInfo(
        mode="decode", served_model_name=served_model_name(ns), transport=transport, max_seq_len=engine.max_seq_len,
        max_prompt_tokens=engine.max_prompt_tokens, max_running_requests=ns.num_slots, bootstrap_port=0,
        tokenizer=engine.tokenizer, room_key=room_key(ns),
    )
    leg = DecodeLeg(
        decode, lambda: fixed, active=lambda: int(scheduler.stats().get("active_requests", 0)),
        healthy=lambda: not drain.draining and (scheduler.fatal is None or not scheduler.fatal.done()),
    )
    return SERVICE_NAME, lambda server: add_to_server(leg, server)


def colocated_service(server: Any, ns: argparse.Namespace, drain: "Drain") -> "ServiceSpec | None":
    """The SglangScheduler service over a colocated server, smg's non-PD worker (``None``
    without the extra); ``drain``: its server's, which its health reports."""
    if not available():
        return None
    from pdgrpc.gateway.servicer import SERVICE_NAME, ColocatedLeg, WorkerInfo, add_to_server

    engine = server.engine
    fixed = WorkerInfo(
        mode="null", served_model_name=served_model_name(ns), transport="none", max_seq_len=engine.max_seq_len,
        max_prompt_tokens=engine.max_prompt_tokens, max_running_requests=engine.num_pages, bootstrap_port=0,
        tokenizer=engine.tokenizer,
    )
    leg = ColocatedLeg(server, lambda: fixed, active=server.active_requests, healthy=lambda: not drain.draining)
    return SERVICE_NAME, lambda s: add_to_server(leg, s)
