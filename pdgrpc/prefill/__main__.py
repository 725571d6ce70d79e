"""``python -m pdgrpc.prefill``: the prefill DP controller and its workers (see ``--help``;
:mod:`pdgrpc.prefill.controller_main`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def main(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.prefill.controller_main", argv)


if __name__ == "__main__":
    sys.exit(main())
