"""``python -m pdgrpc.bootstrap``: run the bootstrap service until SIGTERM/SIGINT (:mod:`pdgrpc.bootstrap.server`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def main(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.bootstrap.server", argv)


if __name__ == "__main__":
    sys.exit(main())
