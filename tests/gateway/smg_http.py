"""A small blocking HTTP client for smg's OpenAI API (the tests run it in threads)."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


def _conn(base_url: str, timeout: float) -> http.client.HTTPConnection:
    u = urlsplit(base_url)
    assert u.hostname is not None and u.port is not None
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def post(base_url: str, path: str, body: dict[str, Any], timeout: float = 60.0, api_key: str | None = None) -> tuple[int, Any]:
    """POST JSON to ``base_url`` + ``path`` (base without ``/v1``); ``(status, parsed body)``.
    ``api_key``: sent as ``Authorization: Bearer`` (smg's ``--api-key``)."""
    conn = _conn(base_url, timeout)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode(errors="replace")
    finally:
        conn.close()


def get(base_url: str, path: str, timeout: float = 10.0) -> tuple[int, Any]:
    conn = _conn(base_url, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def stream(base_url: str, path: str, body: dict[str, Any], timeout: float = 60.0, stop_after: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """POST a streaming request and read its server-sent events; ``stop_after`` events
    with content: close the connection there (a client that goes away mid-stream)."""
    conn = _conn(base_url, timeout)
    events: list[dict[str, Any]] = []
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, [{"error": resp.read().decode(errors="replace")}]
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            events.append(json.loads(payload))
            if stop_after is not None and sum(1 for e in events if _content(e)) >= stop_after:
                break
        return resp.status, events
    finally:
        conn.close()


def _content(event: dict[str, Any]) -> str:
    choice = (event.get("choices") or [{}])[0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def streamed_text(events: list[dict[str, Any]]) -> str:
    return "".join(_content(e) for e in events)


def finish_reason(events: list[dict[str, Any]]) -> str | None:
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return reasons[-1] if reasons else None
