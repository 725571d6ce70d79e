"""The front door of a vLLM prefill-decode pair over ``PdgrpcConnector``.

``python -m pdgrpc.integrations.vllm.proxy --prefill URL --decode URL --port N`` serves
vLLM's OpenAI routes ``/v1/completions`` and ``/v1/chat/completions``. Each request goes
to a prefill server first, as a one-token request whose ``kv_transfer_params`` ask it to
keep the KV (``do_remote_decode``); the prefill's answer carries the params the decode
needs (room, secret, handshake address, blocks), and the request then goes to a decode
server with them, whose answer (streamed or not) is the client's. The prefill's token is
not used: the decode recomputes the prompt's last position on top of the transferred
KV, so its output is what a colocated vLLM generates.

Several ``--prefill`` and ``--decode`` URLs are taken round-robin. A prefill that fails
ends the request with its status and body; an answer without ``kv_transfer_params``
(a prefill started without the connector) is a 502 that says so.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import uuid
from typing import Any, Sequence

import aiohttp
from aiohttp import web

from pdgrpc.integrations.vllm.params import PREFILL_REQUEST

__all__ = ["Proxy", "build_app", "main", "prefill_body"]

log = logging.getLogger("pdgrpc.integrations.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill gets: one token, not streamed, KV kept for a decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_REQUEST)
    return out


class Proxy:
    def __init__(self, prefills: Sequence[str], decodes: Sequence[str], timeout_s: float = 600.0) -> None:
        if not prefills or not decodes:
            raise ValueError("Proxy needs at least one --prefill and one --decode URL")
        self._prefills = itertools.cycle([u.rstrip("/") for u in prefills])
        self._decodes = itertools.cycle([u.rstrip("/") for u in decodes])
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        path = request.path
        prefill = next(self._prefills)
        async with self._session.post(prefill + path, json=prefill_body(body), headers=headers) as resp:
            answer = await resp.read()
            if resp.status != 200:
                return web.Response(body=answer, status=resp.status, content_type=resp.content_type)
        params = json.loads(answer).get("kv_transfer_params")
        if not params:
            return web.json_response(
                {"error": f"prefill {prefill} answered without kv_transfer_params: is it started with "
                          "--kv-transfer-config naming PdgrpcConnector?"}, status=502)
        decode_body = dict(body, kv_transfer_params=params)
        decode = next(self._decodes)
        async with self._session.post(decode + path, json=decode_body, headers=headers) as resp:
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def build_app(proxy: Proxy) -> web.Application:
    app = web.Application()
    for route in ROUTES:
        app.router.add_post(route, proxy.handle)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.integrations.vllm.proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", action="append", required=True, help="base URL of a prefill vLLM (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="base URL of a decode vLLM (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=8000, help="port to serve on")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take, both legs together")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(build_app(Proxy(ns.prefill, ns.decode, ns.timeout)), host=ns.host, port=ns.port,
                print=lambda *_: print(f"pdgrpc vLLM proxy on http://{ns.host}:{ns.port}", flush=True))


if __name__ == "__main__":
    main()
