"""``python -m pdgrpc.prefill.worker_main``: one prefill worker process, started by the DP
controller (:mod:`pdgrpc.prefill.worker_role`)."""

from __future__ import annotations

import sys

from pdgrpc.serving.launch import launch


def main(argv: list[str] | None = None) -> int:
    return launch("pdgrpc.prefill.worker_role", argv)


if __name__ == "__main__":
    sys.exit(main())
