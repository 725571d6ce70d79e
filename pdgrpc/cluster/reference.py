"""The colocated reference for a topology: the engine its prefill and decode run, in-process.

Disaggregated output must equal colocated output token for token, so tests and
``bench e2e`` build the reference from the *same* ``[engine]`` table the servers get,
through the same flag parser and :func:`pdgrpc.serving.engines.build_engine` (the
reference engine, or the checkpoint of ``model = "PATH"``).
"""

from __future__ import annotations

import argparse

from pdgrpc.cluster.topology import Topology, flags
from pdgrpc.engine.base import Engine
from pdgrpc.serving.engines import build_engine
from pdgrpc.serving.flags import add_engine_arguments

__all__ = ["engine_args", "reference_engine"]


def engine_args(topology: Topology, **overrides: object) -> argparse.Namespace:
    """The engine flags of the topology's ``[engine]`` table (plus ``overrides``, flag
    names with ``-``), parsed."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    return parser.parse_args(flags({**topology.engine, **overrides}))


def reference_engine(topology: Topology, **overrides: object) -> Engine:
    return build_engine(engine_args(topology, **overrides))
