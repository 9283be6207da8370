"""Host memory and start time of a preprocessed store (strategies/data/shards.py) by its size.

Writes stores of N samples each (text samples of ``--tokens`` ids, every 16th with a
``--patches``-patch image: the tensors a real sample holds), then, in a fresh process per
store, measures what a rank pays: the seconds to open the store (its sidecars), the resident
memory after opening and after reading ``--reads`` random samples as the batching would,
against the store's size on disk. A rank's memory should not grow with N.

    python3 benchmarks/data/store.py --out $OUT [--sizes 10000,100000,1000000]

The samples are made directly (no tokenizer: this measures the store, not preprocessing,
which benchmarks/data/preprocess.py measures).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()


def _samples(count: int, *, tokens: int, patches: int):
    import torch

    from weft.strategies.data.conversation import Sample

    ids = torch.arange(tokens) % 300  # the same tensors each time: the writer's time, not torch's
    image_ids = ids.clone()
    image_ids[: patches // 4] = 318
    types = torch.zeros(tokens, dtype=torch.long)
    types[: patches // 4] = 1
    pixels = torch.rand(patches, 1176)
    grid = torch.tensor([[1, 2, patches // 2]])
    for n in range(count):
        if n % 16 == 0:
            yield f"synthetic:{n + 1}", Sample(input_ids=image_ids, labels=image_ids, pixel_values=pixels,
                                               image_grid_thw=grid, mm_token_type_ids=types)
        else:
            yield f"synthetic:{n + 1}", Sample(input_ids=ids, labels=ids)


def _rss_mib() -> dict[str, float]:
    """Resident memory: the process's own (anonymous) and the mapped shards' pages (file-backed:
    the kernel's page cache, shared by the ranks and given back under pressure)."""
    status = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines())
    return {key: round(int(status[key].split()[0]) / 1024, 1) for key in ("RssAnon", "RssFile")}


def _measure(folder: str, reads: int) -> None:
    """One rank's view (run in a fresh process): open, then read ``reads`` random samples."""
    from weft.strategies.data.shards import SampleStore

    before = _rss_mib()
    start = time.perf_counter()
    store = SampleStore(pathlib.Path(folder))
    opened = time.perf_counter() - start
    after_open = _rss_mib()
    rng = random.Random(0)
    start = time.perf_counter()
    for _ in range(reads):
        sample = store[rng.randrange(len(store))]
        _ = sample.input_ids.sum().item()  # touch the tensors, as a collate does
        if sample.pixel_values is not None:
            _ = sample.pixel_values[:, 0].sum().item()
    read = time.perf_counter() - start
    after = _rss_mib()
    print(json.dumps({"samples": len(store), "open_s": round(opened, 3), "anon_mib_before": before["RssAnon"],
                      "anon_mib_open": after_open["RssAnon"], "anon_mib_after_reads": after["RssAnon"],
                      "file_mib_after_reads": after["RssFile"], "reads_per_s": round(reads / read)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--patches", type=int, default=16)
    parser.add_argument("--reads", type=int, default=5000)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure, args.reads)
        return 0
    from weft.strategies.data import shards

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        folder = args.out / f"store-{size}"
        start = time.perf_counter()
        shards.build(folder, lines=iter(()),
                     encode=lambda _jobs, size=size: _samples(size, tokens=args.tokens, patches=args.patches))
        written = time.perf_counter() - start
        disk = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
        done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--measure", str(folder),
                               "--reads", str(args.reads)], capture_output=True, text=True, check=True)
        row = {"samples": size, "write_s": round(written, 1), "disk_mib": round(disk), **json.loads(done.stdout)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "data_store.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
