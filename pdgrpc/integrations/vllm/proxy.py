"""The front door of a vLLM prefill-decode pair over ``PdgrpcConnector``.

``python -m pdgrpc.integrations.vllm.proxy --prefill URL --decode URL --port N`` serves
vLLM's OpenAI routes ``/v1/completions`` and ``/v1/chat/completions``. Each request goes
to a prefill server first, as a one-token request whose ``kv_transfer_params`` ask it to
keep the KV (``do_remote_decode``); the prefill's answer carries the params the decode
needs (room, secret, handshake address, blocks), and the request then goes to a decode
server with them, whose answer (streamed or not) is the client's.

A ``/v1/completions`` request whose answer cannot change by it takes its first token
from the prefill (:mod:`pdgrpc.integrations.vllm.first_token`): a streamed answer
starts with it at once, and the decode continues after it. Any other request goes to
the decode unchanged, which recomputes the prompt's last position on top of the
transferred KV. Either way the output is what a colocated vLLM generates.

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

from pdgrpc.integrations.vllm import first_token
from pdgrpc.integrations.vllm.params import PREFILL_REQUEST

__all__ = ["Proxy", "build_app", "main", "prefill_body"]

log = logging.getLogger("pdgrpc.integrations.vllm.proxy")

COMPLETIONS = "/v1/completions"
ROUTES = (COMPLETIONS, "/v1/chat/completions")


def prefill_body(body: dict[str, Any], path: str = COMPLETIONS) -> dict[str, Any]:
    """The request the prefill gets: one token, not streamed, KV kept for a decode
    (and, for a completion, the token ids the decode may continue from)."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_REQUEST)
    if path == COMPLETIONS:
        out["return_token_ids"] = True
    return out


def _sse(event: Any) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class Proxy:
    def __init__(self, prefills: Sequence[str], decodes: Sequence[str], timeout_s: float = 600.0,
                 first_token: bool = True) -> None:
        if not prefills or not decodes:
            raise ValueError("Proxy needs at least one --prefill and one --decode URL")
        self._prefills = itertools.cycle([u.rstrip("/") for u in prefills])
        self._decodes = itertools.cycle([u.rstrip("/") for u in decodes])
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._first_token = first_token

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
        async with self._session.post(prefill + path, json=prefill_body(body, path), headers=headers) as resp:
            answer = await resp.read()
            if resp.status != 200:
                return web.Response(body=answer, status=resp.status, content_type=resp.content_type)
        first = json.loads(answer)
        params = first.get("kv_transfer_params")
        if not params:
            return web.json_response(
                {"error": f"prefill {prefill} answered without kv_transfer_params: is it started with "
                          "--kv-transfer-config naming PdgrpcConnector?"}, status=502)
        rest = first_token.continuation(body, first) if self._first_token and path == COMPLETIONS else None
        decode = next(self._decodes)
        if rest is not None:
            rest["kv_transfer_params"] = params
            return await self._continue(request, decode + path, rest, first, body, headers)
        decode_body = dict(body, kv_transfer_params=params)
        async with self._session.post(decode + path, json=decode_body, headers=headers) as resp:
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _continue(self, request: web.Request, url: str, rest: dict[str, Any], first: dict[str, Any],
                        body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
        """The answer as the prefill's token, then the decode's continuation after it."""
        assert self._session is not None
        want_ids = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            async with self._session.post(url, json=rest, headers=headers) as resp:
                answer = await resp.read()
                if resp.status != 200:
                    return web.Response(body=answer, status=resp.status, content_type=resp.content_type)
            return web.json_response(first_token.merge_answer(json.loads(answer), first, want_ids))
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_sse(first_token.first_event(first, want_ids)))
        async with self._session.post(url, json=rest, headers=headers) as resp:
            if resp.status != 200:  # the client has its first token: the failure is an error event
                detail = (await resp.read()).decode(errors="replace")
                await out.write(_sse({"error": {"message": f"decode {url}: HTTP {resp.status}: {detail[:500]}",
                                                "code": resp.status}}))
                await out.write(b"data: [DONE]\n\n")
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        await out.write(b"data: [DONE]\n\n")
                        continue
                    await out.write(_sse(first_token.rewrite_event(json.loads(data), first, want_ids)))
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
    p.add_argument("--no-first-token", action="store_true",
                   help="send every request to the decode unchanged (it recomputes the prompt's last position) "
                        "instead of answering with the prefill's token first")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(build_app(Proxy(ns.prefill, ns.decode, ns.timeout, not ns.no_first_token)), host=ns.host, port=ns.port,
                print=lambda *_: print(f"pdgrpc vLLM proxy on http://{ns.host}:{ns.port}", flush=True))


if __name__ == "__main__":
    main()
