"""Ring and Ulysses attention on real GPUs (one rank per GPU, NCCL): exactness and speed.

Ring over all ranks (zigzag), Ulysses over all ranks, and on 4 ranks USP 2 x 2
(Ulysses inside contiguous pairs, ring across them).
Unlike benchmarks/attention/ring_emulated.py (ring sizes emulated on one GPU), the ranks here run
at once and exchange K/V (and dK/dV) over NCCL, so the time includes whatever
communication the compute does not hide.

    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/attention/ring_real.py --out $OUT

Exactness: every rank builds the same inputs, keeps its part (zigzag for the
ring, contiguous for Ulysses), runs forward + backward; rank 0 gathers and
compares with one whole-sequence SDPA call under torch's CP tolerances (atol
8e-3·W, rtol 1e-3·W; the figure is the worst element's error over its
tolerance, <= 1 passes), against bf16 SDPA and against float32 SDPA.
Speed: efficiency = (T_full / W) / T_ring, T_full one cuDNN SDPA call (forward +
backward) over the whole sequence on one GPU, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ring_emulated import attention_flops, full_sdpa_time, tolerance_ratio  # noqa: E402
from weft.strategies.attention.ring import ring_attention  # noqa: E402
from weft.strategies.attention.ulysses import ulysses_attention  # noqa: E402
from weft.strategies.attention.usp import usp_attention  # noqa: E402
from weft.strategies.sequence.layout import shard_sequence, unshard_sequence, usp_shard, usp_unshard  # noqa: E402


class Mesh2D:
    """USP on 4 ranks: Ulysses over contiguous pairs {0,1},{2,3}, ring over {0,2},{1,3}."""

    def __init__(self, rank: int) -> None:
        ulysses = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ring = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.ulysses_rank, self.ring_rank = rank % 2, rank // 2
        self.ulysses_group, self.ring_group = ulysses[self.ring_rank], ring[self.ulysses_rank]


MESH: list[Mesh2D] = []  # filled in main() on 4 ranks


def inputs(*, batch, heads, kv_heads, seq, head_dim, draw):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    fn = torch.rand if draw == "rand" else torch.randn
    q = fn(batch, heads, seq, head_dim, **shape)
    k = fn(batch, kv_heads, seq, head_dim, **shape)
    v = fn(batch, kv_heads, seq, head_dim, **shape)
    dout = torch.ones_like(q) if draw == "rand" else torch.randn(batch, heads, seq, head_dim, **shape)
    return q, k, v, dout


def run_sp(strategy, backend, q, k, v, dout, *, rank, world, causal):
    """This rank's (out, dq, dk, dv) for its part of the sequence, and how to reassemble parts."""
    if strategy == "usp":
        mesh = MESH[0]

        def split(t):
            return usp_shard(
                t, dim=2, ring_rank=mesh.ring_rank, ring=2, ulysses_rank=mesh.ulysses_rank, ulysses=2, layout="zigzag"
            )

        def join(parts):  # all_gather order is rank order: rank = 2 * ring_rank + ulysses_rank
            return usp_unshard([parts[0:2], parts[2:4]], dim=2, layout="zigzag")
    else:
        layout = "zigzag" if strategy == "ring" else "contiguous"

        def split(t):
            return shard_sequence(t, dim=2, rank=rank, world=world, layout=layout)

        def join(parts):
            return unshard_sequence(parts, dim=2, layout=layout)
    part = [split(t).contiguous() for t in (q, k, v, dout)]
    ql, kl, vl = (t.clone().requires_grad_() for t in part[:3])
    if strategy == "ring":
        out = ring_attention(ql, kl, vl, causal=causal, layout="zigzag", backend=backend)
    elif strategy == "usp":
        out = usp_attention(
            ql,
            kl,
            vl,
            ulysses_group=MESH[0].ulysses_group,
            ring_group=MESH[0].ring_group,
            causal=causal,
            layout="zigzag",
            backend=backend,
        )
    else:
        out = ulysses_attention(ql, kl, vl, causal=causal)
    out.backward(part[3])
    return join, [out.detach(), ql.grad, kl.grad, vl.grad]


def gather(local, *, world, join):
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return join(parts)


