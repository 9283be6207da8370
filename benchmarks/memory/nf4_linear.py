"""A frozen NF4 base linear (torchao) against bf16, at Qwen2.5-VL-72B's MLP shapes, on one GPU.

    python3 benchmarks/memory/nf4_linear.py --out $OUT [--tokens 32768]

Per shape: bytes of the stored weight, forward and input-gradient time (the base is frozen:
no weight gradient), the largest error of the NF4 product against the bf16 one, and
whether PEFT's LoRA wraps a linear whose weight is an NF4 tensor (forward and backward).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch


def timed(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    rows = []
    for out_f, in_f in ((29568, 8192), (8192, 29568), (8192, 8192)):
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(args.tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        q = to_nf4(w, 64, 256)
        torch.cuda.synchronize()
        nf4_bytes = torch.cuda.memory_allocated() - before
        gy = torch.randn(args.tokens, out_f, device="cuda", dtype=torch.bfloat16)

        def bf16_step():
            x.grad = None
            torch.nn.functional.linear(x, w).backward(gy)

        def nf4_step():
            x.grad = None
            linear_nf4(x, q).backward(gy)

        def nf4_functional():
            x.grad = None
            torch.nn.functional.linear(x, q).backward(gy)

        torch.cuda.reset_peak_memory_stats()
        t_nf4 = timed(nf4_step)
        peak_nf4 = torch.cuda.max_memory_allocated() / 2**30
        try:
            t_fn = timed(nf4_functional)
        except Exception as error:  # noqa: BLE001 - reported, the row still useful
            t_fn = repr(error)[:200]
        t_bf16 = timed(bf16_step)
        err = (linear_nf4(x, q) - torch.nn.functional.linear(x, w)).abs().max().item()
        rows.append({"shape": [out_f, in_f], "bf16_bytes": w.numel() * 2, "nf4_bytes": nf4_bytes,
                     "bf16_s": t_bf16, "nf4_s": t_nf4, "F.linear_on_nf4_s": t_fn, "peak_gib_nf4": peak_nf4,
                     "max_abs_err": err})
        print(rows[-1], flush=True)
        w = q = x = gy = None  # freed before the next shape
        torch.cuda.empty_cache()

    # PEFT over a linear whose weight is an NF4 tensor
    peft_row = {}
    try:
        import peft

        lin = torch.nn.Linear(8192, 8192, bias=False, device="cuda", dtype=torch.bfloat16)
        lin.weight = torch.nn.Parameter(to_nf4(lin.weight.detach(), 64, 256), requires_grad=False)
        model = torch.nn.Sequential(lin)
        cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["0"])
        model = peft.inject_adapter_in_model(cfg, model)
        x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = model(x)
        y.float().square().mean().backward()
        peft_row = {"peft": peft.__version__, "type": type(model[0]).__name__,
                    "lora_B_grad": model[0].lora_B["default"].weight.grad is not None, "x_grad": x.grad is not None}
    except Exception as error:  # noqa: BLE001
        peft_row = {"error": repr(error)[:400]}
    print(peft_row, flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nf4_linear.json").write_text(json.dumps({"rows": rows, "peft": peft_row}, indent=1))


if __name__ == "__main__":
    main()
