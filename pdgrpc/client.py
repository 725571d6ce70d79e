"""``python -m pdgrpc.client ROUTER PROMPT``: send one request to a GenerateService.

A thin command over :func:`pdgrpc.cluster.client.generate` for a shell::

    python -m pdgrpc.client 127.0.0.1:50051 "The capital of France is" --max-new-tokens 8
    python -m pdgrpc.client 127.0.0.1:50051 "Say hi." --chat --stream
    python -m pdgrpc.client 127.0.0.1:50051 "hello" --temperature 1 --json

It prints the generated text, then the response's timing fields (TTFT as the server and
as this client measured it, the KV bytes moved, the data-plane time and rate, the room)
and the sampling seed, which replays the output exactly when sent back with ``--seed``.
``--chat`` sends the prompt as one user message, rendered with the served model's chat
template; ``--stream`` prints the text as it arrives; ``--json`` prints one JSON object
instead (with ``--stream``: one per message as it arrives, then the completion). ROUTER is any GenerateService: a router or a colocated server. A failed call
prints its gRPC status and message (and, for a call without ``--tls-ca`` to a server that
speaks TLS, which flags to pass) and exits 1; a bad flag exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import socket
import ssl
import sys
from pathlib import Path
from typing import Callable, Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from pdgrpc.argtypes import positive_seconds, whole_number
from pdgrpc.cluster.client import Completion, generate
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import generate_pb2, generate_pb2_grpc

__all__ = ["build_parser", "main"]

_UINT32_MAX = 2**32 - 1  # the width of SamplingParams' count fields


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdgrpc.client",
        description="Send one request to a pdgrpc router (GenerateService) and print the generated text and its timings.",
    )
    p.add_argument("router", metavar="ROUTER", help="HOST:PORT of the router (or of a colocated server)")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true", help="send PROMPT as one user message, rendered with the served model's chat template")
    p.add_argument("--stream", action="store_true", help="print the text as it arrives (with --json: one JSON object per message)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text: the completion and its fields")
    p.add_argument("--max-new-tokens", type=whole_number(1, maximum=_UINT32_MAX), default=16, help="tokens to generate at most. Default: %(default)s")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy. Default: %(default)s")
    p.add_argument("--top-k", type=whole_number(0, maximum=_UINT32_MAX), default=0, help="keep only the k most likely tokens; 0: no cut. Default: %(default)s")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus cut-off in (0, 1]; 0: no cut. Default: %(default)s")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; without it the server draws one and it is printed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    p.add_argument("--timeout", type=positive_seconds, default=120.0, help="deadline of the call in seconds. Default: %(default)s")
    p.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA certificate to check a TLS router against (its public port's)")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate to present (mTLS; a local cluster's security/client.pem)")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--auth-token-file", type=Path, metavar="FILE", help="file holding the cluster's bearer token, sent with the call")
    return p


def _fields(c: Completion) -> dict[str, object]:
    return {**dataclasses.asdict(c), "token_ids": list(c.token_ids), "gbps": c.gbps}


def _summary(c: Completion) -> str:
    rate = f", {c.gbps:.3f} GB/s" if c.gbps else ""
    return (
        f"[{len(c.token_ids)} tokens, finish {c.finish_reason}; ttft {c.ttft_seconds * 1e3:.1f} ms "
        f"(client {c.client_ttft_seconds * 1e3:.1f} ms); kv {c.bytes_transferred} B in "
        f"{c.data_plane_seconds * 1e3:.2f} ms{rate}; transfer {c.transfer_seconds * 1e3:.1f} ms; "
        f"room {c.bootstrap_room}; seed {c.seed}]"
    )


def _printer(ns: argparse.Namespace) -> Callable[[generate_pb2.GenerateResponse], None] | None:
    """With --stream: what prints each message as it arrives (its text, or its fields)."""
    if not ns.stream:
        return None
    if ns.json:
        return lambda msg: print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True)), flush=True)
    return lambda msg: print(msg.text, end="", flush=True)


async def _run(ns: argparse.Namespace) -> None:
    security = Security(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca, token_file=ns.auth_token_file)
    async with security.channel(ns.router) as channel:
        done = await generate(
            generate_pb2_grpc.GenerateServiceStub(channel),
            prompt="" if ns.chat else ns.prompt, messages=[{"role": "user", "content": ns.prompt}] if ns.chat else (),
            max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, seed=ns.seed, top_k=ns.top_k,
            top_p=ns.top_p, ignore_eos=ns.ignore_eos, timeout=ns.timeout, on_message=_printer(ns),
        )
    if ns.json:
        print(json.dumps(_fields(done)))
    else:
        print("" if ns.stream else done.text)
        print(_summary(done))


def _check_sampling(ns: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for sampling values every server refuses: the
    servers' own rule (:class:`SamplingParams`), applied before the call."""
    try:
        SamplingParams(
            temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p or 1.0,  # 0: no cut, read as 1
            seed=0 if ns.seed is None else ns.seed,
        )
    except InvalidRequest as exc:
        raise ValueError(re.sub(r"sampling\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        _check_sampling(ns)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        asyncio.run(_run(ns))
    except grpc.aio.AioRpcError as exc:
        print(f"{ns.router}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and ns.tls_ca is None and _speaks_tls(ns.router):
            print(
                f"{ns.router} speaks TLS: pass --tls-ca (and --tls-cert/--tls-key where it asks for a client "
                "certificate); `python -m pdgrpc.cluster` prints the flags its clients present", file=sys.stderr,
            )
        return 1
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _speaks_tls(address: str, timeout: float = 2.0) -> bool:
    """Whether ``HOST:PORT`` answers a TLS hello: a plaintext call to a TLS server fails in
    gRPC as a bare UNAVAILABLE, which says nothing of the cause."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            with context.wrap_socket(sock):
                return True
    except ssl.SSLError as exc:
        # An alert from the peer (say, "certificate required") is TLS too.
        return str(exc.reason or "").startswith(("TLSV", "SSLV3_ALERT"))
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
