"""`genfast serve --tp N`: rank 0 serves HTTP and schedules; the other ranks mirror its model calls.

Every tensor-parallel rank must run the same forward passes in the same order (each holds a
slice of every layer, and the all-reduces inside a forward pair up across ranks). The scheduler
(which requests run, which tokens were sampled) exists only on rank 0. Before each model call
rank 0 broadcasts what it is about to run — a prefill of these prompt tokens at these positions
of slot s (those before them are a reused prefix, the same on every rank), or a
decode step of these tokens at these positions over this cache length — and the followers run
exactly that call on their shard. Sampling needs the complete logits, which every rank has
(the output head is replicated), but only rank 0 samples: its tokens come back in the next
broadcast.

Messages are small CPU int64 tensors (gloo on CPU; on CUDA the process group routes CPU tensors
to gloo too): a header [op, arg, rows, columns], then the rows x columns payload if any.

While idle, rank 0 sends a keep-alive every KEEPALIVE_S: a follower waits in a collective, and
torch.distributed fails collectives that wait longer than the process group's timeout (30 min
for gloo by default), which an idle server easily exceeds.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import Tensor

KEEPALIVE_S = 60.0


class Op(enum.IntEnum):
    STOP = 0  # rank 0's engine stopped: followers return
    KEEPALIVE = 1
    PREFILL = 2  # arg: the slot; payload: [2, S] the prompt tokens not cached, their positions
    DECODE = 3  # arg: the cache length read; payload: [2, B] tokens, positions


class StepBroadcast:
    """Rank 0's side sends, the followers' side receives; both use the same calls in order."""

    def send(self, op: Op, arg: int = 0, payload: Tensor | None = None) -> None:
        rows, columns = (0, 0) if payload is None else payload.shape
        dist.broadcast(torch.tensor([int(op), arg, rows, columns]), src=0)
        if payload is not None:
            dist.broadcast(payload.to("cpu", torch.int64).contiguous(), src=0)

    def receive(self) -> tuple[Op, int, Tensor | None]:
        header = torch.empty(4, dtype=torch.int64)
        dist.broadcast(header, src=0)
        op, arg, rows, columns = header.tolist()
        payload = None
        if rows:
            payload = torch.empty(rows, columns, dtype=torch.int64)
            dist.broadcast(payload, src=0)
        return Op(op), arg, payload
