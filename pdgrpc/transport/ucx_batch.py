"""Batches of contiguous tag messages that complete as one.

A write's data messages go one per contiguous run (an 8k-token transfer of a 24-layer
model is 48 runs of 2 MiB). With a UCX completion callback on every message, each
message costs the receiver a ctypes callback from inside ``ucp_worker_progress``, a
dispatch and a Python completion on the thread that also does the copies, all with the
caches cold after a wake-up.

A batch posts all its messages with one reused parameter block, and only the last
carries the completion callback. When that callback has run, the other requests are
tested (``ucp_tag_recv_request_test`` / ``ucp_request_check_status``): normally they
are complete already, since one sender's messages are matched and fetched in order.
Any still pending are tested again after every progress round until none is left. The
caller's callback runs once, with every message's ``(status, length)`` in posting
order. The requests found complete are freed later (:meth:`Batch.release`, after the
ACKs that callback leads to): right after a transfer the caches are flushed by its
data, and every ctypes call on the way to the ACK delays it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

from pdgrpc.transport.ucx_api import (
    DATATYPE_CONTIG_BYTES, OP_ATTR_FIELD_CALLBACK, OP_ATTR_FIELD_DATATYPE, OP_ATTR_FIELD_USER_DATA,
    OP_ATTR_FLAG_NO_IMM_CMPL, UCS_INPROGRESS, UCS_OK, Param, status_of, TagRecvInfo,
)

__all__ = ["Batch", "BatchCompletion"]

# Every message's (status, received length) in posting order; lengths are 0 for sends.
BatchCompletion = Callable[[list[tuple[int, int]]], None]


class Batch:
    """The requests of one batch: which are still UCX's, and what those done returned."""

    __slots__ = ("recv", "ptrs", "results", "left", "next", "cb", "keep", "abandoned", "complete")

    def __init__(self, recv: bool, cb: BatchCompletion, keep: Any) -> None:
        self.recv = recv
        self.ptrs: list[int | None] = []  # request pointers; None once freed
        self.results: list[tuple[int, int]] = []
        self.left = 0  # requests not yet complete
        self.next = 0  # every request before this index is complete
        self.cb = cb
        self.keep = keep  # the buffers' owner, alive until every request is complete
        self.abandoned = False  # the owner stopped waiting: free the requests, call nobody
        self.complete: list[int] = []  # requests settle() found complete, not yet freed (release())

    def post(self, api: Any, target: int, runs: Sequence[Sequence[int]], tags: Sequence[int], mask: int,
             param: "ctypes._Pointer[Param]", token: int, cb_ptr: int | None) -> int:
        """Post one contiguous tag message per run (a send on endpoint ``target`` for a
        send batch, else a receive on worker ``target``), all with ``token`` as user data
        and only the last with the callback ``cb_ptr``. Returns UCS_INPROGRESS, or the
        status of the post that failed (those before it are posted)."""
        p = param.contents
        p.op_attr_mask = OP_ATTR_FIELD_USER_DATA | OP_ATTR_FIELD_DATATYPE | OP_ATTR_FLAG_NO_IMM_CMPL
        p.datatype = DATATYPE_CONTIG_BYTES
        p.user_data = token
        p.cb = cb_ptr
        last = len(runs) - 1
        send, recv = api.tag_send_nbx, api.tag_recv_nbx
        for i, ((addr, nbytes), tag) in enumerate(zip(runs, tags)):
            if i == last:  # only the last message calls back
                p.op_attr_mask |= OP_ATTR_FIELD_CALLBACK
            ptr = recv(target, addr, nbytes, tag, mask, param) if self.recv else send(target, addr, nbytes, tag, param)
            status = status_of(ptr)
            if status != UCS_INPROGRESS:
                return status
            self.ptrs.append(ptr)
            self.results.append((UCS_INPROGRESS, 0))
            self.left += 1
        return UCS_INPROGRESS

    def done(self, i: int, status: int, length: int) -> None:
        """Request ``i`` completed through its callback (and was freed by the worker)."""
        if self.ptrs[i] is not None:
            self.ptrs[i] = None
            self.results[i] = (status, length)
            self.left -= 1

    def settle(self, api: Any, info: TagRecvInfo) -> bool:
        """Test the requests not yet known complete, in order, keeping those that are for
        :meth:`release`; stop at the first still in progress. True once none is left."""
        ptrs, results = self.ptrs, self.results
        n = len(ptrs)
        i = self.next
        ref = ctypes.byref(info)
        while i < n:
            ptr = ptrs[i]
            if ptr is not None:
                if self.recv:
                    status = api.tag_recv_request_test(ptr, ref)
                    length = info.length if status == UCS_OK else 0
                else:
                    status, length = api.request_check_status(ptr), 0
                if status == UCS_INPROGRESS:
                    break
                self.complete.append(ptr)
                ptrs[i] = None
                results[i] = (status, length)
                self.left -= 1
            i += 1
        self.next = i
        return self.left == 0

    def release(self, api: Any) -> None:
        """Free the requests :meth:`settle` found complete."""
        for ptr in self.complete:
            api.request_free(ptr)
        self.complete.clear()

    def pending(self) -> list[int]:
        """Pointers of the requests not yet complete (to cancel them)."""
        return [p for p in self.ptrs if p is not None]
