"""A recomputed MLP by hand against torch's checkpoint of a compiled one, on one GPU: the same
gradients within bf16's own error, the time and the memory of each, at the 7B's widths.

    python3 benchmarks/step/mlp_by_hand.py --out $OUT [--lengths 32768 131072]

One Qwen2 MLP (hidden 3,584, intermediate 18,944, bf16 weights), x (1, L, 3584) bf16, a random
output gradient; each way runs forward and backward (three warm-up passes, then five timed):
- ``checkpoint``: torch's composable checkpoint over the MLP, the MLP compiled (the bundled 32K
  recipe's ``checkpoint = "mlp"`` before weft made it by hand; under "full" and "except_attention"
  a layer's recomputation ran the same compiled forward again);
- ``by_hand``: weft's TiledMLP with one whole-sequence tile (strategies/memory/swiglu.py), its
  element-wise kernels compiled;
- ``kept``: the compiled MLP, nothing recomputed (the floor: no product made again).
Each is compared with the float32 module's output and gradients (relative error of the
gradients' max); the products each makes (FLOPs counted by arithmetic) and its time give TFLOP/s.
Writes ``mlp_by_hand.md`` and ``.json`` under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402
from torch.distributed._composable import checkpoint  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP  # noqa: E402

from weft.strategies.memory.tiled_mlp import TiledMLP  # noqa: E402

HIDDEN, INTER = 3584, 18944


def build(way: str, reference: Qwen2MLP, device: str) -> torch.nn.Module:
    mlp = copy.deepcopy(reference).to(device, torch.bfloat16)
    if way == "checkpoint":
        checkpoint(mlp)
        mlp.compile()
    elif way == "by_hand":
        TiledMLP(tile_tokens=None, compile=True).attach([mlp])
    else:
        mlp.compile()
    return mlp


def pass_once(mlp, x, dy):
    xi = x.detach().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    mlp(xi).backward(dy)
    return xi.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--widths", type=int, nargs=2, default=[HIDDEN, INTER], help="hidden, intermediate")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script itself (small --widths)")
    args = parser.parse_args()
    hidden, inter, device = *args.widths, args.device
    cuda = device == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    reference = Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu"))
    rows = []
    for length in args.lengths:
        g = torch.Generator(device=device).manual_seed(length)
        x = torch.randn(1, length, hidden, device=device, dtype=torch.bfloat16, generator=g)
        dy = torch.randn(1, length, hidden, device=device, dtype=torch.bfloat16, generator=g) * 1e-2
        ref = copy.deepcopy(reference).to(device, torch.float32)
        xr = x.float().requires_grad_(True)
        ref(xr).backward(dy.float())
        ref_grads = {"x": xr.grad, **{n: p.grad for n, p in ref.named_parameters()}}
        del xr, ref
        if cuda:
            torch.cuda.empty_cache()
        for way in ("kept", "checkpoint", "by_hand"):
            mlp = build(way, reference, device)
            for _ in range(3):
                pass_once(mlp, x, dy)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            begin = time.perf_counter()
            for _ in range(5):
                dx = pass_once(mlp, x, dy)
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - begin) * 1e3 / 5
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
            grads = {"x": dx, **{n: p.grad for n, p in mlp.named_parameters()}}
            errors = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}
            products = {"kept": 9, "checkpoint": 12, "by_hand": 11}[way]  # each 2 L H I FLOPs
            flops = products * 2 * length * hidden * inter
            rows.append({"tokens": length, "way": way, "ms": round(ms, 2), "peak_gib": round(peak, 2),
                         "tflops": round(flops / ms / 1e9, 1), "max_rel_error": errors})
            print(json.dumps(rows[-1]), flush=True)
            del mlp, grads, dx
            if cuda:
                torch.cuda.empty_cache()
    (args.out / "mlp_by_hand.json").write_text(json.dumps(rows, indent=1))
    lines = ["| tokens | way | ms (fwd+bwd) | peak GiB beyond inputs | TFLOP/s | rel. error dx / gate / up / down |",
             "| ---: | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        e = r["max_rel_error"]
        lines.append(f"| {r['tokens']:,} | {r['way']} | {r['ms']} | {r['peak_gib']} | {r['tflops']} | "
                     f"{e['x']:.2e} / {e['gate_proj.weight']:.2e} / {e['up_proj.weight']:.2e} / "
                     f"{e['down_proj.weight']:.2e} |")
    name = torch.cuda.get_device_name() if cuda else device
    (args.out / "mlp_by_hand.md").write_text(name + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
