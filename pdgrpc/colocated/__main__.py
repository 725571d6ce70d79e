"""``python -m pdgrpc.colocated``: GenerateService on one colocated engine (:mod:`pdgrpc.colocated.server`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def main(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.colocated.server", argv)


if __name__ == "__main__":
    sys.exit(main())
