"""The router: pdgrpc's front door for clients (``pdgrpc.v1.GenerateService``).

* :mod:`pdgrpc.router.service` -- :class:`GenerateServicer`: draws the bootstrap room,
  sends Prefill and Decode at once, streams the decode's tokens back as text deltas,
  propagates failures both ways, cancels both sides when the client goes away.
* :mod:`pdgrpc.router.policy` -- which prefill and decode a request goes to (``--policy``).
* :mod:`pdgrpc.router.kv_events` -- the prefills' KV events, followed into the prefix index
  that ``cache_aware`` reads.
* :mod:`pdgrpc.router.server` -- the router as a process (``python -m pdgrpc.router --help``).

The package itself imports nothing: ``python -m pdgrpc.router`` loads it before
:func:`~pdgrpc.serving.launch.launch` has set the environment gRPC reads on import.
"""
