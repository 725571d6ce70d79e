"""The colocated reference for a topology: the engine its prefill and decode run, in-process.

Disaggregated output must equal colocated output token for token, so tests and
``bench e2e`` build the reference from the *same* ``[engine]`` table the servers get,
through the same flag parser (:func:`pdgrpc.serving.engine_config_from_args`).
"""

from __future__ import annotations

import argparse

from pdgrpc.cluster.topology import Topology, flags
from pdgrpc.engine.reference import EngineConfig, ReferenceEngine
from pdgrpc.serving.flags import add_engine_arguments, engine_config_from_args

__all__ = ["engine_config", "reference_engine"]


def engine_config(topology: Topology, **overrides: object) -> EngineConfig:
    """The :class:`EngineConfig` of the topology's ``[engine]`` table (plus ``overrides``,
    flag names with ``-``)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    ns = parser.parse_args(flags({**topology.engine, **overrides}))
    return engine_config_from_args(ns)


def reference_engine(topology: Topology, **overrides: object) -> ReferenceEngine:
    return ReferenceEngine(engine_config(topology, **overrides))
