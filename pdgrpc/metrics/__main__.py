"""``python -m pdgrpc.metrics``: print the metric table (Markdown) for docs/metrics.md."""

from __future__ import annotations

import sys

from pdgrpc.metrics.catalog import markdown_table


def main() -> int:
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
