"""Server utilities shared by ``pdgrpc.prefill``, ``pdgrpc.decode`` and ``pdgrpc.router``.

* :mod:`pdgrpc.serving.launch` -- :func:`~pdgrpc.serving.launch.launch`, how every server
  process starts: the environment, then the role, its flags, security, logging, tracing.
* :mod:`pdgrpc.serving.flags` -- the command-line flags every server has in common
  (engine shape, transport, logging) and their mapping to config objects. Prefill and
  decode must build *identical* engines (same compatibility hash), so both take their
  engine from :func:`engine_config_from_args`.
* :mod:`pdgrpc.serving.logs` -- logging set-up and the one-line-per-request-event helper.
* :mod:`pdgrpc.serving.convert` -- a request's room and
  :class:`pdgrpc.v1.common_pb2.SamplingParams` read from the wire, checked once.
* :mod:`pdgrpc.serving.metadata` -- the metadata row layout both servers build
  (:func:`metadata_layout`), the row carrying prefill's first token, and the
  compatibility hash as wire bytes (:func:`compat_hash_bytes`).

The package itself imports nothing: the router uses :mod:`pdgrpc.serving.logs` and must
not load torch through :mod:`pdgrpc.serving.flags`.
"""
