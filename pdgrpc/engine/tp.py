"""All-reduce implementations for a tensor-parallel reference engine.

A :class:`~pdgrpc.engine.reference.ReferenceEngine` rank computes partial sums (its heads'
share of the attention output projection, its columns' share of the MLP down
projection) and hands each to an ``all_reduce`` callable that returns the sum over the
TP group. Because the model's arithmetic is exact, any summation order gives the TP=1
bits, so these can be as simple as they look.

- :func:`torch_distributed_all_reduce` -- one process per rank (the TP servers): a
  ``torch.distributed`` group, e.g. gloo.
"""

from __future__ import annotations

from typing import Any

import torch

from pdgrpc.engine.model import AllReduce

__all__ = ["torch_distributed_all_reduce"]


def torch_distributed_all_reduce(group: Any = None) -> AllReduce:
    """An all-reduce over a ``torch.distributed`` process group (default: the world).
    Every rank must call it the same number of times with the same shapes -- which the
    engine does as long as all ranks get the same ``prefill_chunk``/``decode_step`` calls."""
    import torch.distributed as dist

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return all_reduce
