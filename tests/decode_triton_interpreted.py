"""Checks of the Triton split-KV decode attention under Triton's CPU interpreter.

Run as a script by tests/test_decode_triton.py with TRITON_INTERPRET=1 in its environment:
Triton reads that switch when the kernels are defined, so it must be set before this process
imports them. Prints one " ok " line a case; exits non-zero on the first failure. With the
argument ``cuda`` (and no interpreter) the same cases run on the GPU, the bf16 ones through the
tensor cores; where weft is not installed, through benchmarks/_bootstrap.py:

    python3 -c "import sys; sys.path[:0] = ['benchmarks', 'tests']; sys.argv[1:] = ['cuda'];
                import _bootstrap; _bootstrap.ensure_weft(); import decode_triton_interpreted as t; t.main()"

The interpreter's tl.dot mishandles bf16 operands on the CPU, so under it the kernel upcasts
its (already rounded) bf16 operands to float32 before each product: the products are the
same, exact in float32, as the GPU's bf16 MMA's; the rounding of q and of P to bf16 stays.
"""

from __future__ import annotations

import sys
import warnings

import torch

from weft.strategies.attention.decode_split import split_decode_attention
from weft.strategies.attention.kernels.decode_triton import CONFIG, split_plan, triton_decode_attention

#: Against the float64 reference: float32 throughout, or bf16 inputs, P and output.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")


def randn(*shape, g):
    """Drawn on the CPU (the same numbers on any device), then moved before any view is taken."""
    return torch.randn(*shape, generator=g).to(DEVICE)


