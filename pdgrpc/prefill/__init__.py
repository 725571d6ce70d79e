"""The prefill server (``python -m pdgrpc.prefill``).

* :mod:`~pdgrpc.prefill.controller` -- the DP controller process: PrefillService front
  door, embedded BootstrapService, worker processes.
* :mod:`~pdgrpc.prefill.dispatch` / :mod:`~pdgrpc.prefill.registrar` -- dp rank choice
  and batched room -> rank registration.
* :mod:`~pdgrpc.prefill.worker` -- one worker's request driver over the pure
  :class:`~pdgrpc.state.prefill_sender.PrefillSender`; :mod:`~pdgrpc.prefill.services`
  its gRPC servicers; :mod:`~pdgrpc.prefill.worker_main` the worker process.
* :mod:`~pdgrpc.prefill.link` -- how the controller sends Prefill calls to its workers
  (framed protobuf over a socketpair; process-private, not gRPC).
* :mod:`~pdgrpc.prefill.compute_process` -- where a TP-1 worker runs its forward pass:
  a child process over the KV pool in shared memory (``--compute-in process``), so the
  worker's loop never stops the compute for the interpreter.
* :mod:`~pdgrpc.prefill.mailbox` -- handshakes that arrive before their Prefill RPC.
"""
