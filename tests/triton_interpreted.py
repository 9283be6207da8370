"""Checks of the Triton ring backward under Triton's CPU interpreter (float32).

Run as a script by tests/test_triton_backward.py with TRITON_INTERPRET=1 in its
environment: Triton reads that switch when the kernels are defined, so it must be
set before this process imports them. Exits non-zero on the first failure.
"""

from __future__ import annotations

import torch

from weft.strategies.block_kernels import KERNELS, BlockKernel, _triton_accumulate
from weft.strategies.ring import emulate_ring
from weft.strategies.sequence_shard import shard_sequence, unshard_sequence
from weft.strategies.triton_backward import backward_accumulate

MATH = KERNELS["math"]
SMALL = {"dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def reference(dout, q, k, v, *, causal, scale):
    """float64 math kernel, K/V expanded to the query heads and the groups summed back."""
    b, kv, sk, d = k.shape
    groups = q.shape[1] // kv
    ke, ve = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    out, lse = MATH.forward(q.double(), ke, ve, causal=causal, scale=scale)
    dq, dk, dv = MATH.backward(dout.double(), q.double(), ke, ve, out, lse, causal=causal, scale=scale)
    return out, lse, dq, dk.view(b, kv, groups, sk, d).sum(2), dv.view(b, kv, groups, sk, d).sum(2)


def check_block(*, batch, heads, kv_heads, sq, sk, head_dim, causal, config, strided=False) -> None:
    g = torch.Generator().manual_seed(sq * 7 + head_dim)
    q = torch.randn(batch, heads, 2 * sq if strided else sq, head_dim, generator=g)
    q = q[:, :, sq:] if strided else q  # a sequence slice, as the zigzag halves are
    k, v = (torch.randn(batch, kv_heads, sk, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(batch, heads, sq, head_dim, generator=g)
    scale = head_dim**-0.5
    out, lse, dq_r, dk_r, dv_r = reference(dout, q, k, v, causal=causal, scale=scale)
    # Prefilled accumulators: the kernels must add, not overwrite.
    dq, dk, dv = torch.full(q.shape, 3.0), torch.full(k.shape, 3.0), torch.full(v.shape, 3.0)
    backward_accumulate(dout, q, k, v, out.float(), lse.float(), causal=causal, scale=scale, dq=dq, dk=dk, dv=dv, config=config)
    errors = [rel(a - 3.0, b) for a, b in ((dq, dq_r), (dk, dk_r), (dv, dv_r))]
    case = f"block B{batch} H{heads}/{kv_heads} {sq}x{sk} D{head_dim} causal={causal} strided={strided}"
    assert max(errors) <= 1e-5, f"{case}: relative errors dq/dk/dv {errors}"
    print(case, "ok", [f"{e:.1e}" for e in errors])


def check_ring(*, world, layout, causal, heads, kv_heads, seq, head_dim) -> None:
    """The ring schedule with the accumulating backward equals full attention."""
    def forward(q, k, v, **kw):  # the math kernel takes equal heads; the Triton backward takes K/V's own
        groups = q.shape[1] // k.shape[1]
        return MATH.forward(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **kw)

    kernel = BlockKernel("triton-interpreted", forward, MATH.backward, gqa=True, strided=True, accumulate=_triton_accumulate)
    g = torch.Generator().manual_seed(world * 100 + seq)
    q = torch.randn(2, heads, seq, head_dim, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(2, heads, seq, head_dim, generator=g)
    scale = head_dim**-0.5

    def parts(t):
        return [shard_sequence(t, dim=2, rank=r, world=world, layout=layout) for r in range(world)]

    outs, grads = emulate_ring(parts(q), parts(k), parts(v), parts(dout), causal=causal, scale=scale, layout=layout, kernel=kernel)
    got = [unshard_sequence(outs, dim=2, layout=layout)] + [unshard_sequence([gr[i] for gr in grads], dim=2, layout=layout) for i in range(3)]
    out, _, dq_r, dk_r, dv_r = reference(dout, q, k, v, causal=causal, scale=scale)
    errors = [rel(a, b) for a, b in zip(got, (out, dq_r, dk_r, dv_r))]
    case = f"ring {world} {layout} causal={causal} H{heads}/{kv_heads} S{seq} D{head_dim}"
    assert max(errors) <= 1e-5, f"{case}: relative errors out/dq/dk/dv {errors}"
    print(case, "ok", [f"{e:.1e}" for e in errors])


def main() -> None:
    torch.manual_seed(0)
    check_block(batch=1, heads=2, kv_heads=2, sq=64, sk=64, head_dim=16, causal=True, config=SMALL)
    check_block(batch=2, heads=4, kv_heads=2, sq=80, sk=80, head_dim=24, causal=True, config=SMALL)  # ragged tiles, padded head_dim
    check_block(batch=1, heads=4, kv_heads=1, sq=48, sk=96, head_dim=80, causal=False, config=SMALL)  # GQA 4:1, head_dim 80
    check_block(batch=1, heads=2, kv_heads=2, sq=40, sk=24, head_dim=32, causal=False, config=SMALL, strided=True)
    check_block(batch=1, heads=2, kv_heads=1, sq=96, sk=96, head_dim=32, causal=True, config=None)  # the GPU tile sizes
    for world, layout, causal in ((2, "zigzag", True), (4, "zigzag", True), (4, "contiguous", True), (2, "zigzag", False)):
        check_ring(world=world, layout=layout, causal=causal, heads=4, kv_heads=2, seq=64, head_dim=16)


if __name__ == "__main__":
    main()
