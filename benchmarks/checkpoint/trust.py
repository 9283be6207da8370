"""A real-size checkpoint read as data: Qwen2.5-VL-3B (random init of the real shapes, bf16 weights
and AdamW states, one H200) trained 2 steps at 8K with a checkpoint, then every reader of it:
``verify`` with and without the index/values check (its cost), ``--resume``, ``weft eval --run-dir``,
``weft generate --run-dir``, ``weft export``; then the newest checkpoint's index replaced by a pickle
that would touch a marker (the manifest rewritten to match): export, eval and generate refuse it
(exit 2) and ``--resume`` passes it over to the one before. One table, ``$OUT/checkpoint_trust.json``.

    python3 benchmarks/checkpoint/trust.py --out $OUT --work /tmp/trust   # weft importable (DEVELOPERS.md)

Disk: a checkpoint is ~22 GB (3.75B parameters x (2 + 2 + 2) bytes), the export 7.5 GB; at most
two checkpoints are on disk at once and the export is removed after it is checked.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import shutil
import subprocess
import sys
import time
import zlib

RECIPE = '''
[model]
preset = "{preset}"
[data]
source = "synthetic"
tokens = {tokens}
images = [[448, 448]]
num_samples = 8
[train]
max_steps = 2
micro_batch_tokens = {tokens}
lr = 1e-5
warmup_steps = 1
precision = "bf16"
loss = "fused"
checkpoint_every = 2
keep_checkpoints = 2
[parallel]
nproc = 1
[[rules]]
name = "bf16 storage, full recomputation"
shard = {{ strategy = "none", storage_dtype = "bfloat16", checkpoint = "full" }}
'''


class Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def weft(*args: str, cwd: pathlib.Path, timeout: int = 240) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, cwd=cwd,
                              timeout=timeout)
        rc, err, out = done.returncode, done.stderr, done.stdout
    except subprocess.TimeoutExpired as expired:
        rc, err, out = 124, str(expired.stderr or "")[-2000:], ""
    lines = [line for line in err.splitlines() if "weft:" in line or "resuming" in line]
    return {"args": " ".join(args[:2]), "rc": rc, "s": round(time.perf_counter() - start, 1),
            "said": [line[:400] for line in lines[-2:]], "result": _result(out),
            "tail": err[-800:] if rc not in (0, 2) else ""}


def _result(out: str):
    try:
        found = json.loads(out)
    except ValueError:
        return out[-300:]
    return {k: v for k, v in found.items() if not isinstance(v, (list, dict)) or k == "mesh"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/trust"))
    parser.add_argument("--preset", default="qwen2_5_vl_3b", help="qwen2_5_vl_tiny: the same on the CPU, in seconds")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    recipe, run = args.work / "3b-8k.toml", args.work / "run"
    text = RECIPE.format(preset=args.preset, tokens=args.tokens)
    recipe.write_text(text)
    table: dict = {"recipe": text}

    def save() -> None:
        (args.out / "checkpoint_trust.json").write_text(json.dumps(table, indent=1))

    table["train"] = weft("run", str(recipe), "--run-dir", str(run), cwd=args.work, timeout=300)
    save()
    step2 = run / "checkpoints" / "step-2"
    from weft.core.checkpoint import dcp_read
    from weft.core.run import checkpoint

    t = time.perf_counter()
    whole = checkpoint.verify(step2)
    t_verify = time.perf_counter() - t
    t = time.perf_counter()
    plain = dcp_read.plain_data(step2)
    t_plain = time.perf_counter() - t
    index = dcp_read.read_metadata(step2)
    table["verify"] = {"reason": whole, "verify_s": round(t_verify, 2), "plain_data_s": round(t_plain, 3),
                       "plain_reason": plain, "index_bytes": (step2 / ".metadata").stat().st_size,
                       "entries": len(index.state_dict_metadata),
                       "values": sum(type(m).__name__ == "BytesStorageMetadata"
                                     for m in index.state_dict_metadata.values()),
                       "checkpoint_gib": round(sum(p.stat().st_size for p in step2.iterdir()) / 2**30, 2)}
    save()
    table["export"] = weft("export", str(run), str(args.work / "export"), cwd=args.work, timeout=240)
    table["export"]["gib"] = round(sum(p.stat().st_size for p in (args.work / "export").glob("*")) / 2**30, 2) \
        if (args.work / "export").is_dir() else None
    shutil.rmtree(args.work / "export", ignore_errors=True)
    save()
    table["resume"] = weft("run", str(recipe), "--run-dir", str(run), "--resume", "--set", "train.max_steps=3",
                           cwd=args.work, timeout=300)
    save()
    table["eval"] = weft("eval", str(recipe), "--run-dir", str(run), "--max-batches", "2", "--json", cwd=args.work)
    table["generate"] = weft("generate", str(recipe), "--run-dir", str(run), "--prompt", "Describe the image.",
                             "--max-new-tokens", "4", "--json", cwd=args.work)
    save()
    marker = args.work / "code-ran"
    step3 = run / "checkpoints" / "step-3"
    (step3 / ".metadata").write_bytes(pickle.dumps(Planted(str(marker))))
    manifest = json.loads((step3 / "manifest.json").read_text())
    data = (step3 / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"size": len(data), "crc32": zlib.crc32(data)}
    (step3 / "manifest.json").write_text(json.dumps(manifest))
    table["planted"] = {
        "export": weft("export", str(run), str(args.work / "export2"), cwd=args.work),
        "eval": weft("eval", str(recipe), "--run-dir", str(run), "--max-batches", "1", cwd=args.work),
        "generate": weft("generate", str(recipe), "--run-dir", str(run), "--prompt", "hi", "--max-new-tokens", "2",
                         cwd=args.work)}
    save()
    table["planted"]["resume"] = weft("run", str(recipe), "--run-dir", str(run), "--resume", "--set",
                                      "train.max_steps=4", "--set", "train.checkpoint_every=-1", cwd=args.work,
                                      timeout=300)
    table["planted"]["marker_exists"] = marker.exists()
    for name in ("metrics.jsonl", "summary.json"):
        if (run / name).is_file():
            shutil.copy(run / name, args.out / name)
    save()
    print(json.dumps({k: (v if k != "recipe" else "...") for k, v in table.items()}, indent=1)[-6000:])


if __name__ == "__main__":
    main()
