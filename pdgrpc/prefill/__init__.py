"""The prefill server (``python -m pdgrpc.prefill``).

* :mod:`~pdgrpc.prefill.controller` -- the DP controller: PrefillService front door,
  worker processes; :mod:`~pdgrpc.prefill.controller_main` its process (servers,
  embedded BootstrapService, ready line, signals).
* :mod:`~pdgrpc.prefill.dispatch` / :mod:`~pdgrpc.prefill.registrar` -- dp rank choice
  and batched room -> rank registration.
* :mod:`~pdgrpc.prefill.worker` -- one worker: validation, pages, its rooms, with its
  settings in :mod:`~pdgrpc.prefill.worker_config`;
  :mod:`~pdgrpc.prefill.room` a room's driver, which carries out what the pure
  :class:`~pdgrpc.state.prefill_sender.PrefillSender` decides;
  :mod:`~pdgrpc.prefill.handshake` the handshake check; :mod:`~pdgrpc.prefill.services`
  the gRPC servicers; :mod:`~pdgrpc.prefill.worker_server` the worker process.
* :mod:`~pdgrpc.prefill.link` -- how the controller sends Prefill calls to its workers
  (framed protobuf over a socketpair; process-private, not gRPC).
* :mod:`~pdgrpc.prefill.compute` -- where a worker runs its forward pass, one interface
  and one module per mode: :mod:`~pdgrpc.prefill.compute_thread` (a thread),
  :mod:`~pdgrpc.prefill.compute_process` (a child process over the KV pool in shared
  memory, ``--compute-in process``, so the worker's loop never stops the compute for the
  interpreter), :mod:`~pdgrpc.prefill.compute_tp` (a TP group in lock step).
* :mod:`~pdgrpc.prefill.mailbox` -- handshakes that arrive before their Prefill RPC.
"""
