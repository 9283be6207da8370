"""A fine-tune as a user runs one, on one GPU: a Hugging Face directory -> `weft run` at
lr 1e-5 -> checkpoint -> `weft export` -> transformers loads it; its loss equals `weft eval`'s.

    python3 benchmarks/learning/finetune_flow.py --out $OUT          # Qwen2.5-VL-3B shapes, 3 steps at 8K tokens

1. A Qwen2.5-VL-3B-shaped directory written with ``save_pretrained`` (random init, bf16,
   sharded safetensors with their index) plus processor files: an image processor with
   Qwen2.5-VL's settings and the bundled tokenizer (weft's tiny one: the data here is
   synthetic; what is tested is the path, not the text).
2. `weft run` of it at lr 1e-5, bf16 storage, the default optimizer (adamw_sr): the
   ``update`` guard reports and does not warn; a checkpoint at the end.
3. The same with round-to-nearest forced (``train.optimizer = "adamw"``): the guard warns.
4. `weft export` of the first run; transformers' ``from_pretrained`` loads it; the share of
   weights that moved, for both runs; its loss over the recipe's samples (bf16, SDPA)
   beside `weft eval`'s on the exported directory.
Writes flow.json; prints each stage's result.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMAGE_PROCESSOR = {  # Qwen2.5-VL's preprocessor_config.json values
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056, "min_pixels": 3136, "merge_size": 2,
    "patch_size": 14, "resample": 3, "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2,
    "size": {"longest_edge": 12845056, "shortest_edge": 3136},
}

RECIPE = """
[model]
path = "{path}"
[data]
source = "synthetic"
tokens = {tokens}
images = [[448, 448]]
num_samples = 8
[train]
max_steps = {steps}
micro_batch_tokens = {tokens}
lr = 1e-5
warmup_steps = 0
precision = "bf16"
loss = "fused"
checkpoint_every = 0
keep_checkpoints = 1
[parallel]
nproc = 1
[[rules]]
shard = {{ strategy = "none", storage_dtype = "bfloat16", checkpoint = "full" }}
"""


def weft(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, cwd=cwd)
    print(f"weft {' '.join(args)} -> {done.returncode}", flush=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], flush=True)
    return done


def make_directory(folder: pathlib.Path, preset: str, device: str) -> None:
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    recipe = Recipe.from_dict({"model": {"preset": preset}})
    model = build_plugin_manager(entry_points=False).models.for_recipe(recipe).build(recipe, device=device, seed=0)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="2GB")
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "recipes" / "tiny_vl" / name, folder / name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def guard_events(run_dir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("event", "step", "below_half_step", "rounding", "lr") if k in r}
            for r in rows if str(r.get("event", "")).startswith("guard.update")]


def moved_share(before: pathlib.Path, after: pathlib.Path) -> float:
    from safetensors.torch import load_file

    changed = total = 0
    old = {}
    for file in sorted(before.glob("*.safetensors")):
        old.update(load_file(file))
    for file in sorted(after.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name in old and old[name].shape == tensor.shape:
                changed += int((old[name] != tensor.to(old[name].dtype)).sum())
                total += tensor.numel()
    return changed / max(total, 1)


def transformers_loss(recipe_path: pathlib.Path, export: pathlib.Path, device: str) -> tuple[float, int]:
    """The exported model as transformers loads it, over the recipe's samples: the mean token loss."""
    import structlog
    from transformers import AutoModelForImageTextToText

    from weft.core.context import RunContext
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.plugins.batching.samples import bad_sample_handler, collect_samples, pad_id_of, sample_source
    from weft.strategies.data.conversation import collate

    recipe = Recipe.from_toml(recipe_path, overrides=(f"model.path={export}",))
    family = build_plugin_manager(entry_points=False).models.for_recipe(recipe)
    ctx = RunContext(recipe=recipe, device=torch.device(device), log=structlog.get_logger())
    tokenizer, source = sample_source(recipe, family)
    samples = collect_samples(recipe, source, on_bad=bad_sample_handler(recipe, ctx))
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to(device).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            batch = {k: v.to(device) for k, v in collate([sample], pad_id=pad_id_of(tokenizer, model.config)).items()
                     if isinstance(v, torch.Tensor)}
            labels = batch["labels"]
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(**batch).loss.float()) * n
            count += n
    return total / count, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/flow"))
    parser.add_argument("--preset", default="qwen2_5_vl_3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: the same path with a tiny preset, to try it here")
    args = parser.parse_args()
    work, result = args.work, {}
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    make_directory(work / "hf", args.preset, args.device)
    result["directory"] = sorted(p.name for p in (work / "hf").iterdir())
    result["directory_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result), flush=True)
    recipe = work / "ft.toml"
    recipe.write_text(RECIPE.format(path=work / "hf", tokens=args.tokens, steps=args.steps))
    for name, extra in (("run", ()), ("rtn", ("--set", "train.optimizer=adamw", "--set", "train.checkpoint_every=-1"))):
        done = weft("run", str(recipe), "--run-dir", str(work / name), *extra, cwd=work)
        result[name] = {"returncode": done.returncode, "guard": guard_events(work / name) if done.returncode == 0
                        else done.stderr[-2000:]}
        if done.returncode == 0:
            rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
            result[name]["losses"] = [r["loss"] for r in rows]
            result[name]["max_memory_gib"] = max(r.get("max_memory_gib", 0) for r in rows)
        print(json.dumps({name: result[name]}), flush=True)
    done = weft("export", str(work / "run"), str(work / "export"), cwd=work)
    result["export"] = sorted(p.name for p in (work / "export").iterdir()) if done.returncode == 0 else done.stderr
    if done.returncode == 0:
        result["moved_share"] = round(moved_share(work / "hf", work / "export"), 4)
        loss, count = transformers_loss(recipe, work / "export", args.device)
        result["transformers_loss"], result["label_tokens"] = loss, count
        done = weft("eval", str(recipe), "--set", f"model.path={work / 'export'}", "--json", cwd=work)
        if done.returncode == 0:
            evaluated = json.loads(done.stdout)
            result["weft_eval_loss"] = evaluated["loss"]
            result["weft_eval_label_tokens"] = evaluated["label_tokens"]
            result["relative_difference"] = abs(evaluated["loss"] - loss) / loss
    print(json.dumps(result, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flow.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
