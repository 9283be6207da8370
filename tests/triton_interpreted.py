"""Checks of the Triton ring backward under Triton's CPU interpreter (float32).

Run as a script by tests/test_triton_backward.py with TRITON_INTERPRET=1 in its
environment: Triton reads that switch when the kernels are defined, so it must be
set before this process imports them. Exits non-zero on the first failure.
"""

from __future__ import annotations

import torch

from weft.strategies.attention.document_mask import document_mask
from weft.strategies.attention.emulate import emulate_ring
from weft.strategies.attention.kernels.blocks import KERNELS, BlockKernel, _triton_accumulate
from weft.strategies.attention.kernels.triton_backward import backward_accumulate
from weft.strategies.attention.ring import _Documents, _step_work, accumulators, attend_block, attend_block_backward
from weft.strategies.sequence.layout import shard_sequence, unshard_sequence

MATH = KERNELS["math"]
SMALL = {"dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def reference(dout, q, k, v, *, causal, scale, mask=None):
    """float64 math kernel, K/V expanded to the query heads and the groups summed back."""
    b, kv, sk, d = k.shape
    groups = q.shape[1] // kv
    ke, ve = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    out, lse = MATH.forward(q.double(), ke, ve, causal=causal, scale=scale, mask=mask)
    dq, dk, dv = MATH.backward(dout.double(), q.double(), ke, ve, out, lse, causal=causal, scale=scale, mask=mask)
    return out, lse, dq, dk.view(b, kv, groups, sk, d).sum(2), dv.view(b, kv, groups, sk, d).sum(2)


def check_block(*, batch, heads, kv_heads, sq, sk, head_dim, causal, config, strided=False, masked=False) -> None:
    g = torch.Generator().manual_seed(sq * 7 + head_dim)
    q = torch.randn(batch, heads, 2 * sq if strided else sq, head_dim, generator=g)
    q = q[:, :, sq:] if strided else q  # a sequence slice, as the zigzag halves are
    k, v = (torch.randn(batch, kv_heads, sk, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(batch, heads, sq, head_dim, generator=g)
    scale = head_dim**-0.5
    mask = None
    if masked:  # two packed documents, this block's rows and keys from anywhere in them
        doc_q, doc_k = (torch.randint(0, 2, (batch, n), generator=g) for n in (sq, sk))
        idx_q, idx_k = torch.randperm(sq + sk, generator=g)[:sq], torch.randperm(sq + sk, generator=g)[:sk]
        mask = document_mask(doc_q, doc_k, idx_q, idx_k, causal=True)  # (B, 1, Sq, Sk)
        mask[:, :, :, 0] = True  # every row sees a key (a packed row always sees itself)
    out, lse, dq_r, dk_r, dv_r = reference(dout, q, k, v, causal=causal, scale=scale, mask=mask)
    # Prefilled accumulators: the kernels must add, not overwrite.
    dq, dk, dv = torch.full(q.shape, 3.0), torch.full(k.shape, 3.0), torch.full(v.shape, 3.0)
    backward_accumulate(
        dout, q, k, v, out.float(), lse.float(), causal=causal, scale=scale, dq=dq, dk=dk, dv=dv, mask=mask,
        config=config,
    )
    errors = [rel(a - 3.0, b) for a, b in ((dq, dq_r), (dk, dk_r), (dv, dv_r))]
    case = f"block B{batch} H{heads}/{kv_heads} {sq}x{sk} D{head_dim} causal={causal} strided={strided} masked={masked}"
    assert max(errors) <= 1e-5, f"{case}: relative errors dq/dk/dv {errors}"
    print(case, "ok", [f"{e:.1e}" for e in errors])


def _forward(q, k, v, **kw):  # the math kernel takes equal heads; the Triton backward takes K/V's own
    groups = q.shape[1] // k.shape[1]
    return MATH.forward(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **kw)


KERNEL = BlockKernel(
    "triton-interpreted", _forward, MATH.backward, gqa=True, strided=True, masks=True, accumulate=_triton_accumulate
)


def check_ring(*, world, layout, causal, heads, kv_heads, seq, head_dim) -> None:
    """The ring schedule with the accumulating backward equals full attention."""
    kernel = KERNEL
    g = torch.Generator().manual_seed(world * 100 + seq)
    q = torch.randn(2, heads, seq, head_dim, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(2, heads, seq, head_dim, generator=g)
    scale = head_dim**-0.5

    def parts(t):
        return [shard_sequence(t, dim=2, rank=r, world=world, layout=layout) for r in range(world)]

    outs, grads = emulate_ring(
        parts(q), parts(k), parts(v), parts(dout), causal=causal, scale=scale, layout=layout, kernel=kernel
    )
    got = [unshard_sequence(outs, dim=2, layout=layout)] + [
        unshard_sequence([gr[i] for gr in grads], dim=2, layout=layout) for i in range(3)
    ]
    out, _, dq_r, dk_r, dv_r = reference(dout, q, k, v, causal=causal, scale=scale)
    errors = [rel(a, b) for a, b in zip(got, (out, dq_r, dk_r, dv_r))]
    case = f"ring {world} {layout} causal={causal} H{heads}/{kv_heads} S{seq} D{head_dim}"
    assert max(errors) <= 1e-5, f"{case}: relative errors out/dq/dk/dv {errors}"
    print(case, "ok", [f"{e:.1e}" for e in errors])


def check_packed_ring(*, world, layout, lengths, heads, kv_heads, head_dim) -> None:
    """Packed documents through the ring's per-block masks (every rank's schedule in turn,
    as ``emulate_ring`` does, with the documents' masks) equal attention per document."""
    seq = sum(lengths)
    g = torch.Generator().manual_seed(seq)
    q = torch.randn(1, heads, seq, head_dim, generator=g)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(1, heads, seq, head_dim, generator=g)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]  # (1, S)
    scale = head_dim**-0.5
    docs = _Documents(doc_ids, world=world, layout=layout, causal=True)

    def parts(t):
        return [shard_sequence(t, dim=2, rank=r, world=world, layout=layout) for r in range(world)]

    qs, dos = parts(q), parts(dout)
    kvs = [torch.stack([a, b]) for a, b in zip(parts(k), parts(v))]
    local = qs[0].shape[2]
    outs, lses = [], []
    for rank in range(world):
        out, lse = accumulators(qs[rank], kvs[rank][1])
        for step in range(world):
            work = _step_work(rank=rank, src=(rank - step) % world, world=world, layout=layout, causal=True,
                              local_len=local, docs=docs)

            if work is not None:
                attend_block(qs[rank], kvs[(rank - step) % world], block=work[0], groups=heads // kv_heads,
                             scale=scale, kernel=KERNEL, out=out, lse=lse, mask=work[1])
        outs.append(out)
        lses.append(lse)
    dqs = [torch.zeros(t.shape) for t in qs]
    dkvs = [torch.zeros(t.shape) for t in kvs]
    for rank in range(world):
        for step in range(world):
            src = (rank - step) % world
            work = _step_work(rank=rank, src=src, world=world, layout=layout, causal=True, local_len=local, docs=docs)
            if work is not None:
                attend_block_backward(dos[rank], qs[rank], kvs[src], outs[rank], lses[rank], block=work[0],
                                      groups=heads // kv_heads, scale=scale, kernel=KERNEL, dq=dqs[rank],
                                      dkv=dkvs[src], mask=work[1])
    got = [unshard_sequence(outs, dim=2, layout=layout), unshard_sequence(dqs, dim=2, layout=layout),
           unshard_sequence([d[0] for d in dkvs], dim=2, layout=layout),
           unshard_sequence([d[1] for d in dkvs], dim=2, layout=layout)]
    idx = torch.arange(seq)
    mask = document_mask(doc_ids, doc_ids, idx, idx, causal=True)
    out, _, dq_r, dk_r, dv_r = reference(dout, q, k, v, causal=False, scale=scale, mask=mask)
    errors = [rel(a, b) for a, b in zip(got, (out, dq_r, dk_r, dv_r))]
    case = f"packed ring {world} {layout} documents {lengths} H{heads}/{kv_heads} D{head_dim}"
    assert max(errors) <= 1e-5, f"{case}: relative errors out/dq/dk/dv {errors}"
    print(case, "ok", [f"{e:.1e}" for e in errors])


def check_adamw_sr() -> None:
    """The stochastic-rounding AdamW kernel: its float32 arithmetic equals the torch path's, and
    rounding onto the bf16 grid lands on a neighbour, unbiased (float32 storage: no bf16 here)."""
    from weft.strategies.optim import stochastic_round, stochastic_round_triton

    g = torch.randn(5000)
    tensors = [torch.randn(5000), g, torch.randn(5000) * 0.1, torch.rand(5000) * 0.01]
    ours, ref = [t.clone() for t in tensors], [t.clone() for t in tensors]
    settings = {"step": 3, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "seed": 7}
    stochastic_round_triton.adamw_step_(*ours, **settings)
    stochastic_round.adamw_step_(*ref, **settings)
    errors = [rel(a, b) for a, b in zip(ours, ref)]
    assert max(errors) <= 1e-6, f"adamw_sr kernel vs torch: {errors}"
    print("adamw_sr arithmetic", "ok", [f"{e:.1e}" for e in errors])
    # A weight of 1 + 2^-10 (a quarter of bf16's spacing above 1) with a zero update.
    n = 100_000
    p, zero = torch.full((n,), 1.0 + 2**-10), torch.zeros(n)
    stochastic_round_triton.adamw_step_(p, zero, zero.clone(), zero.clone(), **{**settings, "weight_decay": 0.0},
                                        to_bf16=(True, False, False))
    assert set(p.unique().tolist()) == {1.0, 1.0 + 2**-7}, p.unique()
    assert abs(p.mean().item() - (1.0 + 2**-10)) < 3e-5, p.mean().item()
    again = torch.full((n,), 1.0 + 2**-10)
    stochastic_round_triton.adamw_step_(again, zero, zero.clone(), zero.clone(), **{**settings, "weight_decay": 0.0},
                                        to_bf16=(True, False, False))
    assert torch.equal(again, p), "the same seed must round the same way"
    print("adamw_sr rounding", "ok", f"mean {p.mean().item():.7f}")


def main() -> None:
    torch.manual_seed(0)
    check_adamw_sr()
    check_block(batch=1, heads=2, kv_heads=2, sq=64, sk=64, head_dim=16, causal=True, config=SMALL)
    # ragged tiles, padded head_dim
    check_block(batch=2, heads=4, kv_heads=2, sq=80, sk=80, head_dim=24, causal=True, config=SMALL)
    # GQA 4:1, head_dim 80
    check_block(batch=1, heads=4, kv_heads=1, sq=48, sk=96, head_dim=80, causal=False, config=SMALL)
    check_block(batch=1, heads=2, kv_heads=2, sq=40, sk=24, head_dim=32, causal=False, config=SMALL, strided=True)
    check_block(batch=1, heads=2, kv_heads=1, sq=96, sk=96, head_dim=32, causal=True, config=None)  # the GPU tile sizes
    check_block(batch=2, heads=4, kv_heads=2, sq=48, sk=80, head_dim=16, causal=False, config=SMALL, masked=True)
    for world, layout, causal in (
        (2, "zigzag", True), (4, "zigzag", True), (4, "contiguous", True), (2, "zigzag", False),
    ):

        check_ring(world=world, layout=layout, causal=causal, heads=4, kv_heads=2, seq=64, head_dim=16)
    check_packed_ring(world=2, layout="zigzag", lengths=(20, 30, 14), heads=4, kv_heads=2, head_dim=16)
    check_packed_ring(world=4, layout="zigzag", lengths=(9, 40, 15), heads=2, kv_heads=1, head_dim=8)


if __name__ == "__main__":
    main()
