"""``PdgrpcConnector``: vLLM's ``KVConnectorBase_V1`` over pdgrpc.

vLLM builds two instances per server: one with the scheduler role (in the engine core,
:class:`~pdgrpc.integrations.vllm.scheduler.SchedulerSide` behind it) and one with the
worker role (in each worker, :class:`~pdgrpc.integrations.vllm.worker.WorkerSide`).
Who calls which hook:

- scheduler: ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` when a
  decode request with ``kv_transfer_params`` is admitted, ``request_finished`` when any
  request ends (a prefill's answer carries the params the decode needs),
  ``build_connector_meta`` each step (the jobs for the worker side),
  ``update_connector_output`` with the worker side's completions, and
  ``has_pending_push_work`` (blocks still held for a decode keep vLLM stepping);
- worker: ``register_kv_caches`` once (regions on the transport, the handshake server),
  ``get_handshake_metadata`` once (its address goes to the scheduler side),
  ``bind_connector_metadata`` each step before the forward (hands the jobs over),
  ``get_transfer_results`` each step.
  Loads finish between steps, so ``wait_for_layer_load``, ``save_kv_layer`` and
  ``wait_for_save`` have nothing to do: a prefill's blocks are written from vLLM's cache
  once the request finished, and vLLM keeps them until the send is reported.

Settings come from ``kv_connector_extra_config``: ``transport`` (``tcp``, ``rdma``),
``transport_options``, ``host``, ``port``, ``slots``, ``lease_s``, and the timeouts of
:class:`~pdgrpc.integrations.vllm.worker.WorkerOptions`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from pdgrpc.errors import ConfigError
from pdgrpc.integrations.vllm.jobs import Jobs
from pdgrpc.integrations.vllm.scheduler import SchedulerSide, WorkerInfo
from pdgrpc.integrations.vllm.version import VLLM_VERSION
from pdgrpc.integrations.vllm.worker import WorkerOptions, WorkerSide, compat_hash
from pdgrpc.state.room import ROOM_LIMIT, Room

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdgrpcConnector", "PdgrpcHandshake", "PdgrpcMetadata"]

DEFAULT_LEASE_S = 30.0  # a prefill's blocks wait this long for the decode's handshake


class PdgrpcMetadata(KVConnectorMetadata):
    """One step's jobs, scheduler side to worker side."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs


@dataclasses.dataclass
class PdgrpcHandshake(KVConnectorHandshakeMetadata):
    """A worker's handshake address and transport instance, for its scheduler side."""

    address: str
    writer_id: str


def _log_like_vllm() -> None:
    """pdgrpc's log lines go where vLLM's go, at vLLM's level: a server's one log shows
    the connector's transport and its warnings."""
    ours, theirs = logging.getLogger("pdgrpc"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def _draw_room() -> Room:
    return Room(secrets.randbelow(ROOM_LIMIT - 1) + 1)


def _options(extra: dict[str, Any]) -> tuple[WorkerOptions, float]:
    """The worker options and the lease from ``kv_connector_extra_config``; unknown or
    mistyped keys are a ConfigError naming the key."""
    fields = {f.name: f for f in dataclasses.fields(WorkerOptions)}
    values: dict[str, Any] = {}
    lease = DEFAULT_LEASE_S
    for key, value in extra.items():
        if key == "lease_s":
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"kv_connector_extra_config.lease_s must be a number > 0, got {value!r}")
            lease = float(value)
            continue
        if key not in fields:
            raise ConfigError(f"kv_connector_extra_config.{key} is not a PdgrpcConnector setting; "
                              f"known: {sorted([*fields, 'lease_s'])}")
        default = getattr(WorkerOptions(), key)
        kind = type(default)
        ok = isinstance(value, dict) if kind is dict else isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if not ok or isinstance(value, bool):
            raise ConfigError(f"kv_connector_extra_config.{key} must be {kind.__name__}, got {value!r}")
        values[key] = float(value) if kind is float else value
    return WorkerOptions(**values), lease


class PdgrpcConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(f"PdgrpcConnector supports models with one KV cache group (attention only); this "
                              f"model has {len(kv_cache_config.kv_cache_groups)}")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ConfigError("PdgrpcConnector supports tensor_parallel_size 1 and pipeline_parallel_size 1")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        options, lease = _options(extra)
        self._block_size = vllm_config.cache_config.block_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(engine_id=str(self._kv_transfer_config.engine_id or ""), lease_s=lease,
                                        draw_room=_draw_room)
        else:
            self._worker = WorkerSide(options)

    # -- worker ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, compat_hash(kv_caches, self._block_size, VLLM_VERSION))

    def get_handshake_metadata(self) -> PdgrpcHandshake | None:
        if self._worker is None:
            return None
        return PdgrpcHandshake(self._worker.address, self._worker.writer_id)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's jobs start here, before the forward pass: vLLM calls
        ``start_load_kv`` after it for asynchronous loads, and a decode's handshake
        would otherwise wait for a whole prefill step."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, PdgrpcMetadata)
            self._worker.submit(connector_metadata.jobs)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return None  # the jobs started when the step's metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        done = self._worker.take_finished()
        return KVConnectorTransferResults(done.sending, done.recving, done.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.get_transfer_results(finished_req_ids)
        return done.finished_sending or None, done.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler -------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._sched is not None
        info = metadata.get(0)
        if not isinstance(info, PdgrpcHandshake):
            raise ConfigError(f"PdgrpcConnector: tp rank 0 sent no handshake metadata ({metadata!r})")
        self._sched.worker = WorkerInfo(info.address, info.writer_id)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(request.request_id, request.kv_transfer_params,
                                          request.num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._sched is not None
        group = blocks.blocks[0]
        cached = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        self._sched.after_alloc(request.request_id, request.kv_transfer_params, [b.block_id for b in group],
                                cached, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return PdgrpcMetadata(self._sched.take_jobs())

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._sched is not None
        self._sched.reported(connector_output.finished_sending or (), connector_output.finished_recving or ())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        return self._sched.finished(request.request_id, request.kv_transfer_params, list(block_ids), completed,
                                    request.num_computed_tokens)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending_push_work
