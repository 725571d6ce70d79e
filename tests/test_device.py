"""--device: the start-up check, the chunk-ready signal, and engines placed by the flag."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from pdgrpc.device import READY, call_when, chunk_ready_on, poll_until, resolve_device
from pdgrpc.engine.config import EngineConfig
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import ConfigError


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where torch.cuda is unavailable, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_resolves() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_the_flag(spec: str) -> None:
    with pytest.raises(ConfigError, match=rf"--device '{spec}': torch.cuda is not available"):
        resolve_device(spec)


@pytest.mark.parametrize(("spec", "why"), [("tpu9", "--device 'tpu9'"), ("mps", "supports cpu and cuda")])
def test_unknown_devices_are_refused(spec: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        resolve_device(spec)


@pytest.mark.usefixtures("no_cuda")
def test_engine_configs_refuse_cuda_without_cuda() -> None:
    with pytest.raises(ConfigError, match="--device 'cuda'"):
        EngineConfig(device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("server", ["pdgrpc.prefill", "pdgrpc.decode"])
def test_server_exits_nonzero_naming_the_flag(server: str) -> None:
    """What a user sees: the server does not start, and the one line names --device."""
    out = subprocess.run(
        [sys.executable, "-m", server, "--device", "cuda", "--port", "0", "--transport", "tcp"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "--device 'cuda': torch.cuda is not available" in out.stderr


def test_cpu_chunk_ready_is_resolved() -> None:
    ready = chunk_ready_on(torch.device("cpu"))
    assert ready is READY and ready.done()
    asyncio.run(ready.wait())
    assert ReferenceEngine(EngineConfig(num_pages=4)).chunk_ready().done()


def test_poll_until_keeps_the_loop_serving() -> None:
    """The waiter sleeps between queries: other tasks run while a chunk is not ready."""
    answers = iter([False] * 5 + [True])
    ticks = 0

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def main() -> int:
        task = asyncio.create_task(other())
        await poll_until(lambda: next(answers))
        task.cancel()
        return ticks

    assert asyncio.run(main()) >= 5


def test_call_when_acts_once_done_with_or_without_a_running_loop() -> None:
    """A completion callback (no await) hands on its work once the device finished: from
    the loop, which keeps serving meanwhile, or in place while a transport closes."""
    calls: list[str] = []
    answers = iter([False] * 3 + [True])
    call_when(lambda: next(answers), lambda: calls.append("no loop"))

    async def on_the_loop() -> None:
        finished = False
        call_when(lambda: finished, lambda: calls.append("loop"))
        await asyncio.sleep(0.005)
        assert calls == ["no loop"]  # still copying: not yet
        finished = True
        for _ in range(200):
            if len(calls) == 2:
                break
            await asyncio.sleep(0.005)

    asyncio.run(on_the_loop())
    assert calls == ["no loop", "loop"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_engine_on_cuda_equals_cpu() -> None:
    """The fixed-point model gives the same first token and KV bytes on the GPU."""
    from pdgrpc.engine.base import PrefillRequest

    ids = tuple(range(1, 60))
    out = {}
    for dev in ("cpu", "cuda"):
        e = ReferenceEngine(EngineConfig(num_pages=16, device=dev))
        assert e.kv_buffers().k[0].device.type == dev
        pages = tuple(e.alloc_pages(e.pages_needed(len(ids))) or ())
        req = PrefillRequest(ids, pages)
        e.prefill_chunk(req, 0, 32)
        ready = e.chunk_ready()
        asyncio.run(ready.wait())
        assert ready.done()
        tok = e.prefill_chunk(req, 32, len(ids))
        out[dev] = (tok, [t.cpu() for t in e.kv_buffers().k])
    assert out["cpu"][0] == out["cuda"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["cpu"][1], out["cuda"][1]))
