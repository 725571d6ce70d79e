"""Two real vLLM CPU servers with ``PdgrpcConnector`` and the front door
(``pdgrpc.integrations.vllm.proxy``): greedy output equals vLLM colocated (the decode
server answering the same request without ``kv_transfer_params`` computes it itself),
and a prefill killed while the decode waits for its KV gives the decode its blocks back
within 2 s, after which the next request succeeds."""

from __future__ import annotations

import re
import signal
import time

import pytest

from pdgrpc.integrations.vllm.launch import free_port, get_text, hf_checkpoint, post, proxy_server, servers, vllm_server
from tests.integrations.vllm_support import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

STARTUP_S = 900.0  # three vLLM servers start at once on a shared 2-core host

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint. " * 12,  # several blocks
    "List the planets of the solar system in order from the sun, with one fact about each: " * 20,
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = hf_checkpoint()
    logs = tmp_path_factory.mktemp("vllm-logs")
    prefill = vllm_server("prefill", free_port(), 0, model, logs)
    # A handshake to a frozen prefill waits (the kill test ends it by killing the prefill).
    decode = vllm_server("decode", free_port(), 1, model, logs, extra={"handshake_timeout_s": 120.0})
    doomed = vllm_server("doomed-prefill", free_port(), 0, model, logs)
    proxy = proxy_server(free_port(), prefill, decode, logs)
    with servers(proxy, doomed, prefill, decode):
        for s in (prefill, decode, doomed):
            s.wait_ready("/v1/models", STARTUP_S)
        _wait_port(proxy)
        yield {"prefill": prefill, "decode": decode, "doomed": doomed, "proxy": proxy}


def _wait_port(server, timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", server.port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"proxy not listening; log {server.log}")


def _complete(url: str, prompt: str, **extra) -> dict:
    status, body = post(url + "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 24,
                                                  "temperature": 0.0, "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]


def _stream(url: str, prompt: str, **extra) -> tuple[list[int], str, set[str]]:
    """A streamed completion: its token ids, its text and the ids of its events."""
    import json
    import urllib.request

    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0.0, "return_token_ids": True,
            "stream": True, **extra}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    tokens, text, ids = [], "", set()
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                event = json.loads(line[5:])
                assert "error" not in event, event
                ids.add(event["id"])
                tokens += event["choices"][0].get("token_ids") or []
                text += event["choices"][0]["text"]
    return tokens, text, ids


def _assert_equal_to_colocated(colocated_url: str, proxy_url: str) -> None:
    for prompt in PROMPTS:
        colocated = _complete(colocated_url, prompt)
        disagg = _complete(proxy_url, prompt)
        assert disagg["token_ids"] == colocated["token_ids"] and disagg["text"] == colocated["text"], prompt[:40]
    tokens, text, ids = _stream(proxy_url, PROMPTS[1])
    colocated = _complete(colocated_url, PROMPTS[1])
    assert (tokens, text) == (colocated["token_ids"], colocated["text"]) and len(ids) == 1, "streamed"
    # a request that cannot take the prefill's token (a stop string) goes the usual way
    stop = {"stop": ["\n\n"]}
    assert _complete(proxy_url, PROMPTS[2], **stop)["token_ids"] == _complete(colocated_url, PROMPTS[2], **stop)["token_ids"]


def test_greedy_output_over_the_connector_equals_vllm_colocated(cluster):
    _assert_equal_to_colocated(cluster["decode"].url, cluster["proxy"].url)


def _have_ucx() -> bool:
    import importlib.util

    return importlib.util.find_spec("libucx") is not None


@pytest.mark.skipif(not _have_ucx(), reason="the rdma transport needs the UCX libraries (libucx-cu12) in this venv")
def test_greedy_output_over_rdma_equals_vllm_colocated(tmp_path):
    model = hf_checkpoint()
    rdma = {"transport": "rdma"}
    prefill = vllm_server("rdma-prefill", free_port(), 0, model, tmp_path, extra=rdma)
    decode = vllm_server("rdma-decode", free_port(), 1, model, tmp_path, extra=rdma)
    proxy = proxy_server(free_port(), prefill, decode, tmp_path)
    with servers(proxy, prefill, decode):
        for s in (prefill, decode):
            s.wait_ready("/v1/models", STARTUP_S)
        _wait_port(proxy)
        _assert_equal_to_colocated(decode.url, proxy.url)
        assert "on rdma" in decode.log.read_text(errors="replace"), "the decode's connector is not on rdma"


def _gone(server) -> float:
    """When every process of ``server``'s group has ended (its sockets closed)."""
    import os

    server.proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(server.proc.pid, 0)
        except ProcessLookupError:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"{server.name} still has processes 30 s after SIGKILL")


def _kv_usage(server) -> float:
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", get_text(server.url + "/metrics"), re.M)
    assert m, "vllm:kv_cache_usage_perc missing from the decode's metrics"
    return float(m.group(1))


def test_a_prefill_killed_mid_transfer_gives_the_decode_its_blocks_back_within_two_seconds(cluster):
    import threading

    decode, doomed = cluster["decode"], cluster["doomed"]
    prompt = PROMPTS[2]

    def prefill() -> dict:
        status, first = post(doomed.url + "/v1/completions", {
            "model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200 and first["kv_transfer_params"], first
        return first["kv_transfer_params"]

    # One whole transfer from this prefill first: the decode's connection to it is up.
    status, body = post(decode.url + "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 2,
                                                         "temperature": 0.0, "kv_transfer_params": prefill()})
    assert status == 200, body
    params = prefill()
    doomed.kill(signal.SIGSTOP)  # frozen: the decode's handshake goes out and waits, its blocks granted
    answer: dict = {}

    def ask() -> None:
        answer["status"], answer["body"] = post(decode.url + "/v1/completions", {
            "model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "kv_transfer_params": params})
        answer["at"] = time.monotonic()

    t = threading.Thread(target=ask)
    t.start()
    t.join(5.0)
    assert not answer, f"the decode answered before its KV came: {answer}"
    doomed.kill(signal.SIGKILL)
    killed = _gone(doomed)  # a 1.5 GB process takes a while to die on a loaded host: time from its end
    t.join(30)
    assert answer, "the decode request never ended"
    assert answer["status"] != 200, "a request whose KV never came must not succeed (kv_load_failure_policy=fail)"
    assert answer["at"] - killed < 2.0, f"the failed load took {answer['at'] - killed:.2f} s to end"
    while _kv_usage(decode) > 0.0 and time.monotonic() < killed + 2.0:
        time.sleep(0.05)
    assert _kv_usage(decode) == 0.0, "the decode's blocks are not back 2 s after the prefill died"
    # and the next request succeeds, through the front door and its live prefill
    assert _complete(cluster["proxy"].url, PROMPTS[0])["text"]
