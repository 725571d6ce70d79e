"""The connector's scheduler side: which requests load KV from a prefill, which keep
their blocks for a decode, and what the worker side is told each step.

vLLM calls these from its scheduler (one thread); nothing here does I/O. The vLLM types
stay in :mod:`pdgrpc.integrations.vllm.connector`, which passes plain values in.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from pdgrpc.errors import ConfigError
from pdgrpc.integrations.vllm.jobs import Jobs, LoadJob, ReleaseJob, SendJob
from pdgrpc.integrations.vllm.params import TransferParams, wants_remote_decode
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.state.room import Room

__all__ = ["SchedulerSide", "WorkerInfo"]

log = logging.getLogger("pdgrpc.integrations.vllm")

# A key vLLM never sets: marks params this side already turned into a load, so a second
# update_state_after_alloc for the same request starts nothing.
_TAKEN = "pdgrpc_taken"


class WorkerInfo:
    """The worker side's handshake address and transport instance, learned once at
    start-up through vLLM's handshake metadata."""

    def __init__(self, address: str, writer_id: str) -> None:
        self.address = address
        self.writer_id = writer_id


class SchedulerSide:
    def __init__(self, *, engine_id: str, lease_s: float, draw_room: Callable[[], Room]) -> None:
        self.engine_id = engine_id
        self.lease_s = lease_s
        self._draw_room = draw_room
        self.worker: WorkerInfo | None = None
        self._jobs = Jobs()
        self._sending: set[str] = set()  # prefill: requests whose blocks wait for a decode
        self._loading: dict[str, TransferParams] = {}  # decode: loads not yet reported finished

    # -- decode ------------------------------------------------------------------------
    @staticmethod
    def _remote(params: dict[str, Any] | None) -> TransferParams | None:
        if not params or not params.get("do_remote_prefill") or params.get(_TAKEN):
            return None
        return TransferParams.from_json(params)

    def matched_tokens(self, req_id: str, params: dict[str, Any] | None, num_prompt_tokens: int,
                       num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens the prefill holds beyond what this decode computed; loaded
        asynchronously. Bad params fail the request here, naming the field."""
        remote = self._remote(params)
        if remote is None:
            return 0, False
        count = min(remote.num_tokens, num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, req_id: str, params: dict[str, Any] | None, block_ids: list[int],
                    cached_blocks: int, num_external_tokens: int) -> None:
        remote = self._remote(params)
        if remote is None:
            return
        assert params is not None
        params[_TAKEN] = True  # one transfer per request
        if num_external_tokens > 0:
            self._loading[req_id] = remote
            self._jobs.loads.append(LoadJob(req_id, remote, tuple(block_ids), cached_blocks))
        else:  # all of it cached here: the prefill's blocks go back now
            self._jobs.releases.append(ReleaseJob(None, remote))

    # -- both --------------------------------------------------------------------------
    def finished(self, req_id: str, params: dict[str, Any] | None, block_ids: list[int], completed: bool,
                 num_computed_tokens: int) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (whether the blocks stay until the worker reports
        the request finished, the params for the response)."""
        if req_id in self._loading:  # decode: ended while its KV was on its way
            self._jobs.releases.append(ReleaseJob(req_id, self._loading[req_id]))
            return False, None  # vLLM itself holds a request's blocks while it waits for KV
        remote = self._remote(params)
        if remote is not None:  # decode: ended before its blocks were allocated
            self._jobs.releases.append(ReleaseJob(None, remote))
            return False, None
        if not wants_remote_decode(params) or not completed or not block_ids:
            return False, None
        if self.worker is None:
            raise ConfigError("PdgrpcConnector: the worker side never reported its handshake address")
        room, secret = self._draw_room(), draw_secret()
        self._sending.add(req_id)
        self._jobs.sends.append(SendJob(req_id, room, secret, tuple(block_ids), self.lease_s))
        tp = TransferParams(room, secret, self.worker.address, self.worker.writer_id, tuple(block_ids),
                            num_computed_tokens, self.engine_id)
        return True, tp.to_json()

    def take_jobs(self) -> Jobs:
        jobs, self._jobs = self._jobs, Jobs()
        return jobs

    def reported(self, finished_sending: Iterable[str], finished_recving: Iterable[str]) -> None:
        """The worker side's completions reached the scheduler."""
        self._sending.difference_update(finished_sending)
        for req_id in finished_recving:
            self._loading.pop(req_id, None)

    @property
    def pending_push_work(self) -> bool:
        """Blocks still wait for a decode: vLLM keeps stepping so the worker side can
        report them sent (or expired)."""
        return bool(self._sending)
