"""The ``smg`` role of a topology: SGLang's model gateway in front of the cluster.

A ``role = "smg"`` process lists its prefill and decode processes, like a router::

    [[process]]
    name = "smg"
    role = "smg"
    prefill = ["prefill"]
    decode = ["decode"]
    args = { policy = "round_robin" }   # more `smg launch` flags (optional)

The launcher starts ``smg launch --pd-disaggregation --prefill grpc://HOST:PORT
BOOTSTRAP_PORT --decode grpc://HOST:PORT ...`` (the ``smg`` console script of the
``pdgrpc[gateway]`` extra, from the launching interpreter's environment), with every
listener on 127.0.0.1 (smg binds 0.0.0.0 for HTTP and metrics unless told otherwise), a
1 s worker health interval and a 2 s shutdown grace period (smg's default is 180 s).
``BOOTSTRAP_PORT`` is the port of the prefill's BootstrapService: its own port when
bootstrap is embedded, else its bootstrap process's (on the same host). smg passes it to
both legs of every request, and the decode finds the prefill's bootstrap there.

In a secured cluster (``--tls``/``--auth-token``) smg, which presents no credential to
gRPC workers, calls each worker's loopback gateway listener instead of its port
(``--gateway-listen``: plaintext, every caller the ``gateway`` role alone), and takes
``--api-key`` (``LOG_DIR/security/smg-api-key``, read in smg's process by
:mod:`pdgrpc.cluster.smg_launch`) from its own HTTP clients.

The launcher starts smg only once its workers answer their health checks: smg's first
check of a worker that is not up fails, and smg then waits out its retry delay. The
process is ready when ``GET /readiness`` answers 200 (every worker healthy); its
OpenAI-compatible base URL is ``http://HOST:PORT/v1``.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Callable

from pdgrpc.cluster.topology import ProcessSpec, flags

__all__ = ["SMG_DEFAULTS", "readiness", "smg_argv", "smg_executable"]

# Flags the launcher sets unless the topology's args set them.
SMG_DEFAULTS: dict[str, str | int] = {"health-check-interval-secs": 1, "shutdown-grace-period-secs": 2, "log-level": "warn"}


def smg_executable(python: str = sys.executable) -> str:
    """The ``smg`` script installed beside ``python`` (else on PATH); an error naming the extra."""
    beside = Path(python).parent / "smg"
    if beside.exists():
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise FileNotFoundError("the smg gateway is not installed: pip install 'pdgrpc[gateway]'")
    return found


def smg_argv(
    spec: ProcessSpec, host: str, port: int, metrics_port: int, address: Callable[[str], str],
    bootstrap_address: Callable[[str], str], python: str = sys.executable, api_key_file: Path | None = None,
) -> list[str]:
    """``smg launch`` argv for ``spec``: its prefills (with their bootstrap ports) and decodes
    at ``address(name)``; ``api_key_file``: the key its HTTP clients must present (``--api-key``,
    handed over in-process by :mod:`pdgrpc.cluster.smg_launch`, so it is on no command line)."""
    smg = smg_executable(python)
    start = [smg] if api_key_file is None else [python, "-m", "pdgrpc.cluster.smg_launch", str(api_key_file)]
    out = [*start, "launch", "--pd-disaggregation", "--host", host, "--port", str(port),
           "--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    for name in spec.prefill:
        out += ["--prefill", f"grpc://{address(name)}", bootstrap_address(name).rpartition(":")[2]]
    for name in spec.decode:
        out += ["--decode", f"grpc://{address(name)}"]
    out += flags({k: v for k, v in SMG_DEFAULTS.items() if k not in spec.args})
    return out + flags(spec.args)


async def readiness(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether smg at ``host:port`` answers ``GET /readiness`` with 200."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(f"GET /readiness HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout)
        return status.split(b" ")[1:2] == [b"200"]
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        writer.close()
