"""A run's host memory and time to its first step by the dataset's size (issue 42).

Writes JSONL datasets of N short conversations (an image on every tenth, drawn from a pool of
``--pool`` PNG files), then for each: a cold one-step ``weft run`` that preprocesses it into
the store (timed; with ``--interrupt`` the largest's first start is stopped half-way and the
second resumes it), and a warm ``weft run`` of the tiny
Qwen2.5-VL on ``--nproc`` ranks for a few steps: the seconds from the run's start to its
first step, rank 0's peak host memory (the log's ``host_max_gib``) and the largest resident
set of any process of the run (GNU time's %M over the launcher and its ranks).

    python3 benchmarks/data/run_start.py --out $OUT [--sizes 1000,1000000] [--nproc 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

from PIL import Image

WORDS = "the a image shows colour shape left right above below large small red blue green square".split()


def make_dataset(root: pathlib.Path, *, samples: int, pool: int, seed: int = 0) -> pathlib.Path:
    rng = random.Random(seed)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    for i in range(pool):
        if not (images / f"{i}.png").exists():
            Image.new("RGB", (56 * rng.randint(1, 3), 56 * rng.randint(1, 3)),
                      tuple(rng.randint(0, 255) for _ in range(3))).save(images / f"{i}.png")
    path = root / f"train-{samples}.jsonl"
    if path.exists():  # the same seed writes the same file: keep it, and the store made from it
        return path
    with path.open("w") as out:
        for n in range(samples):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
            record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            if n % 10 == 0:
                record["messages"][0]["content"] = "<image>" + question
                record["images"] = [f"images/{rng.randrange(pool)}.png"]
            out.write(json.dumps(record) + "\n")
    return path


def recipe(root: pathlib.Path, data: pathlib.Path, *, nproc: int) -> pathlib.Path:
    path = root / f"{data.stem}.toml"
    path.write_text(f'''
[model]
preset = "qwen2_5_vl_tiny"
[data]
source = "jsonl"
path = "{data.name}"
[train]
max_steps = 5
micro_batch_tokens = 2048
checkpoint_every = 0
log_every = 1
[parallel]
nproc = {nproc}
''')
    return path


def _stamp(line: dict) -> float:
    return datetime.datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def run(root: pathlib.Path, toml: pathlib.Path, *, nproc: int) -> dict:
    run_dir = root / f"run-{toml.stem}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a log of an earlier run there would be read as this one's
    start = time.perf_counter()
    peak = root / f"{toml.stem}.maxrss"
    # GNU time's %M: the largest resident set of any one process of the run (a rank, or the launcher).
    done = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(peak), sys.executable, "-m", "weft", "run",
                           str(toml), "--run-dir", str(run_dir), "--nproc", str(nproc)],
                          capture_output=True, text=True, cwd=root)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    began = min(_stamp(e) for e in log if e.get("event") == "run.start")
    first = min(_stamp(e) for e in log if e.get("event") == "step.end")
    hosts = {}
    for e in log:
        if "host_max_gib" in e:
            hosts[e.get("rank", 0)] = max(hosts.get(e.get("rank", 0), 0), e["host_max_gib"])
    return {"wall_s": round(wall, 1), "first_step_after_start_s": round(first - began, 2),
            "host_max_gib_by_rank": {k: round(v, 3) for k, v in sorted(hosts.items())},
            "largest_process_gib": round(int(peak.read_text().split()[-1]) / 2**20, 3)}


def preprocess(root: pathlib.Path, toml: pathlib.Path, data: pathlib.Path, *, nproc: int, interrupt: bool,
               samples: int) -> dict:
    """The store made by the run's own start (one step, cold); with ``interrupt`` a first start
    is stopped (SIGTERM) once half its shards (4,096 samples each) are written and the second
    resumes it."""
    command = [sys.executable, "-m", "weft", "run", str(toml), "--run-dir", str(root / f"cold-{toml.stem}"),
               "--nproc", str(nproc), "--set", "train.max_steps=1"]
    folder = data.with_name(data.name + ".weft-cache")
    out = {}
    if interrupt:
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
        start = time.perf_counter()
        while first.poll() is None:
            time.sleep(1)
            if len(list(folder.glob("shards-*/shard-*.json"))) >= max(1, samples // 4096 // 2):
                first.send_signal(signal.SIGTERM)
                first.wait()
        out["interrupted_after_s"] = round(time.perf_counter() - start, 1)
        out["shards_before_interrupt"] = len(list(folder.glob("shards-*/shard-*.json")))
    start = time.perf_counter()
    if interrupt:  # a new run over the same data (the stopped one left no checkpoint): its store resumes
        command[command.index("--run-dir") + 1] += "-again"
    shutil.rmtree(command[command.index("--run-dir") + 1], ignore_errors=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=root)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    out["cold_start_and_one_step_s"] = round(time.perf_counter() - start, 1)
    log = (root / command[command.index("--run-dir") + 1] / "log.jsonl").read_text()
    out["resumed_preprocessing"] = "data.preprocess_resumed" in log
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--sizes", default="1000,1000000")
    parser.add_argument("--pool", type=int, default=2000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--interrupt", action="store_true", help="kill the largest size's first preprocessing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        start = time.perf_counter()
        data = make_dataset(args.out, samples=size, pool=args.pool)
        row = {"samples_written": size, "write_s": round(time.perf_counter() - start, 1),
               **preprocess(args.out, toml := recipe(args.out, data, nproc=args.nproc), data, nproc=args.nproc,
                            interrupt=args.interrupt and size == max(sizes), samples=size),
               **run(args.out, toml, nproc=args.nproc)}
        store = next(data.with_name(data.name + ".weft-cache").glob("shards-*"))
        row["store_mib"] = round(sum(p.stat().st_size for p in store.iterdir()) / 2**20)
        row["shards"] = len(list(store.glob("shard-*.safetensors")))
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "data_million.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
