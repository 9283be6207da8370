"""Ring attention's block schedule run in one process: every rank in turn, no communication.

A test and benchmark helper, not a run path. It calls the real ring's block functions
(``block_for``, ``attend_block``, ``attend_block_backward``: the same blocks, kernels, GQA
expansion and merges), so one device can check the schedule's numerics against full
attention and time its compute per (rank, step): benchmarks/attention/ring_emulated.py does so with
``timer``. The P2P transfers, which the real ring overlaps with compute, are not emulated.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from weft.strategies.attention.kernels.blocks import BlockKernel
from weft.strategies.attention.ring import accumulators, attend_block, attend_block_backward, block_for

#: ``timer(phase, rank, step)``: a context manager entered around one schedule step's block
#: call; phase "fwd" or "bwd". Every (phase, rank, step) gets one, also a step with no block
#: (a contiguous-layout block in the future), so a timer sees the whole schedule.
Timer = Callable[[str, int, int], ContextManager]


def _untimed(phase: str, rank: int, step: int) -> ContextManager:
    return contextlib.nullcontext()


def emulate_ring(
    q_parts, k_parts, v_parts, dout_parts=None, *, causal: bool, scale: float, layout: str, kernel: BlockKernel,
    timer: Timer | None = None,
):
    """Every rank's block schedule run in turn.

    ``*_parts[r]`` is rank r's local tensor (in ``layout``). Returns per-rank outs and,
    when ``dout_parts`` is given, per-rank (dq, dk, dv). ``timer``: see ``Timer``; only
    the block calls run inside it (accumulators are made and casts done outside).
    """
    timed = timer or _untimed
    world = len(q_parts)
    s = q_parts[0].shape[2]
    groups = q_parts[0].shape[1] // k_parts[0].shape[1]
    kvs = [torch.stack([k, v]) for k, v in zip(k_parts, v_parts)]

    def block(rank: int, step: int):
        src = (rank - step) % world
        return src, block_for(rank=rank, src=src, world=world, layout=layout, causal=causal, local_len=s)

    outs, lses = [], []
    for rank in range(world):
        out, lse = accumulators(q_parts[rank], v_parts[rank])
        for step in range(world):
            src, work = block(rank, step)
            with timed("fwd", rank, step):
                if work is not None:
                    attend_block(q_parts[rank], kvs[src], block=work, groups=groups, scale=scale, kernel=kernel,
                                 out=out, lse=lse, first=step == 0)
        outs.append(out.to(q_parts[rank].dtype))
        lses.append(lse)
    if dout_parts is None:
        return outs, None
    acc = torch.promote_types(q_parts[0].dtype, torch.float32)
    dqs = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in q_parts]
    dkvs = [torch.zeros(kv.shape, dtype=acc, device=kv.device) for kv in kvs]
    for rank in range(world):
        for step in range(world):
            src, work = block(rank, step)
            with timed("bwd", rank, step):
                if work is not None:
                    attend_block_backward(dout_parts[rank], q_parts[rank], kvs[src], outs[rank], lses[rank],
                                          block=work, groups=groups, scale=scale, kernel=kernel, dq=dqs[rank],
                                          dkv=dkvs[src])
    grads = [(dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype)) for dq, dkv, q in zip(dqs, dkvs, q_parts)]
    return outs, grads
