"""Each LSE block kernel on the GPU against the float32 math kernel: forward, LSE, backward.

    python3 benchmarks/attention/kernels_check.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.strategies.attention.kernels.blocks import KERNELS, fa4_importable  # noqa: E402


def main() -> int:
    failures = 0
    reference = KERNELS["math"]
    cases = ((True, 512, 512, 4, 128), (False, 512, 256, 4, 128), (False, 256, 512, 4, 128), (True, 512, 512, 2, 128),
             (False, 512, 256, 1, 128), (True, 384, 384, 2, 80), (False, 200, 328, 4, 32), (True, 1000, 1000, 1, 64))
    names = ("cudnn", "torch_flash", "flash", "triton")
    for name in (n for n in names if n != "flash" or fa4_importable()):
        kernel = KERNELS[name]
        for causal, sq, sk, kv_heads, d in cases:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(2, 4, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(2, kv_heads, sk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(2, kv_heads, sk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            dout = torch.randn(2, 4, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            try:
                out, lse = kernel.forward(q, k, v, causal=causal, scale=d**-0.5)
                grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=d**-0.5)
            except Exception as error:  # report every kernel, not just the first failure
                print(f"{name} causal={causal} {sq}x{sk}: FAILED {type(error).__name__}: {error}")
                failures += 1
                continue
            groups = 4 // kv_heads  # the math reference takes equal heads: expand, then sum the groups back
            f32 = [q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)]
            ref_out, ref_lse = reference.forward(*f32, causal=causal, scale=d**-0.5)
            dq_r, dk_r, dv_r = reference.backward(dout.float(), *f32, ref_out, ref_lse, causal=causal, scale=d**-0.5)
            ref_grads = (
                dq_r,
                dk_r.view(2, kv_heads, groups, sk, d).sum(2),
                dv_r.view(2, kv_heads, groups, sk, d).sum(2),
            )
            errs = {
                "out": (out.float() - ref_out).abs().max().item(),
                "lse": (lse - ref_lse).abs().max().item(),
                **{n: (a.float() - b).abs().max().item() for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)},
            }
            bad = any(e > 0.05 for e in errs.values()) or lse.shape != ref_lse.shape
            failures += bad
            print(
                f"{name} causal={causal} {sq}x{sk} kv_heads={kv_heads} head_dim={d}: "
                f"lse {tuple(lse.shape)} {'BAD' if bad else 'ok'} "
                + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
            )
    failures += check_accumulate()
    failures += check_masked()
    failures += check_varlen()
    return 1 if failures else 0


def check_varlen() -> int:
    """The vision tower's one-call path (flash-attn-4 over packed windows, head_dim 80 as in
    Qwen2.5-VL's tower) against one float32 SDPA call per window: out and gradients."""
    from weft.strategies.attention.segment import segment_attention, segment_loop, varlen_runs

    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 64, 128, 192, 256, 320, 384, 448, 512, 576, 1024, 1280], device="cuda", dtype=torch.int32)
    total, heads, d = int(cu[-1]), 16, 80
    base = [torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
    views = [t.transpose(0, 1).unsqueeze(0) for t in base]  # (1, H, S, D) views, as transformers hands them
    if not varlen_runs(views[0]):
        print("varlen segments: flash-attn-4 does not run here; skipped")
        return 0

    def run(fn, dtype, **kw):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in views[:3])
        out = fn(q, k, v, cu_seqlens=cu, scale=d**-0.5, **kw)
        out.backward(views[3].to(dtype))
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    # The longest window (448 patches here), as transformers computes it from cu_seqlens: the
    # kernel sizes its backward's grid by it (a smaller value leaves query rows without dq).
    got = run(segment_attention, torch.bfloat16, max_seqlen=int((cu[1:] - cu[:-1]).max()))
    want = run(segment_loop, torch.float32)
    bf16 = run(segment_loop, torch.bfloat16)  # one SDPA call per window in bf16: the error to match
    errs = [(a - b).abs().max().item() for a, b in zip(got, want)]
    floor = [(a - b).abs().max().item() for a, b in zip(bf16, want)]
    bad = any(e > max(0.05, 2 * f) for e, f in zip(errs, floor))
    print(f"varlen segments (flash-attn-4, head_dim {d}): {'BAD' if bad else 'ok'} "
          + " ".join(f"{n}={e:.2e} (sdpa bf16 {f:.2e})" for n, e, f in zip(("out", "dq", "dk", "dv"), errs, floor)))
    return int(bad)


