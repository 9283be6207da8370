"""Peak GPU memory and time of the next-token loss over bf16 logits: weft's chunked
float32 cross-entropy vs torch's whole-tensor form (F.cross_entropy(logits.float())).

    python3 benchmarks/memory/loss_memory.py --out $OUT

Logits (1, S, V) bf16 as a leaf (what lm_head hands the loss); forward + backward;
peak = torch.cuda.max_memory_allocated() minus the logits themselves.
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
import torch.nn.functional as F  # noqa: E402

from weft.core.train.loss import IGNORE, token_loss_sum  # noqa: E402


def whole(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="sum")


def measure(fn, logits, target, repeats=3):
    times = []
    for _ in range(repeats):
        x = logits.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = fn(x, target)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base
        value = loss.item()
        del x, loss
    return {"peak_gib_over_logits": peak / 2**30, "ms": 1e3 * min(times), "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seqs", default="8192,16384,32768")
    parser.add_argument("--vocab", type=int, default=152064)
    args = parser.parse_args()
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        torch.manual_seed(0)
        logits = (torch.randn(1, seq, args.vocab, device="cuda") * 2).to(torch.bfloat16)
        target = torch.randint(0, args.vocab, (1, seq), device="cuda")
        target[0, : seq // 4] = IGNORE
        size = logits.numel() * 2 / 2**30
        row = {"seq": seq, "vocab": args.vocab, "logits_gib": size}
        for name, fn in (("weft chunked", token_loss_sum), ("torch whole", whole)):
            try:
                row[name] = measure(fn, logits, target)
            except torch.OutOfMemoryError:
                row[name] = "OOM"
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del logits
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_memory.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1)
    )



if __name__ == "__main__":
    main()
