"""``python -m pdgrpc.bench NAME [--json PATH] [options]`` — run one benchmark."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pdgrpc.bench import BENCHMARKS
from pdgrpc.bench.plot import PlotUnavailable
from pdgrpc.bench.plot import require as require_plot
from pdgrpc.bench.report import format_table, write_json
from pdgrpc.serving.launch import prepare_environment


def main(argv: list[str] | None = None) -> int:
    # Every benchmark's clients (and the servers it starts, which inherit the setting or
    # apply it themselves) run gRPC with pdgrpc's settings, like the processes measured.
    # gRPC reads them once, when it is imported: before any benchmark module is.
    prepare_environment()
    parser = argparse.ArgumentParser(
        prog="python -m pdgrpc.bench",
        description="Run a pdgrpc benchmark; results print as a table, optionally also as JSON.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    modules = {}
    for name, modname in BENCHMARKS.items():
        mod = modules[name] = importlib.import_module(modname)
        p = sub.add_parser(name, help=mod.DESCRIPTION, description=mod.DESCRIPTION)
        p.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON to PATH")
        if hasattr(mod, "PLOT"):
            p.add_argument("--plot", type=Path, metavar="PATH.png",
                           help=f"also draw a PNG to PATH: {mod.PLOT} (needs pdgrpc[plot])")
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    mod = modules[args.benchmark]
    if getattr(args, "plot", None) is not None:
        try:  # before the run: a long benchmark must not end without its picture
            require_plot()
        except PlotUnavailable as exc:
            print(f"python -m pdgrpc.bench {args.benchmark}: {exc}", file=sys.stderr)
            return 2
    results = mod.run(args)
    print(format_table(results))
    if args.json is not None:
        write_json(args.json, args.benchmark, results)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None) is not None:
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
