"""``python -m pdgrpc.cluster.smg_launch KEY_FILE launch ...``: ``smg launch ... --api-key KEY``
with the key read from ``KEY_FILE``, smg running in this process.

smg takes its HTTP api key only as a flag, and a process's flags are in
``/proc/PID/cmdline`` for every local user to read; here only the file's path is, and the
key (from a file only its owner may read) reaches smg's own argument parser in memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.security import read_secret

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m pdgrpc.cluster.smg_launch KEY_FILE launch [smg launch flags]", file=sys.stderr)
        return 2
    try:
        key = read_secret(Path(argv[0]), "smg's api key file").decode("utf-8", "replace").strip()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not key:
        print(f"error: smg's api key file {argv[0]!r} is empty", file=sys.stderr)
        return 2
    try:
        from smg.cli import main as smg_main
    except ImportError:
        print("error: the smg gateway is not installed: pip install 'pdgrpc[gateway]'", file=sys.stderr)
        return 2
    # One "--api-key=KEY" token: a key that begins with "-" is still the flag's value.
    smg_main([*argv[1:], f"--api-key={key}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
