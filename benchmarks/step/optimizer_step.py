"""One optimizer step of Qwen2.5-VL-7B's 8.3B bf16 parameters on one GPU, per optimizer.

    python3 benchmarks/step/optimizer_step.py --out $OUT            # adamw, adamw_sr, adamw_sr + float32 moments
    python3 benchmarks/step/optimizer_step.py --out $OUT --optimizers adamw_8bit,adamw_sr   # torchao's 8-bit states

For each optimizer: the step's time (CUDA events, mean of 5 steps after 2 warm-up steps),
its peak memory above what the weights, gradients and states hold (the step's own
temporaries), the states' size, and — at lr 1e-5 on weights ~ N(0, 0.02), the model's
init — the share of weights that changed at all over those 7 steps. Gradients are
random (~N(0, 1e-3)), the same for each optimizer. Writes optimizer.json and prints a
markdown table.
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


def shapes(preset: str) -> list[tuple[int, ...]]:
    """Every parameter shape of the preset's model (built on the meta device)."""
    import transformers

    from weft.core.recipe.presets import build_config, load_preset

    config = build_config(*load_preset(preset)[:2])
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    return [tuple(p.shape) for p in model.parameters()]


def make(name: str, params: list[torch.nn.Parameter], lr: float):
    from weft.strategies.optim.adamw_sr import AdamWSR

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    if name == "adamw_sr":
        return AdamWSR(params, lr=lr, betas=(0.9, 0.95))
    if name == "adamw_sr_fp32_states":
        return AdamWSR(params, lr=lr, betas=(0.9, 0.95), state_dtype="float32")
    if name == "adamw_8bit":  # the plugin's own maker: torchao's AdamW8bit, bf16 stochastic rounding
        from weft.plugins.optimizer import _adamw_8bit

        return _adamw_8bit([{"params": params, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    raise ValueError(name)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a state tensor holds on the GPU; a tensor subclass (torchao's 8-bit state) by
    its inner tensors, since its numel is the logical size."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size() if t.device.type == "cuda" else 0


def measure(name: str, shape_list: list[tuple[int, ...]], *, lr: float, seed: int) -> dict:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shape_list]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    start = [p.detach().clone() for p in params[:40]]  # a sample of tensors for the changed share
    optimizer = make(name, params, lr)
    optimizer.step()  # makes the states, compiles nothing (Triton's first launch compiles)
    optimizer.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    peak_extra = (torch.cuda.max_memory_allocated() - held) / 2**30
    states = sum(tensor_bytes(t) for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)) / 2**30
    changed = sum(int((a != b).sum()) for a, b in zip(params[:40], start)) / sum(t.numel() for t in start)
    row = {"optimizer": name, "parameters": sum(p.numel() for p in params), "step_s": sum(times) / len(times),
           "step_s_min": min(times), "peak_above_state_gib": round(peak_extra, 3), "states_gib": round(states, 2),
           "changed_after_7_steps": round(changed, 4), "lr": lr}
    del optimizer, params, start
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--preset", default="qwen2_5_vl_7b")
    parser.add_argument("--optimizers", default="adamw,adamw_sr,adamw_sr_fp32_states")
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    shape_list = shapes(args.preset)
    rows = []
    for name in args.optimizers.split(","):
        t0 = time.perf_counter()
        rows.append(measure(name, shape_list, lr=args.lr, seed=0))
        print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                        indent=1))
    print("| optimizer | parameters | step (s) | peak above states (GiB) | states (GiB) | changed after 7 steps "
          f"at lr {args.lr:g} |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['optimizer']} | {r['parameters'] / 1e9:.2f}B | {r['step_s']:.3f} | {r['peak_above_state_gib']} "
              f"| {r['states_gib']} | {100 * r['changed_after_7_steps']:.1f}% |")


if __name__ == "__main__":
    main()
