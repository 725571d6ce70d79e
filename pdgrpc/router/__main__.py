"""``python -m pdgrpc.router``: serve GenerateService until SIGTERM/SIGINT (:mod:`pdgrpc.router.server`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def main(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.router.server", argv)


if __name__ == "__main__":
    sys.exit(main())
