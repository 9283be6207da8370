"""Each LSE block kernel on the GPU against the float32 math kernel: forward, LSE, backward.

    python3 benchmarks/kernels_check.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.strategies.block_kernels import KERNELS  # noqa: E402


def main() -> int:
    failures = 0
    reference = KERNELS["math"]
    for name in ("cudnn", "flash"):
        kernel = KERNELS[name]
        for causal, sq, sk, kv_heads in ((True, 512, 512, 4), (False, 512, 256, 4), (False, 256, 512, 4), (True, 512, 512, 2), (False, 512, 256, 1)):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(2, 4, sq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(2, kv_heads, sk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(2, kv_heads, sk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            dout = torch.randn(2, 4, sq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            try:
                out, lse = kernel.forward(q, k, v, causal=causal, scale=128**-0.5)
                grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=128**-0.5)
            except Exception as error:  # report every kernel, not just the first failure
                print(f"{name} causal={causal} {sq}x{sk}: FAILED {type(error).__name__}: {error}")
                failures += 1
                continue
            groups = 4 // kv_heads  # the math reference takes equal heads: expand, then sum the groups back
            f32 = [q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)]
            ref_out, ref_lse = reference.forward(*f32, causal=causal, scale=128**-0.5)
            dq_r, dk_r, dv_r = reference.backward(dout.float(), *f32, ref_out, ref_lse, causal=causal, scale=128**-0.5)
            ref_grads = (dq_r, dk_r.view(2, kv_heads, groups, sk, 128).sum(2), dv_r.view(2, kv_heads, groups, sk, 128).sum(2))
            errs = {
                "out": (out.float() - ref_out).abs().max().item(),
                "lse": (lse - ref_lse).abs().max().item(),
                **{n: (a.float() - b).abs().max().item() for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)},
            }
            bad = any(e > 0.05 for e in errs.values()) or lse.shape != ref_lse.shape
            failures += bad
            print(f"{name} causal={causal} {sq}x{sk} kv_heads={kv_heads}: lse {tuple(lse.shape)} {'BAD' if bad else 'ok'} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
