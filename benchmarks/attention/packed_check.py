"""Packed documents on the GPU: weft's document-masked attention (cuDNN with a bias)
against SDPA run on each document alone, in bf16 and float32.

One rank (a one-rank ring: one block with the document mask), three documents of
uneven lengths, GQA 8/2, head_dim 128. Prints torch's CP tolerance ratio (atol
8e-3, rtol 1e-3 at one rank; <= 1 passes) and the largest absolute errors of
out, dq, dk, dv against float32, next to bf16 SDPA's own.

    python3 benchmarks/attention/packed_check.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ring_emulated import tolerance_ratio  # noqa: E402
from weft.strategies.attention.ring import ring_attention  # noqa: E402

LENGTHS = (1000, 2500, 596)


def per_document(q, k, v, dout, dtype):
    """SDPA on each document alone, concatenated: the reference for packing."""
    qr, kr, vr = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    outs, start = [], 0
    for n in LENGTHS:
        part = slice(start, start + n)
        start += n
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qr[:, :, part], kr[:, :, part], vr[:, :, part], is_causal=True, enable_gqa=True
            )
        )
    out = torch.cat(outs, dim=2)
    out.backward(dout.to(dtype))
    return [t.detach().float() for t in (out, qr.grad, kr.grad, vr.grad)]


def report(name, got, ref_bf16, ref_fp32):
    errors = [round(float((a - b).abs().max()), 4) for a, b in zip(got, ref_fp32)]
    print(f"{name}: vs bf16 per-document SDPA "
          f"{max(tolerance_ratio(a, b, world=1) for a, b in zip(got, ref_bf16)):.3f}, "
          f"vs float32 {max(tolerance_ratio(a, b, world=1) for a, b in zip(got, ref_fp32)):.3f}, "
          f"max abs error vs float32 (out, dq, dk, dv) {errors}", flush=True)


def main() -> None:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.manual_seed(0)
    seq = sum(LENGTHS)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)]).cuda()[None]  # (1, S)
    q = torch.randn(1, 8, seq, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    ref_bf16, ref_fp32 = per_document(q, k, v, dout, torch.bfloat16), per_document(q, k, v, dout, torch.float32)
    for backend in ("auto", "cudnn", "triton"):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(qr, kr, vr, causal=True, backend=backend, doc_ids=doc_ids)
        out.backward(dout)
        report(
            f"packed, backend {backend}",
            [t.detach().float() for t in (out, qr.grad, kr.grad, vr.grad)],
            ref_bf16,
            ref_fp32,
        )

    report("baseline: bf16 per-document SDPA", ref_bf16, ref_bf16, ref_fp32)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
