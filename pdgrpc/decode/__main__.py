"""``python -m pdgrpc.decode``: run a decode server until SIGTERM/SIGINT (:mod:`pdgrpc.decode.server`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def cli(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.decode.server", argv)


if __name__ == "__main__":
    sys.exit(cli())
