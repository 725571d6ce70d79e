"""vLLM servers and the front door as processes, for the tests and ``python -m pdgrpc.bench
vllm``: SmolLM2-135M-Instruct as an fp32 Hugging Face checkpoint (:func:`hf_checkpoint`),
a vLLM OpenAI server with one compute thread bound to a core (:func:`vllm_server`) and
the proxy (:func:`proxy_server`). Run from a venv with vLLM (``make vllm-venv``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

__all__ = ["KV_CONFIG", "Server", "free_port", "get_text", "hf_checkpoint", "post", "proxy_server", "servers", "vllm_server"]

KV_CONFIG = {"kv_connector": "PdgrpcConnector", "kv_connector_module_path": "pdgrpc.integrations.vllm", "kv_role": "kv_both"}
ROOT = Path(__file__).resolve().parents[3]  # the checkout: servers import this pdgrpc


def hf_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint vLLM loads: the suite's GGUF,
    dequantized to fp32 with transformers once and kept beside it
    (``PDGRPC_VLLM_MODEL`` names another)."""
    if os.environ.get("PDGRPC_VLLM_MODEL"):
        return Path(os.environ["PDGRPC_VLLM_MODEL"])
    from pdgrpc.cluster.models import model_cache, smollm2

    out = model_cache() / "smollm2-hf"
    if (out / "config.json").is_file():
        return out
    gguf = smollm2()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    part = out.with_name(out.name + ".part")
    part.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    weights = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(part / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # dequantized: a plain fp32 checkpoint
    config["dtype"] = "float32"
    (part / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.save_pretrained(part)
    tok.save_pretrained(part)
    part.rename(out)
    return out


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


class Server:
    """One process (a vLLM server or the proxy), in its own process group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)

    def wait_ready(self, path: str, timeout: float) -> None:
        """Until the server answers ``path`` over HTTP (any status: it is listening)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}; log {self.log}:\n"
                                     + self.log.read_text(errors="replace")[-3000:])
            try:
                get_text(self.url + path, timeout=2.0)
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"{self.name} not ready after {timeout:.0f} s; log {self.log}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait(10)
        self._out.close()


def vllm_server(name: str, port: int, core: int, model: Path, log_dir: Path, *, connector: bool = True,
                extra: dict[str, Any] | None = None, kv_config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                args: tuple[str, ...] = (), confine: bool = False) -> Server:
    """A vLLM OpenAI server with one compute thread bound to ``core``, no compilation
    (-O0: starts in seconds), with ``PdgrpcConnector`` unless ``connector`` is False
    (``kv_config``: another connector's ``--kv-transfer-config``); ``env`` adds variables,
    ``args`` command-line flags. ``confine``: every process of the server (its API server
    and engine core too) runs on ``core``, not only the compute thread."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
                    OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           "smollm2", "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port), "-O0", *args]
    if connector:
        kv = dict(kv_config or KV_CONFIG, kv_load_failure_policy="fail", kv_connector_extra_config=extra or {})
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    if confine:
        cmd = ["taskset", "-c", str(core), *cmd]
    return Server(name, cmd, full_env, port, log_dir / f"{name}.log")


def proxy_server(port: int, prefill: Server, decode: Server, log_dir: Path, *, args: tuple[str, ...] = (),
                 name: str = "proxy") -> Server:
    """The front door of ``prefill`` and ``decode``; ``args`` adds its flags."""
    cmd = [sys.executable, "-m", "pdgrpc.integrations.vllm.proxy", "--prefill", prefill.url, "--decode", decode.url,
           "--port", str(port), *args]
    return Server(name, cmd, dict(os.environ, PYTHONPATH=str(ROOT)), port, log_dir / f"{name}.log")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def servers(*procs: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()
