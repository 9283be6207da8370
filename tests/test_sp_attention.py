"""Ring, Ulysses and USP attention equal full attention: outputs and q/k/v gradients, on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from weft.strategies.attention.ring import ring_attention
from weft.strategies.attention.ulysses import ulysses_attention
from weft.strategies.attention.usp import usp_attention
from weft.strategies.sequence.layout import sequence_index, shard_sequence, unshard_sequence, usp_shard, usp_unshard

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def make_inputs(*, batch, heads, kv_heads, seq, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=dtype)
    dout = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=dtype)
    return q, k, v, dout


def reference(q, k, v, dout, *, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check_case(case: dict, *, shard, run) -> None:
    """Shard inputs with ``shard``, attend with ``run``, compare to the full reference on this rank's part."""
    dtype = case["dtype"]
    q, k, v, dout = make_inputs(
        **{k: case[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim", "dtype")}, seed=case.get("seed", 0)
    )
    want = reference(q, k, v, dout, causal=case["causal"])
    local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out = run(*local)
    out.backward(shard(dout))
    got = (out.detach(), local[0].grad, local[1].grad, local[2].grad)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = rel_err(g, shard(w))
        assert err <= TOLERANCE[dtype], (
            f"{case['name']}: {name} relative error {err:.3g} > {TOLERANCE[dtype]:g} ({dtype})"
        )


def _cases(world: int) -> list[dict]:
    cases = []
    for dtype in (torch.float32, torch.float64):
        for causal in (True, False):
            base = dict(batch=2, heads=8, kv_heads=8, seq=16 * world, head_dim=80, dtype=dtype, causal=causal)
            cases.append(dict(base, name=f"ring-zigzag-{dtype}-causal{causal}", kind="ring", layout="zigzag"))
            cases.append(dict(base, name=f"ring-contiguous-{dtype}-causal{causal}", kind="ring", layout="contiguous"))
            cases.append(dict(base, name=f"ulysses-{dtype}-causal{causal}", kind="ulysses"))
            # GQA: 8 query heads, 2 KV heads: replicated when the degree exceeds them.
            cases.append(dict(base, kv_heads=2, name=f"ulysses-gqa-{dtype}-causal{causal}", kind="ulysses"))
            cases.append(dict(base, kv_heads=2, name=f"ring-gqa-{dtype}-causal{causal}", kind="ring", layout="zigzag"))
    cases.append(dict(
        batch=2, heads=8, kv_heads=8, seq=16 * world, head_dim=80, dtype=torch.float64, causal=True,
        name="ring-math-backend", kind="ring", layout="zigzag", backend="math",
    ))
    return cases


def _worker_1d(rank: int, world: int) -> None:
    for case in _cases(world):
        if case["kind"] == "ring":
            layout = case["layout"]

            def shard(t, layout=layout):
                return shard_sequence(t, dim=2, rank=rank, world=world, layout=layout)

            def run(q, k, v, case=case):
                return ring_attention(
                    q, k, v, causal=case["causal"], layout=case["layout"], backend=case.get("backend", "auto")
                )
        else:

            def shard(t):
                return shard_sequence(t, dim=2, rank=rank, world=world, layout="contiguous")

            def run(q, k, v, case=case):
                return ulysses_attention(q, k, v, causal=case["causal"])

        check_case(case, shard=shard, run=run)


def _worker_usp(rank: int, world: int, ulysses: int, ring: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    ring_rank, ulysses_rank = mesh["ring"].get_local_rank(), mesh["ulysses"].get_local_rank()
    for dtype in (torch.float32, torch.float64):
        for causal in (True, False):
            for kv_heads in (8, 2):
                case = dict(
                    batch=2, heads=8, kv_heads=kv_heads, seq=32, head_dim=80, dtype=dtype, causal=causal,
                    name=f"usp-u{ulysses}r{ring}-{dtype}-causal{causal}-kv{kv_heads}",
                )

                def shard(t):
                    return usp_shard(
                        t, dim=2, ring_rank=ring_rank, ring=ring, ulysses_rank=ulysses_rank, ulysses=ulysses,
                        layout="zigzag",
                    )

                def run(q, k, v, causal=causal):
                    return usp_attention(
                        q, k, v, ulysses_group=mesh["ulysses"].get_group(), ring_group=mesh["ring"].get_group(),
                        causal=causal,
                    )

                check_case(case, shard=shard, run=run)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_equal_full_attention(world):
    run_ranks(world, _worker_1d)


def test_usp_ulysses2_ring2_equals_full_attention():
    run_ranks(4, _worker_usp, 2, 2)


def _worker_errors(rank: int, world: int) -> None:
    q = torch.randn(1, 4, 5, 16)
    with pytest.raises(ValueError, match="must be even"):
        ring_attention(q, q, q, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="does not divide the 6 query heads"):
        ulysses_attention(torch.randn(1, 6, 4, 16), torch.randn(1, 6, 4, 16), torch.randn(1, 6, 4, 16))
    with pytest.raises(ValueError, match="one must divide the other"):
        ulysses_attention(torch.randn(1, 12, 4, 16), torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16))


def test_bad_shapes_are_clear_errors():
    run_ranks(4, _worker_errors)


@pytest.mark.quick
def test_sequence_not_divisible_is_a_clear_error():
    with pytest.raises(ValueError, match=r"length 30 is not divisible by 8 .*pad it by 2 to 32"):
        shard_sequence(torch.zeros(30), dim=0, rank=0, world=4, layout="zigzag")


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_and_unshard_are_exact_inverses(layout, world):
    x = torch.randn(2, 3, 24 * world, 5)
    parts = [shard_sequence(x, dim=2, rank=r, world=world, layout=layout) for r in range(world)]
    assert torch.equal(unshard_sequence(parts, dim=2, layout=layout), x)
    assert sum(p.shape[2] for p in parts) == x.shape[2]
    index = torch.cat([sequence_index(x.shape[2], rank=r, world=world, layout=layout) for r in range(world)])
    assert sorted(index.tolist()) == list(range(x.shape[2]))


@pytest.mark.quick
def test_zigzag_gives_each_rank_a_head_and_a_tail_chunk():
    assert sequence_index(8, rank=0, world=2, layout="zigzag").tolist() == [0, 1, 6, 7]
    assert sequence_index(8, rank=1, world=2, layout="zigzag").tolist() == [2, 3, 4, 5]


@pytest.mark.quick
def test_usp_shard_round_trip():
    x = torch.randn(1, 2, 32, 4)
    parts = [
        [usp_shard(x, dim=2, ring_rank=r, ring=2, ulysses_rank=u, ulysses=2, layout="zigzag") for u in range(2)]
        for r in range(2)
    ]
    assert torch.equal(usp_unshard(parts, dim=2, layout="zigzag"), x)


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_emulated_ring_equals_full_attention(layout, causal):
    """The one-process emulation the GPU benchmark times computes the same as full attention."""
    from weft.strategies.attention.emulate import emulate_ring
    from weft.strategies.attention.kernels.blocks import KERNELS

    world = 4
    q, k, v, dout = make_inputs(batch=2, heads=8, kv_heads=2, seq=64, head_dim=80, dtype=torch.float64, seed=3)
    want = reference(q, k, v, dout, causal=causal)

    def parts(t):
        return [shard_sequence(t, dim=2, rank=r, world=world, layout=layout) for r in range(world)]

    outs, grads = emulate_ring(
        parts(q), parts(k), parts(v), parts(dout), causal=causal, scale=80**-0.5, layout=layout,
        kernel=KERNELS["cpu_flash"],
    )
    got = [unshard_sequence(outs, dim=2, layout=layout)] + [
        unshard_sequence([g[i] for g in grads], dim=2, layout=layout) for i in range(3)
    ]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(g, w) <= 1e-10, name


@pytest.mark.quick
def test_emulated_ring_times_each_block_call_through_its_timer():
    """``timer`` (what benchmarks/attention/ring_emulated.py records CUDA events in) is entered once per
    (phase, rank, step) in schedule order, a step without a block too, with exactly that
    step's kernel calls inside it; the results are the untimed run's, bit for bit."""
    import contextlib

    import attrs

    from weft.strategies.attention.emulate import emulate_ring
    from weft.strategies.attention.kernels.blocks import KERNELS

    world, layout = 4, "contiguous"  # causal contiguous: ranks skip the blocks in their future
    q, k, v, dout = make_inputs(batch=1, heads=4, kv_heads=2, seq=32, head_dim=16, dtype=torch.float64, seed=4)
    entered, calls, now = [], [], []

    def counted(fn, phase):
        def call(*args, **kwargs):
            calls.append((phase, now[-1] if now else None))
            return fn(*args, **kwargs)
        return call

    plain = KERNELS["cpu_flash"]
    kernel = attrs.evolve(plain, forward=counted(plain.forward, "fwd"), backward=counted(plain.backward, "bwd"))

    @contextlib.contextmanager
    def timer(phase, rank, step):
        entered.append((phase, rank, step))
        now.append((phase, rank, step))
        yield
        now.pop()

    def parts(t):
        return [shard_sequence(t, dim=2, rank=r, world=world, layout=layout) for r in range(world)]

    args = (parts(q), parts(k), parts(v), parts(dout))
    timed = emulate_ring(*args, causal=True, scale=0.25, layout=layout, kernel=kernel, timer=timer)
    untimed = emulate_ring(*args, causal=True, scale=0.25, layout=layout, kernel=plain)
    assert entered == [(phase, r, st) for phase in ("fwd", "bwd") for r in range(world) for st in range(world)]
    # Every kernel call inside the timer of its own step and phase; future blocks call nothing.
    assert all(inside is not None and inside[0] == phase for phase, inside in calls)
    blocks = {inside for _, inside in calls}
    assert len(blocks) == 2 * world * (world + 1) // 2 < len(entered)
    assert all(torch.equal(a, b) for a, b in zip(timed[0], untimed[0]))
    assert all(torch.equal(a, b) for ga, gb in zip(timed[1], untimed[1]) for a, b in zip(ga, gb))


def _worker_autocast(rank: int, world: int) -> None:
    import torch.distributed as dist

    from weft.strategies.attention.hf_bridge import make_attention_function, ring_attend

    group = dist.group.WORLD
    fn = make_attention_function(name="ring", attend=ring_attend(layout="zigzag", backend="auto", ring_group=group))
    q, k, v = make_inputs(batch=1, heads=4, kv_heads=2, seq=32, head_dim=16, dtype=torch.float32, seed=3)[:3]
    q, k, v = (shard_sequence(t, dim=2, rank=rank, world=world, layout="zigzag") for t in (q, k, v))

    class Module:
        is_causal = True

    # Rotary embeddings leave q/k in float32 inside a bf16 autocast region; the bridge must
    # cast like SDPA would, so the ring runs bf16 kernels (and Ulysses sends bf16).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fn(Module(), q, k, v, None, scaling=0.25)
    want = ring_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), group=group, causal=True, scale=0.25, layout="zigzag"
    )

    assert out.dtype == torch.bfloat16, out.dtype
    assert torch.equal(out, want.transpose(1, 2)), (out.float() - want.transpose(1, 2).float()).abs().max()
    out32, _ = fn(Module(), q, k, v, None, scaling=0.25)  # outside autocast: untouched float32
    assert out32.dtype == torch.float32


def test_hf_bridge_casts_like_sdpa_under_autocast():
    run_ranks(2, _worker_autocast)