def reference(query, key, value, lengths, scale):
    """float64 attention of each row over its first lengths[b] rows, and the LSE of its
    scaled scores (torch.logsumexp over the visible rows), (B, Hq, 1, D) and (B, Hq, 1)."""
    b, hq, _, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    groups = hq // hkv
    k = key.double().repeat_interleave(groups, 1)  # (B, Hq, N, D): query head h reads kv head h // G
    v = value.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) * scale  # (B, Hq, 1, N)
    if lengths is not None:
        visible = torch.arange(n, device=key.device) < lengths.reshape(-1, 1, 1, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def check(name, query, key, value, lengths, *, scale, splits=None, against_split=True):
    out, lse = triton_decode_attention(query, key, value, lengths=lengths, scale=scale, return_lse=True,
                                       plan=split_plan(key, splits=splits))
    want, want_lse = reference(query, key, value, lengths, scale)
    assert out.shape == query.shape and out.dtype == query.dtype, (out.shape, out.dtype)
    assert lse.shape == query.shape[:3] and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    tol = TOLERANCE[key.dtype]
    error = float((out.double() - want).abs().max())  # NaN fails the comparison below
    lse_error = float((lse.double() - want_lse).abs().max())
    assert error < tol, f"{name}: out differs from the float64 reference by {error}"
    assert lse_error < 1e-4, f"{name}: lse differs from torch.logsumexp by {lse_error}"
    if against_split:  # the torch version it replaces, same numerics contract
        other, other_lse = split_decode_attention(query, key, value, lengths=lengths, scale=scale, splits=4,
                                                  return_lse=True)
        gap = float((out.double() - other.double()).abs().max())
        assert gap < tol, f"{name}: out differs from split_decode_attention by {gap}"
        assert float((lse - other_lse.float()).abs().max()) < 1e-4, name
    print(name, "ok", f"{error:.1e} lse {lse_error:.1e}")


def cache(b, hkv, n, d, dtype, g):
    return (randn(b, hkv, n, d, g=g).to(dtype) for _ in range(2))


def main() -> None:
    # numpy's warning for the log2(0) of a split past a row's length (-inf, as meant) under the interpreter
    warnings.filterwarnings("ignore", "divide by zero encountered in log2", RuntimeWarning)
    g = torch.Generator().manual_seed(0)
    # Qwen2.5-VL's 28 query over 4 KV heads; N not a multiple of BLOCK_N; a row that sees one key,
    # one that ends mid-block (mid-split), one the whole buffer.
    b, hq, hkv, d, n = 3, 28, 4, 32, 333
    assert n % CONFIG["BLOCK_N"] and 150 % CONFIG["BLOCK_N"]
    lengths = torch.tensor([1, 150, 333], device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        query = randn(b, hq, 1, d, g=g).to(dtype)
        key, value = cache(b, hkv, n, d, dtype, g)
        name = str(dtype).removeprefix("torch.")
        for splits in (None, 1, 3):  # the default heuristic's count (6 here), one split, splits of 2 blocks
            check(f"{name} gqa28/4 ragged splits={splits}", query, key, value, lengths, scale=d ** -0.5,
                  splits=splits)
    # One length for every row, (1,), and no lengths at all; odd groups, padded head size (24 -> 32).
    query = randn(2, 6, 1, 24, g=g)
    key, value = cache(2, 2, 200, 24, torch.float32, g)
    check("one length for every row", query, key, value, torch.tensor([129], device=DEVICE), scale=0.3)
    check("lengths None", query, key, value, None, scale=0.3)
    # More splits than the merge takes at once (16): its loop over blocks of splits.
    check("18 splits", randn(1, 2, 1, 16, g=g), *cache(1, 1, 1100, 16, torch.float32, g),
          torch.tensor([700], device=DEVICE), scale=0.25, splits=18)
    # The merge's other launches (CONFIG, what decode_attention.py --sweep-merge times): a head's
    # columns over programs (32 of a padded 48), blocks of 4 splits, all 18 splits in one load.
    query, (key, value) = randn(2, 4, 1, 40, g=g), cache(2, 2, 1100, 40, torch.float32, g)
    base = dict(CONFIG)
    try:
        for block_d, block_s in ((32, 4), (32, 64), (128, 64)):
            CONFIG.update(merge_block_d=block_d, merge_block_s=block_s, merge_warps=1)
            check(f"merge columns {block_d} splits {block_s}", query, key, value,
                  torch.tensor([700, 9], device=DEVICE), scale=0.25, splits=18)
    finally:
        CONFIG.update(base)
    check("mha", randn(2, 4, 1, 16, g=g), *cache(2, 4, 90, 16, torch.float32, g),
          torch.tensor([90, 17], device=DEVICE), scale=0.25)
    # Non-contiguous views: the cache a slice along N of a larger buffer; a (B, N, Hkv, D) buffer
    # transposed; a query transposed from (B, 1, Hq, D).
    big_k, big_v = cache(3, 4, 600, 16, torch.float32, g)
    query = randn(3, 1, 28, 16, g=g).transpose(1, 2)  # (B, Hq, 1, D), strided
    sliced_k, sliced_v = big_k[:, :, 100:450], big_v[:, :, 100:450]  # (B, Hkv, 350, D), stride along N = D
    check("slice along N", query, sliced_k, sliced_v, torch.tensor([350, 64, 2], device=DEVICE), scale=0.25)
    bnhd_k, bnhd_v = (randn(3, 300, 4, 16, g=g) for _ in range(2))  # (B, N, Hkv, D)
    check("(B, N, Hkv, D) transposed", query, bnhd_k.transpose(1, 2), bnhd_v.transpose(1, 2),
          torch.tensor([300, 65, 7], device=DEVICE), scale=0.25)
    head_dim_strided = randn(3, 4, 128, 32, g=g)[..., ::2]  # stride 2 along D
    check("stride along head_dim", query, head_dim_strided, head_dim_strided.flip(2),
          torch.tensor([128, 3, 64], device=DEVICE), scale=0.25)
    # A row with no visible key (a shard's part of a cache past its length): out 0, lse -inf, no NaN
    # (split_decode_attention requires lengths >= 1, so no comparison with it here).
    key, value = cache(2, 4, 100, 16, torch.float32, g)
    out, lse = triton_decode_attention(randn(2, 28, 1, 16, g=g), key, value,
                                       lengths=torch.tensor([0, 100], device=DEVICE), scale=0.25, return_lse=True)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all() and lse[1].isfinite().all()
    print("empty row", "ok")
    # torch.compile traces through the operator (its fake implementation), no graph break, with
    # the split layout asked beforehand (``split_plan``, as the static cache does) or inside.
    query = randn(3, 28, 1, 16, g=g)
    plan = split_plan(bnhd_k.transpose(1, 2))
    compiled = torch.compile(lambda q, k, v, lens: triton_decode_attention(q, k, v, lengths=lens, scale=0.25),
                             backend="aot_eager", fullgraph=True)
    planned = torch.compile(lambda q, k, v, lens: triton_decode_attention(q, k, v, lengths=lens, scale=0.25,
                                                                          plan=plan),
                            backend="aot_eager", fullgraph=True)
    lens = torch.tensor([5, 300, 200], device=DEVICE)
    got = compiled(query, bnhd_k.transpose(1, 2), bnhd_v.transpose(1, 2), lens)
    want = triton_decode_attention(query, bnhd_k.transpose(1, 2), bnhd_v.transpose(1, 2), lengths=lens, scale=0.25)
    assert torch.equal(got, want)
    assert torch.equal(planned(query, bnhd_k.transpose(1, 2), bnhd_v.transpose(1, 2), lens), want)
    print("torch.compile fullgraph", "ok")


if __name__ == "__main__":
    main()
