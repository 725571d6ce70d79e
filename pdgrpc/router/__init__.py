"""The router: pdgrpc's front door for clients (``pdgrpc.v1.GenerateService``).

* :mod:`pdgrpc.router.service` -- :class:`GenerateServicer`: draws the bootstrap room,
  sends Prefill and Decode at once, streams the decode's tokens back as text deltas,
  propagates failures both ways, cancels both sides when the client goes away.
* ``python -m pdgrpc.router --help`` -- the router as a process.
"""

from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig, draw_room, parse_prefill

__all__ = ["GenerateServicer", "PrefillBackend", "RouterConfig", "draw_room", "parse_prefill"]