def check_masked() -> int:
    """The Triton backward with a packed-documents mask against the float32 math kernel."""
    from weft.strategies.attention.document_mask import document_mask
    from weft.strategies.attention.kernels.triton_backward import backward_accumulate

    g = torch.Generator(device="cuda").manual_seed(2)
    q, dout = (torch.randn(1, 8, 768, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    doc_q = torch.randint(0, 3, (1, 768), device="cuda", generator=g)
    doc_k = torch.randint(0, 3, (1, 1024), device="cuda", generator=g)
    # keys all before the queries
    idx_q, idx_k = torch.arange(1024, 1792, device="cuda"), torch.arange(1024, device="cuda")
    mask = document_mask(doc_q, doc_k, idx_q, idx_k, causal=True)
    f32 = [q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)]
    ref = KERNELS["math"]
    out, lse = ref.forward(*f32, causal=False, scale=128**-0.5, mask=mask)
    dq_r, dk_r, dv_r = ref.backward(dout.float(), *f32, out, lse, causal=False, scale=128**-0.5, mask=mask)
    dq, dk, dv = (
        torch.zeros(q.shape, device="cuda"),
        torch.zeros(k.shape, device="cuda"),
        torch.zeros(k.shape, device="cuda"),
    )
    backward_accumulate(
        dout, q, k, v, out.to(q.dtype), lse, causal=False, scale=128**-0.5, dq=dq, dk=dk, dv=dv, mask=mask
    )
    errs = [(dq - dq_r).abs().max().item(), (dk - dk_r.view(1, 2, 4, 1024, 128).sum(2)).abs().max().item(),
            (dv - dv_r.view(1, 2, 4, 1024, 128).sum(2)).abs().max().item()]
    bad = max(errs) > 0.05
    print(f"triton backward with a document mask: {'BAD' if bad else 'ok'} " + " ".join(f"{e:.2e}" for e in errs))
    return int(bad)


def check_accumulate() -> int:
    """The Triton backward adds into float32 buffers: strided halves of one, prefilled."""
    from weft.strategies.attention.kernels.triton_backward import backward_accumulate

    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    f32 = [q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)]
    ref = KERNELS["math"]
    # Query tail half against the key head half (a zigzag off-diagonal block), on slices.
    qs, ks, vs, ds = q[:, :, 512:], k[:, :, :512], v[:, :, :512], dout[:, :, 512:]
    out, lse = ref.forward(f32[0][:, :, 512:], f32[1][:, :, :512], f32[2][:, :, :512], causal=False, scale=128**-0.5)
    dq_r, dk_r, dv_r = ref.backward(
        ds.float(),
        f32[0][:, :, 512:],
        f32[1][:, :, :512],
        f32[2][:, :, :512],
        out,
        lse,
        causal=False,
        scale=128**-0.5,
    )
    dq, dk, dv = (
        torch.full(q.shape, 2.0, device="cuda"),
        torch.full(k.shape, 2.0, device="cuda"),
        torch.full(k.shape, 2.0, device="cuda"),
    )
    backward_accumulate(
        ds,
        qs,
        ks,
        vs,
        out.to(q.dtype),
        lse,
        causal=False,
        scale=128**-0.5,
        dq=dq[:, :, 512:],
        dk=dk[:, :, :512],
        dv=dv[:, :, :512],
    )
    errs = [
        (dq[:, :, 512:] - 2 - dq_r).abs().max().item(),
        (dk[:, :, :512] - 2 - dk_r.view(1, 2, 4, 512, 128).sum(2)).abs().max().item(),
        (dv[:, :, :512] - 2 - dv_r.view(1, 2, 4, 512, 128).sum(2)).abs().max().item(),
    ]
    untouched = bool((dq[:, :, :512] == 2).all() and (dk[:, :, 512:] == 2).all() and (dv[:, :, 512:] == 2).all())
    bad = max(errs) > 0.05 or not untouched
    print(
        f"triton accumulate into strided, prefilled buffers: {'BAD' if bad else 'ok'} untouched={untouched} "
        + " ".join(f"{e:.2e}" for e in errs)
    )

    return int(bad)


if __name__ == "__main__":
    raise SystemExit(main())
