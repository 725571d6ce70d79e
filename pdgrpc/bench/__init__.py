"""Benchmarks: ``python -m pdgrpc.bench NAME [--json PATH] ...``.

Each benchmark is a module of this package exposing::

    DESCRIPTION: str
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> list[Result]

and is listed in :data:`BENCHMARKS`. Modules are imported only when their benchmark
runs, so one benchmark's heavy dependencies never slow another's start.

Speed targets are checked here, as ratios against a baseline measured in the same run,
never as timed assertions in the test suite.
"""

BENCHMARKS: dict[str, str] = {
    "bootstrap": "pdgrpc.bench.bootstrap",
    "state": "pdgrpc.bench.state",
    "transport": "pdgrpc.bench.transport",
    "link": "pdgrpc.bench.link",
    "compute": "pdgrpc.bench.compute",
    "e2e": "pdgrpc.bench.e2e",
    "multihost": "pdgrpc.bench.multihost",
    "security": "pdgrpc.bench.security",
    "engine": "pdgrpc.bench.engine",
    "gateway": "pdgrpc.bench.gateway",
    "prefix": "pdgrpc.bench.prefix",
    "multiturn": "pdgrpc.bench.multiturn",
    "chaos": "pdgrpc.bench.chaos",
    "vllm": "pdgrpc.bench.vllm",
}

__all__ = ["BENCHMARKS"]
