"""Peak GPU memory and time of the next-token loss from the hidden states, lm_head included:
weft's fused linear + cross-entropy (no logits ever) vs lm_head then weft's chunked
cross-entropy over the materialised bf16 logits vs Liger's fused kernel (if installed).

    python3 benchmarks/memory/fused_loss.py --out $OUT

Hidden states (N, 3584) and lm_head weight (152064, 3584) bf16 as leaves, as in
Qwen2.5-VL-7B; forward + backward; peak = torch.cuda.max_memory_allocated() minus what
exists before (the hidden states and the weight), so it includes both gradients
(grad_hidden and grad_weight, reported as grads_gib), which every form must make.
At the smallest N the fused loss and gradients are compared with the materialised form's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.core.train.fused_loss import linear_cross_entropy_sum  # noqa: E402
from weft.core.train.loss import IGNORE, token_loss_sum  # noqa: E402


def fused(hidden, weight, target, chunk_bytes):
    return linear_cross_entropy_sum(hidden, weight, target, chunk_bytes=chunk_bytes)


def materialised(hidden, weight, target, chunk_bytes):
    logits = (hidden @ weight.T)[None]  # (1, N, V) bf16, what lm_head hands the loss today
    return token_loss_sum(logits, target[None], chunk_bytes=chunk_bytes)


def liger():
    """Liger's fused linear cross-entropy with its defaults (bf16 sum of grad_weight), or None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None

    def run(hidden, weight, target, chunk_bytes):
        out = liger_fused_linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE, reduction="sum")
        return out if isinstance(out, torch.Tensor) else out[0]  # some versions return (loss, z_loss)

    return run


def leaves(hidden, weight):
    return hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()


def measure(fn, hidden, weight, target, chunk_bytes, repeats):
    times, peak, value = [], 0, None
    for _ in range(repeats):
        h, w = leaves(hidden, weight)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = fn(h, w, target, chunk_bytes)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
        value = loss.item()
        del h, w, loss
    return {"peak_gib_over_inputs": peak / 2**30, "ms": 1e3 * min(times), "loss": value}


def compare(fn, ref, hidden, weight, target, chunk_bytes):
    """Relative error (max |a - b| / max |b|) of fn's loss and gradients against ref's."""
    out = []
    for f in (fn, ref):
        h, w = leaves(hidden, weight)
        loss = f(h, w, target, chunk_bytes)
        loss.backward()
        out.append((loss.detach().float(), h.grad.float(), w.grad.float()))
        del h, w, loss
    (a_loss, a_h, a_w), (b_loss, b_h, b_w) = out
    return {"loss": rel(a_loss, b_loss), "grad_hidden": rel(a_h, b_h), "grad_weight": rel(a_w, b_w)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def cell(result) -> str:
    if isinstance(result, str):
        return result
    return f"{result['peak_gib_over_inputs']:.2f} GiB, {result['ms']:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", default="16384,32768,65536,131072")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--chunk-mib", type=int, default=512, help="float32 MiB of logits per chunk")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    chunk_bytes = args.chunk_mib << 20
    forms = {"weft fused": fused, "weft chunked over logits": materialised}
    if (liger_fn := liger()) is not None:
        forms["liger fused"] = liger_fn
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).to(torch.bfloat16)
    rows, check = [], {}
    for n in (int(s) for s in args.tokens.split(",")):
        hidden = torch.randn(n, args.hidden, device="cuda").to(torch.bfloat16)  # logits of std ~1.2
        target = torch.randint(0, args.vocab, (n,), device="cuda")
        target[: n // 4] = IGNORE  # prompt tokens
        row = {"tokens": n, "vocab": args.vocab, "hidden": args.hidden, "logits_bf16_gib": n * args.vocab * 2 / 2**30,
               "grads_gib": (n + args.vocab) * args.hidden * 2 / 2**30}
        if not check:
            for name in forms:
                if name != "weft chunked over logits":
                    try:
                        check[name] = compare(forms[name], materialised, hidden, weight, target, chunk_bytes)
                    except torch.OutOfMemoryError:
                        check[name] = "OOM"
                    torch.cuda.empty_cache()
            check["tokens"] = n
            print(json.dumps({"relative_error_vs_chunked_over_logits": check}), flush=True)
        for name, fn in forms.items():
            try:
                row[name] = measure(fn, hidden, weight, target, chunk_bytes, args.repeats)
            except torch.OutOfMemoryError:
                row[name] = "OOM"
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del hidden, target
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "chunk_mib": args.chunk_mib}
    (args.out / "fused_loss.json").write_text(
        json.dumps({**meta, "relative_error_vs_chunked_over_logits": check, "rows": rows}, indent=1)
    )
    lines = [
        f"Loss forward + backward from bf16 hidden (N, {args.hidden}) and lm_head ({args.vocab}, {args.hidden}) "
        f"on {meta['device']}, torch {meta['torch']}: peak memory over the inputs (gradients included), best time.",
        "",
        "| tokens | bf16 logits | grads | " + " | ".join(forms) + " |",
        "|---:|---:|---:|" + "---:|" * len(forms),
    ]
    for row in rows:
        lines.append(f"| {row['tokens']} | {row['logits_bf16_gib']:.1f} GiB | {row['grads_gib']:.2f} GiB | "
                     + " | ".join(cell(row[name]) for name in forms) + " |")
    lines += ["", f"Relative error against the chunked loss over materialised logits at {check['tokens']} tokens:", ""]
    lines += [f"- {name}: {json.dumps(err)}" for name, err in check.items() if name != "tokens"]
    (args.out / "fused_loss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
