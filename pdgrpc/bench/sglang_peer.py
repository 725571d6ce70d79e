"""SGLang's bootstrap servers, and an aiohttp client for them, for ``bench bootstrap``.

This file runs under *another* Python: one that has ``sglang`` importable (passed as
``--peer-python PATH``), never pdgrpc's. It imports nothing from pdgrpc. Roles::

    PEER_PYTHON sglang_peer.py serve python   # CommonKVBootstrapServer (aiohttp, uvloop)
    PEER_PYTHON sglang_peer.py serve rust     # the Rust server's PD bootstrap registry
    PEER_PYTHON sglang_peer.py client         # aiohttp client, commands on stdin

A server prints ``ready PORT`` on stdout once it answers, then serves until its stdin
closes. The Python server is SGLang's own ``CommonKVBootstrapServer`` (its thread runs
an aiohttp app on the default event loop policy, set to uvloop here as in SGLang's
server processes). The Rust server is what ``SGLANG_RUST_SERVER=1`` starts in a prefill
scheduler: ``sglang.srt.rust_extensions._server.Server``, whose api listener mounts the
PD bootstrap registry (``/route``, ``/register_dp_rank``, ``/query_dp_ranks``); it is
started here with no model (``skip_tokenizer_init``) and
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``, so that ``/health`` answers without
a scheduler behind it.

The client keeps one keep-alive connection per server (aiohttp on uvloop; bodies encoded
and decoded with orjson when installed) and answers one JSON line per command line:

* ``{"op": "setup", "port": P, "known": [...], "fresh": [...], "sets32": [[...]],
  "sets1024": [[...]], "dp_size": 8}``: ``PUT /route`` (one prefill worker), then
  ``POST /register_dp_rank`` for every known room (rank = room % dp_size); the lists
  are kept for the cases below.
* ``{"op": "run", "port": P, "n": N, "warmup": W, "offset": K}``: the latency cases
  round-robin, one call of each per round (call ``i`` registers ``fresh[K + i]``);
  answers ``{"samples": {case: [seconds, ...]}}``.
* ``{"op": "cpu", "port": P, "n": N, "offset": K}``: each case ``n`` times in a row;
  after each case it prints ``{"case_done": case}`` and waits for a line (the bench
  reads the server's CPU time in between); answers the client process's CPU seconds
  per case, ``{"cpu": {case: seconds}}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

CASES = ("ping", "register 1 room", "query 1 room", "query 32 rooms", "query 1024 rooms")


def _serve_python() -> int:
    import uvloop  # type: ignore[import-not-found,unused-ignore]
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer  # type: ignore[import-not-found,unused-ignore]

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    port = _free_port()
    CommonKVBootstrapServer("127.0.0.1", port)
    return _ready_then_wait(port)


def _serve_rust() -> int:
    os.environ["SGLANG_RUST_SERVER"] = "1"
    os.environ["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"
    import sglang  # type: ignore[import-not-found,unused-ignore]
    from sglang.srt.rust_extensions import load_rust_extension  # type: ignore[import-not-found,unused-ignore]

    ext = load_rust_extension("sglang.srt.rust_extensions._server")
    port = _free_port()
    deployment: dict[str, object] = {
        "disaggregation_bootstrap_port": port, "node_rank": 0, "nnodes": 1, "dp_size": 1, "dp_rank": 0,
        "dist_init_addr": None, "base_gpu_id": 0, "page_size": 1, "dcp_size": 1, "max_running_requests": 1,
        "max_prefill_tokens": 1, "enable_dp_attention": False, "speculative_algorithm": None,
        "enable_hierarchical_cache": False, "hicache_ratio": 2.0, "hicache_size": 0,
        "hicache_write_policy": "write_through", "hicache_host_total_tokens": None, "kv_event_sources": [],
    }
    args = ext.ServerArgs(
        model_path="none", served_model_name="none", tokenizer_path="none", revision=None, load_format="auto",
        weight_version="default", hicache_storage_backend=None, hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="best_effort", hicache_write_policy="write_through", host="127.0.0.1",
        port=port, grpc_port=None, log_level="warning", log_level_http=None, chat_template=None,
        default_chat_template_kwargs="{}", tool_call_parser=None, reasoning_parser=None,
        stream_response_default_include_usage=False, tokenizer_worker_num=1, detokenizer_worker_num=1,
        skip_tokenizer_init=True, skip_server_warmup=True, health_generate_headers={}, default_priority_value=None,
        enable_request_header_overrides=False, incremental_streaming_output=False,
        disaggregation_mode=ext.DisaggregationMode.Prefill,
        model_config=ext.ModelConfig(
            context_len=4096, vocab_size=32000, is_multimodal=False, model_type=None,
            default_sampling_params=ext.DefaultSamplingParams(),
        ),
        preferred_sampling_params=None, default_max_new_tokens=None, lora_ids={}, enable_strict_thinking=False,
        limit_mm_data_per_request=[], allow_auto_truncate=False, enable_return_hidden_states=False,
        num_reserved_tokens=0, tokenizer_model_max_length=4096, version=sglang.__version__, max_total_num_tokens=1,
        deployment_info=json.dumps(deployment), launch_server_info="{}", load_snapshot_path=None,
        load_snapshot_dp_size=0, load_snapshot_dp_rank=0, accelerator="cpu", num_accelerators=0, metrics=None,
    )
    server = ext.Server(args)
    try:
        return _ready_then_wait(port)
    finally:
        server.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ready_then_wait(port: int) -> int:
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print(f"ready {port}", file=_READY, flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin (or exits)
    return 0


async def _client() -> int:
    import aiohttp  # type: ignore[import-not-found,unused-ignore]

    try:
        import orjson  # type: ignore[import-not-found,unused-ignore]

        dumps, loads = orjson.dumps, orjson.loads
    except ImportError:  # pragma: no cover - orjson is optional
        dumps, loads = (lambda o: json.dumps(o).encode()), json.loads
    headers = {"Content-Type": "application/json"}
    sessions: dict[int, aiohttp.ClientSession] = {}

    def session(port: int) -> aiohttp.ClientSession:
        if port not in sessions:
            connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=600)
            sessions[port] = aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector)
        return sessions[port]

    async def post(s: aiohttp.ClientSession, path: str, body: object) -> object:
        async with s.post(path, data=dumps(body), headers=headers) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"POST {path}: HTTP {r.status}: {data[:200]!r}")
            return loads(data) if path == "/query_dp_ranks" else data

    async def get(s: aiohttp.ClientSession, path: str) -> bytes:
        async with s.get(path) as r:
            data: bytes = await r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {r.status}: {data[:200]!r}")
            return data

    state: dict[int, dict] = {}

    def cases(cmd: dict) -> dict:  # case -> call(i)
        s = session(cmd["port"])
        st = state[cmd["port"]]
        fresh, known, sets32, sets1024 = st["fresh"], st["known"], st["sets32"], st["sets1024"]
        k = cmd.get("offset", 0)

        async def query(rooms: list[int]) -> None:
            got = await post(s, "/query_dp_ranks", {"bootstrap_rooms": rooms})
            assert isinstance(got, dict) and len(got) == len(rooms), (len(got), len(rooms))  # type: ignore[arg-type]

        return {
            "ping": lambda i: get(s, "/health"),
            "register 1 room": lambda i: post(s, "/register_dp_rank", {"bootstrap_room": fresh[(k + i) % len(fresh)], "dp_rank": 1}),
            "query 1 room": lambda i: query([known[i % len(known)]]),
            "query 32 rooms": lambda i: query(sets32[i % len(sets32)]),
            "query 1024 rooms": lambda i: query(sets1024[i % len(sets1024)]),
        }

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "setup":
            s = session(cmd["port"])
            worker = {
                "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
                "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
                "rank_ip": "127.0.0.1", "rank_port": 9, "page_size": 1, "kv_cache_dtype": "bfloat16",
                "load_balance_method": "round_robin",
            }
            async with s.put("/route", data=dumps(worker), headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"PUT /route: HTTP {r.status}: {(await r.read())[:200]!r}")
            state[cmd["port"]] = cmd
            dp = cmd["dp_size"]
            for room in cmd["known"]:
                await post(s, "/register_dp_rank", {"bootstrap_room": room, "dp_rank": room % dp})
            reply: dict = {"ok": True}
        elif op == "run":
            calls = cases(cmd)
            for i in range(cmd["warmup"]):
                for call in calls.values():
                    await call(i)
            out: dict[str, list[float]] = {name: [] for name in calls}
            clock = time.perf_counter
            for i in range(cmd["warmup"], cmd["warmup"] + cmd["n"]):
                for name, call in calls.items():
                    t0 = clock()
                    await call(i)
                    out[name].append(clock() - t0)
            reply = {"samples": out}
        elif op == "cpu":
            calls = cases(cmd)
            cpu = {}
            for name, call in calls.items():
                c0 = time.process_time()
                for i in range(cmd["n"]):
                    await call(i)
                cpu[name] = time.process_time() - c0
                print(json.dumps({"case_done": name}), flush=True)
                sys.stdin.readline()  # the bench reads the server's CPU between cases
            reply = {"cpu": cpu}
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), flush=True)
    for s in sessions.values():
        await s.close()
    return 0


_READY = sys.stdout


def main(argv: list[str]) -> int:
    global _READY
    if argv[:1] == ["serve"]:
        # Only "ready PORT" goes to stdout: the servers' own output (the Rust server logs
        # to fd 1) goes to stderr, which the bench never needs to drain.
        _READY = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    if argv[:2] == ["serve", "python"]:
        return _serve_python()
    if argv[:2] == ["serve", "rust"]:
        return _serve_rust()
    if argv[:1] == ["client"]:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        return uvloop.run(_client())  # type: ignore[no-any-return]
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
