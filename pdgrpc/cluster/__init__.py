"""Local clusters from topology files (``servers/*.toml``).

* :mod:`pdgrpc.cluster.topology` -- the topology file format and its validation.
* :mod:`pdgrpc.cluster.launcher` -- :class:`Cluster`: start every process on 127.0.0.1
  with free ports, wait until all are healthy, watch them, stop them cleanly; read each
  server's ``GetStats``; :mod:`pdgrpc.cluster.ports` picks its ports and
  :mod:`pdgrpc.cluster.errors` holds what it raises.
* ``python -m pdgrpc.cluster servers/1p1d.toml [--transport tcp]`` -- the same from a shell.
* ``python -m pdgrpc.cluster.demo`` -- the demo: a handful of prompts through ``1p1d``.
"""

from pdgrpc.cluster.launcher import ChildDied, Cluster, ClusterError
from pdgrpc.cluster.topology import ProcessSpec, Topology, load_topology

__all__ = ["ChildDied", "Cluster", "ClusterError", "ProcessSpec", "Topology", "load_topology"]
