"""The compiled decoding step under Inductor options that cut its small kernels' cost (issue 46).

    python3 benchmarks/decode/inductor_options.py --out $OUT [--tokens 131072] [--sets default,pdl,pdl_all,combo,all]
        [--profile default] [--recipe TOML]

At 128K a token's step is ~5.6 ms of weight and cache reads and ~0.9 ms of small kernels between
them (norms, rotary and cache writes, the split-KV merge, SiLU) and the gaps at their boundaries
(BENCHMARKS.md, the H100's profile scaled to the H200). Two of Inductor's own options aim at that
rest, neither on by default:

- ``triton.enable_pdl``: its Triton kernels launched with programmatic dependent launch (Hopper
  and later), each waiting on the one before in its own body, so a launch overlaps the tail of
  the kernel before it;
- ``combo_kernels``: independent small kernels of the graph (the query's and the key's rotary,
  the two cache writes) horizontally fused into one launch.

Two more on request (``--sets tuned,autotune``; longer first steps): ``coordinate_descent_tuning``
(the small kernels' block sizes searched) and ``max_autotune_gemm`` (the products offered
Triton templates, their epilogues fused, beside cuBLAS).

``weft.decode_pdl``: weft's own split-KV kernels launched so too (decode_triton.py's ``CONFIG["pdl"]``).
Each set runs in a process of its own (``weft generate`` in-process under
``torch._inductor.config.patch``): the same recipe, prompt and 100 greedy tokens; the table gives
the replayed ms a token and whether the tokens equal the default's. ``--profile NAME``: that set
once more under the profiler (its kernels a step, the first 30 in ``NAME-profile.txt``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
RECIPE = HERE / "variants" / "7b-128k-static-cache.toml"
SETS = {
    "default": {},
    "pdl": {"triton.enable_pdl": True},
    "combo": {"combo_kernels": True},
    "both": {"triton.enable_pdl": True, "combo_kernels": True},
    # Inductor's kernels and weft's split-KV pair (strategies/attention/kernels/decode_triton.py's CONFIG)
    "pdl_all": {"triton.enable_pdl": True, "weft.decode_pdl": True},
    "all": {"triton.enable_pdl": True, "combo_kernels": True, "weft.decode_pdl": True},
    # Not in the default sets (longer compilations): the small kernels' block sizes searched, and
    # the products offered Triton templates (their epilogues fused: the residual adds) beside cuBLAS.
    "tuned": {"coordinate_descent_tuning": True},
    "autotune": {"max_autotune_gemm": True, "triton.enable_pdl": True},
}


def child(name: str, args: list[str]) -> int:
    """One set: weft generate in this process under the set's Inductor options."""
    sys.path.insert(0, str(HERE.parent))
    from _bootstrap import ensure_weft

    ensure_weft()
    import torch._inductor.config as inductor

    from weft.core.commands.main import main
    from weft.strategies.attention.kernels import decode_triton

    decode_triton.CONFIG["pdl"] = bool(SETS[name].get("weft.decode_pdl"))
    options = {k: v for k, v in SETS[name].items() if not k.startswith("weft.") and _has(inductor, k)}
    missing = sorted(k for k in set(SETS[name]) - set(options) if not k.startswith("weft."))
    if missing:
        print(f"inductor_options: this torch has no {missing}", file=sys.stderr)
    with inductor.patch(options):
        return main(args)


def _has(config, dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    return hasattr(config, head) and (not rest or _has(getattr(config, head), rest))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--sets", default="default,pdl,pdl_all,combo,all")
    parser.add_argument("--profile", default="", help="a set to run once more under the profiler")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a run")
    parser.add_argument("--recipe", default=str(RECIPE), help="the 7B's static-cache variant by default")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = [args.recipe, "--prompt-from-data", "--set", f"data.tokens={args.tokens}", "--set",
              f"train.micro_batch_tokens={args.tokens}", "--max-new-tokens", "100", "--warmup", "--json",
              "--nproc", "1"]
    rows = {}
    runs = [(name, []) for name in args.sets.split(",") if name]
    if args.profile:
        runs.append((args.profile, ["--profile", str(args.out / f"{args.profile}-profile")]))
    for name, extra in runs:
        tag = name + ("-profile" if extra else "")
        with open(args.out / f"{tag}.json", "w") as out, open(args.out / f"{tag}.err", "w") as err:
            try:
                rc = subprocess.run([sys.executable, __file__, "--child", name, "--", "generate", *common, *extra],
                                    stdout=out, stderr=err, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            rows[tag] = json.loads((args.out / f"{tag}.json").read_text())
        except ValueError:
            rows[tag] = {"rc": rc}
        print(tag, "rc", rc, {k: rows[tag].get(k) for k in ("graph_ms_per_token", "decode_ms_per_token")}, flush=True)
        if extra:
            _profile_table(args.out / f"{name}-profile" / "decode_profile.json", args.out / f"{tag}.txt")
    base = rows.get("default", {}).get("tokens")
    lines = [f"| set ({args.tokens:,} tokens) | options | graph ms/token | decode ms/token | tokens as default |",
             "|---|---|---:|---:|---|"]
    for tag, row in rows.items():
        same = "-"
        if base is not None and "tokens" in row:
            same = f"{sum(a == b for a, b in zip(row['tokens'], base))} of {len(base)}"
        lines.append(f"| {tag} | {SETS[tag.removesuffix('-profile')] or '-'} | {row.get('graph_ms_per_token', '?')} | "
                     f"{row.get('decode_ms_per_token', '?')} | {same} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _profile_table(source: pathlib.Path, dest: pathlib.Path) -> None:
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError):
        dest.write_text(f"not written: {source}\n")
        return
    rows = [f"step: {data.get('ms_per_step')} ms of kernels"]
    rows += [f"{k['per_step_us']:9.1f} us {k['calls']:6d}x {k['kernel'][:110]}" for k in data.get("kernels", [])[:30]]
    dest.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        raise SystemExit(child(sys.argv[2], sys.argv[4:]))
    raise SystemExit(main())
