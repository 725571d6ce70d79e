"""Service discovery on etcd: instances register under leases, routers watch a prefix.

- :mod:`pdgrpc.discovery.record` -- the key layout, the JSON record, and the router's
  :class:`MembershipView` (pure).
- :mod:`pdgrpc.discovery.etcd` -- :class:`Registration` (lease, keep-alive, revoke) and
  :class:`Watcher` (list + watch, reconnecting).
- :mod:`pdgrpc.discovery.etcd_client` -- a minimal etcd v3 client on grpc.aio, plain or TLS.
- :mod:`pdgrpc.discovery.cli` -- the flags the servers share.
- :mod:`pdgrpc.discovery.server` -- a real single-member etcd process (tests, launcher, bench).

The per-request room -> dp rank table is *not* here: it stays in the prefill's bootstrap
(hundreds of thousands of writes a second; etcd is built for a few thousand).
"""