def strategies(world):
    runs = [("ring", "cudnn"), ("ring", "triton"), ("ulysses", "-")]
    return runs + ([("usp", "cudnn"), ("usp", "triton")] if world == 4 else [])


def exactness(*, rank, world, lines):
    cases = [
        (
            "torch CP test (B8 H8 D32, rand)",
            dict(batch=8, heads=8, kv_heads=8, seq=1024 * world, head_dim=32, draw="rand"),
        ),
        ("B1 H28/4 D128, randn", dict(batch=1, heads=28, kv_heads=4, seq=8192, head_dim=128, draw="randn")),

    ]
    for name, shape in cases:
        q, k, v, dout = inputs(**shape)
        for causal in (True, False):
            refs = {}
            for dtype in (torch.bfloat16, torch.float32):
                qr, kr, vr = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
                o = torch.nn.functional.scaled_dot_product_attention(
                    qr, kr, vr, is_causal=causal, enable_gqa=kr.shape[1] != qr.shape[1]
                )
                o.backward(dout.to(dtype))
                refs[dtype] = [t.detach().float() for t in (o, qr.grad, kr.grad, vr.grad)]
            for strategy, backend in strategies(world):
                join, got = run_sp(strategy, backend, q, k, v, dout, rank=rank, world=world, causal=causal)
                full = [gather(t, world=world, join=join).float() for t in got]
                if rank == 0:
                    vs_bf16 = max(tolerance_ratio(a, b, world=world) for a, b in zip(full, refs[torch.bfloat16]))
                    vs_fp32 = max(tolerance_ratio(a, b, world=world) for a, b in zip(full, refs[torch.float32]))
                    lines.append(
                        f"| {name} | {shape['seq']} | {causal} | {strategy} | {backend} | {world} "
                        f"| {vs_bf16 <= 1} ({vs_bf16:.3f}) | {vs_fp32 <= 1} ({vs_fp32:.3f}) |"
                    )
                    print(lines[-1], flush=True)


def speed(*, rank, world, seq, iters, lines):
    heads, kv_heads, head_dim = 28, 4, 128
    q, k, v, dout = inputs(batch=1, heads=heads, kv_heads=kv_heads, seq=seq, head_dim=head_dim, draw="randn")
    for causal in (True, False):
        flops = attention_flops(batch=1, heads=heads, seq=seq, head_dim=head_dim, causal=causal)
        t_full = full_sdpa_time(q, k, v, dout, causal=causal, iters=iters) if rank == 0 else 0.0
        for strategy, backend in strategies(world):
            run_sp(strategy, backend, q, k, v, dout, rank=rank, world=world, causal=causal)  # warm-up
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run_sp(strategy, backend, q, k, v, dout, rank=rank, world=world, causal=causal)
            torch.cuda.synchronize()
            dist.barrier()
            t_sp = (time.perf_counter() - start) / iters
            if rank == 0:
                lines.append(
                    f"| {seq // 1024}K | {causal} | {strategy} | {backend} | {world} "
                    f"| {flops / world / t_sp / 1e12:.0f} | {(t_full / world) / t_sp:.3f} "
                    f"| {t_sp * 1e3:.1f} | {t_full * 1e3:.1f} |"
                )
                print(lines[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 4:
        MESH.append(Mesh2D(rank))
    lines = [f"{torch.cuda.get_device_name()} x {world}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; "
             "NCCL, one rank per GPU.", "",
             "| setting | seq | causal | strategy | kernel | ranks "
             "| within tolerance of bf16 SDPA (worst err/tol) | within tolerance of fp32 SDPA (worst err/tol) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    exactness(rank=rank, world=world, lines=lines)
    lines += ["", "Speed: batch 1, 28 query heads, 4 KV heads, head_dim 128, bf16, randn; "
              "forward + backward, wall time across ranks.", "",
              "| total length | causal | strategy | kernel | ranks | TFLOP/s per GPU | fraction of full cuDNN "
              "| ms (fwd+bwd) | full cuDNN ms (1 GPU) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    speed(rank=rank, world=world, seq=args.seq, iters=args.iters, lines=lines)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "real_ring.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
