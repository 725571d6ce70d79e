"""gRPC plumbing shared by every pdgrpc server and client.

* :mod:`pdgrpc.rpc.server` — start a ``grpc.aio`` server with ``grpc.health.v1`` and
  reflection, log where it listens, stop gracefully on SIGTERM/SIGINT; :func:`run` puts
  a main coroutine on uvloop when available.
* :mod:`pdgrpc.rpc.channels` — :class:`ChannelPool`: one channel per address, reused.
* :mod:`pdgrpc.rpc.errors` — ``grpc.RpcError`` → pdgrpc's exception tree, by status code.
* :mod:`pdgrpc.rpc.retry` — capped exponential backoff with full jitter.
* :mod:`pdgrpc.rpc.tuning` — process-wide gRPC settings for pdgrpc's entry points.
* :mod:`pdgrpc.rpc.security` — TLS, mTLS and the bearer token of every server and client
  (:class:`Security`, the ``--tls-*`` / ``--auth-token-file`` / ``--insecure`` flags);
  :mod:`pdgrpc.rpc.certs` — a throwaway CA and certificates (``--tls auto``).
* :mod:`pdgrpc.rpc.tracing` — OpenTelemetry spans for each hop of a request (``--trace``),
  under the W3C ``traceparent`` a call carries.

The package itself imports nothing, so :mod:`pdgrpc.rpc.tuning` loads before grpc does.
"""
