"""The decode server: ``python -m pdgrpc.decode``.

* :mod:`pdgrpc.decode.scheduler` -- the asyncio driver over the pure decode machines
  (:class:`~pdgrpc.state.DecodeQueues`): dp-rank resolution, prealloc, handshake,
  transfer poll, commit/abort; :mod:`pdgrpc.decode.generation` -- its running half
  (decode steps with ``engine.decode_step``, how a request finishes or fails);
  :mod:`pdgrpc.decode.prefill_calls` -- its calls to the prefill side (dp-rank queries,
  failure watches, handshake, AbortRoom).
* :mod:`pdgrpc.decode.rank` -- what every TP rank does for the transfers (its rows,
  queues, grants, local poll and release), shared by rank 0 and the followers.
* :mod:`pdgrpc.decode.handshake` -- the client of the prefill workers' HandshakeService
  (handshake with retries against refreshed endpoints, AbortRoom).
* :mod:`pdgrpc.decode.prefills` -- cached parallel info and workers of the prefill
  instances, invalidated when a prefill restarts.
* :mod:`pdgrpc.decode.job` -- per-request bookkeeping, what the Decode stream gets, and
  the status an abort ends a request with.
* :mod:`pdgrpc.decode.service` -- ``DecodeService`` (Decode stream, GetStats) over grpc.aio.
* :mod:`pdgrpc.decode.cli` -- the flags (shared by every TP rank); :mod:`pdgrpc.decode.server`
  -- the role: the flags' checks and the start order, torch-free; :mod:`pdgrpc.decode.leader_server`
  -- the server as a process (rank 0); :mod:`pdgrpc.decode.followers` -- starting the other TP
  ranks; :mod:`pdgrpc.decode.tp` and :mod:`pdgrpc.decode.follower_server` -- tensor
  parallelism (rank 0 drives, the other ranks replay).

The package itself imports nothing: ``python -m pdgrpc.decode`` loads it before
:func:`~pdgrpc.serving.launch.launch` has set the environment gRPC reads on import.
"""
