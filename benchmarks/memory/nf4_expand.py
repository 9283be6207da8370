"""An NF4 weight expanded to bf16: torchao's ``get_original_weight`` against weft's one-kernel
``expanded`` (strategies/model/quantize.py), at Qwen2.5-VL-72B's shapes, on one GPU.

    python3 benchmarks/memory/nf4_expand.py --out $OUT

Per shape: whether the two agree bit for bit, each one's time, and the GB/s of weft's
(the 4-bit codes and scalers read, the bf16 weight written). Then one forward pass of a 72B
SwiGLU MLP with 4-bit weights over 8 tiles of 16,384 tokens, as the tiled MLP ran it before
(torchao's product, expanding the three weights per tile) and as it runs it now (the three
expanded once, then bf16 products).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from nf4_linear import timed  # the script beside this one (its folder is on sys.path)
from weft.strategies.model.quantize import expanded, stored_bytes, to_nf4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for out_f, in_f in ((29568, 8192), (8192, 29568), (8192, 8192), (1024, 8192)):
        weight = to_nf4(torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02)
        same = torch.equal(expanded(weight), weight.get_original_weight())
        torchao_s, weft_s = timed(weight.get_original_weight), timed(lambda: expanded(weight))
        moved = stored_bytes(weight) + out_f * in_f * 2
        rows.append({"shape": [out_f, in_f], "bit_identical": same, "torchao_ms": torchao_s * 1e3,
                     "weft_ms": weft_s * 1e3, "weft_GBps": moved / weft_s / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    mlp = mlp_pass()
    print(json.dumps(mlp), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nf4_expand.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                                     "mlp_pass": mlp}, indent=1))


def mlp_pass(*, hidden: int = 8192, inter: int = 29568, tile: int = 16384, tiles: int = 8) -> dict:
    """Seconds of one tiled forward of the MLP: torchao's per-tile expansion against once a pass."""
    import torch.nn.functional as F

    gate, up, down = (to_nf4(torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02)
                      for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
    x = torch.randn(tile, hidden, device="cuda", dtype=torch.bfloat16)

    def swiglu(g, u, d):
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

    def per_tile():  # torchao's __torch_function__: each product expands its weight
        for _ in range(tiles):
            swiglu(gate, up, down)

    def once():
        weights = [expanded(w) for w in (gate, up, down)]
        for _ in range(tiles):
            swiglu(*weights)

    with torch.no_grad():
        same = torch.equal(swiglu(gate, up, down), swiglu(*(expanded(w) for w in (gate, up, down))))
        torchao_s, weft_s = timed(per_tile, iters=3), timed(once, iters=3)
    return {"tokens": tile * tiles, "bit_identical": same, "per_tile_s": torchao_s, "once_s": weft_s}


if __name__ == "__main__":
    main()
