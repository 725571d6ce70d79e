"""``python -m pdgrpc.decode.follower``: TP rank r >= 1 of a decode instance, started by
rank 0 (:mod:`pdgrpc.decode.follower_server`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def cli(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.decode.follower_server", argv)


if __name__ == "__main__":
    sys.exit(cli())
