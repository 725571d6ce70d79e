"""What the decode scheduler keeps per request (:class:`Job`) and what it hands the
Decode stream (:class:`Tokens`, :class:`Failed`)."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from pdgrpc.decode.prefills import PrefillInfo
from pdgrpc.engine.base import SamplingParams
from pdgrpc.errors import PdgrpcError
from pdgrpc.metrics.catalog import ServerAbortReason
from pdgrpc.state import DecodeDeadlines
from pdgrpc.v1 import bootstrap_pb2 as bpb

__all__ = ["DecodeFailure", "Failed", "Job", "SchedulerConfig", "Tokens"]


class DecodeFailure(PdgrpcError):
    """A request ends with this gRPC status (``code``) and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Tokens for the client stream (one DecodeResponse)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str = ""
    bytes_transferred: int = 0  # set on the first message
    transfer_seconds: float = 0.0  # set on the first message
    top: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()  # per token: (ids, logprobs)


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request ended without (further) output: the call ends with this status."""

    code: grpc.StatusCode
    message: str


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    deadlines: DecodeDeadlines = DecodeDeadlines()
    query_interval_s: float = 0.05  # at most one QueryDpRanks per prefill per interval
    rpc_timeout_s: float = 5.0  # bootstrap calls and AbortRoom
    idle_poll_s: float = 0.02  # loop period while requests wait (deadlines, dp queries)
    # How long a decode step that serves only requests whose first token the Decode stream
    # is still sending waits for those sends (see DecodeScheduler._compute). 0: never.
    first_token_wait_s: float = 0.002
    compute_nice: int = 0  # added to the compute thread's nice value (pdgrpc.serving.threads)


@dataclasses.dataclass(eq=False)
class Job:
    """One Decode call, from admission to its last message."""

    room: int
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    prefill: PrefillInfo
    num_pages: int
    out: "asyncio.Queue[Tokens | Failed]"
    admitted_at: float
    # Filled in as the request goes.
    dp_rank: int | None = None
    slot: int | None = None
    pages: tuple[int, ...] = ()
    handshake_sent_at: float = 0.0
    handshaken: bool = False  # every worker of the dp rank accepted the handshake
    contacted: list[bpb.WorkerInfo] = dataclasses.field(default_factory=list)  # sent a handshake
    handshake_task: "asyncio.Task[None] | None" = None
    last_error: str = ""  # last handshake problem, for the deadline message
    override: Failed | None = None  # a status decided by the driver (e.g. handshake refused)
    abort_cause: ServerAbortReason | None = None  # with override: the metrics' abort reason
    transport_reason: str | None = None
    # Running (after commit).
    running: bool = False
    last_token: int = 0
    generated: int = 0
    cancelled: bool = False
    finished: bool = False  # the last message (tokens with finish_reason, or Failed) is queued
    # Set by the Decode stream once its first message is sent (or the stream ended).
    first_sent: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def position(self) -> int:
        """Position of ``last_token`` (the prompt holds positions [0, len))."""
        return len(self.input_ids) + self.generated - 1
