"""Seeded init: a model sharded by FSDP2 over 2 or 4 ranks (1-D and HSDP meshes, uneven
shards, bfloat16 storage) holds bit for bit the values of the same init on a whole model."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from weft.strategies.model.seeded_init import init_parameters

STD = 0.02


def tiny_vl() -> torch.nn.Module:
    """The tiny Qwen2.5-VL preset, built on the meta device (no storage yet)."""
    import transformers

    from weft.core.recipe.presets import build_config, load_preset

    config = build_config(*load_preset("qwen2_5_vl_tiny")[:2])
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model


class Odd(torch.nn.Module):
    """Rows that do not divide by 4 (6, 2, 1, 3, 10), a padded embedding, a norm with a
    bias, a bare 2-D parameter, a conv and a bfloat16 weight. Used with blocks of 4 rows:
    blocks straddle the shards, and a shard covers only part of a block of more than 16
    values (CPU ``normal_``'s vectorised path: drawing just the rows a shard needs would
    give other values)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(7, 6)  # weight (6, 7), bias (6,)
        self.embed = torch.nn.Embedding(2, 3, padding_idx=1)  # (2, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.table = torch.nn.Parameter(torch.empty(1, 7))  # (1, 7): one rank holds it all
        self.conv = torch.nn.Conv1d(3, 3, kernel_size=2)  # (3, 3, 2)
        self.low = torch.nn.Linear(5, 10, bias=False).to(torch.bfloat16)  # (10, 5) bfloat16


def whole(build, *, seed: int, block_rows: int = 1024) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    init_parameters(model, seed=seed, std=STD, block_rows=block_rows)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.quick
def test_whole_model_init():
    model = tiny_vl()
    model.to_empty(device="cpu")
    # to_empty leaves whatever was in memory: poison it, so a parameter left out shows.
    for p in model.parameters():
        p.data.fill_(float("nan"))
    count = init_parameters(model, seed=3, std=STD)
    params = dict(model.named_parameters())
    assert count == len(params) > 50
    assert all(torch.isfinite(p).all() for p in params.values())
    again = whole(tiny_vl, seed=3)
    assert all(torch.equal(params[n], again[n]) for n in params)  # deterministic
    other = whole(tiny_vl, seed=4)
    assert not torch.equal(params["lm_head.weight"], other["lm_head.weight"])
    norms = [n for n in params if "norm" in n or "ln_q" in n]
    biases = [n for n in params if n.endswith(".bias")]
    assert len(norms) == 10 and len(biases) == 18  # 5 + 5 norms, 12 + 6 biases
    assert all(torch.equal(params[n], torch.ones_like(params[n])) for n in norms)
    assert all(not params[n].any() for n in biases)
    for name in ("lm_head.weight", "model.visual.patch_embed.proj.weight", "model.visual.merger.mlp.0.weight"):
        assert abs(params[name].std().item() - STD) < 0.1 * STD, name
        assert abs(params[name].mean().item()) < 0.1 * STD, name
    # transformers zeros the padding row of the embedding (pad_token_id 306), and so do we.
    embed = params["model.language_model.embed_tokens.weight"]
    assert not embed[306].any() and embed[305].any()
    # Block boundaries do not show in the values: blocks are independent draws.
    small_blocks = whole(tiny_vl, seed=3, block_rows=7)
    assert not torch.equal(small_blocks["lm_head.weight"], params["lm_head.weight"])
    assert abs(small_blocks["lm_head.weight"].std().item() - STD) < 0.1 * STD


@pytest.mark.quick
def test_rotary_tables_are_restored_after_to_empty():
    """The caller's step for buffers (not parameters): sharded_load's reset."""
    import transformers

    from weft.strategies.model.sharded_load import reset_non_persistent_buffers

    model = tiny_vl()
    reference = transformers.AutoModelForImageTextToText.from_config(model.config, dtype=torch.float32)
    model.to_empty(device="cpu")
    for buffer in model.buffers():
        buffer.fill_(123.0)  # finite garbage, which reset's own isfinite check cannot see
    assert reset_non_persistent_buffers(model) == 2
    expected = dict(reference.named_buffers())
    assert all(torch.equal(b, expected[n]) for n, b in model.named_buffers())


@pytest.mark.quick
def test_block_rows_must_be_positive():
    with pytest.raises(ValueError, match="block_rows"):
        init_parameters(torch.nn.Linear(2, 2), seed=0, std=STD, block_rows=0)


def _sharded(rank: int, world: int, expected: dict[str, dict[str, torch.Tensor]]) -> None:
    """FSDP2 over all 4 ranks, over 2 ranks (one dim of a (2, 2) mesh: ranks {0, 1} and
    {2, 3} each shard a model of their own) and HSDP over the (2, 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weft.strategies.model.sharded_load import reset_non_persistent_buffers

    def check(model: torch.nn.Module, reference: dict[str, torch.Tensor], what: str) -> None:
        for name, param in model.named_parameters():
            full = param.full_tensor()  # a collective over the parameter's mesh
            assert torch.equal(full, reference[name].to(param.dtype)), f"{what}, rank {rank}: {name} differs"

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    meshes = {"FSDP over 4 ranks": init_device_mesh("cpu", (world,)), "FSDP over 2 ranks": hsdp["shard"]}
    for what, mesh in meshes.items():
        model = tiny_vl()
        for layer in (*model.model.visual.blocks, *model.model.language_model.layers):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        assert init_parameters(model, seed=3, std=STD) == len(expected["tiny"])
        check(model, expected["tiny"], f"tiny Qwen2.5-VL, {what}")
        reset_non_persistent_buffers(model)
        assert model.model.language_model.rotary_emb.inv_freq[0] == 1.0

    # 6 rows: chunks of 2, 2, 2 and none over 4 ranks, 3 each over 2.
    rows = {"FSDP over 4 ranks": [2, 2, 2, 0][rank], "FSDP over 2 ranks": 3, "HSDP 2x2": 3}
    for what, mesh in {**meshes, "HSDP 2x2": hsdp}.items():
        with torch.device("meta"):
            odd = Odd()
        fully_shard(odd.conv, mesh=mesh)
        fully_shard(odd, mesh=mesh)
        odd.to_empty(device="cpu")
        assert odd.low.weight.dtype == torch.bfloat16
        init_parameters(odd, seed=5, std=STD, block_rows=4)
        check(odd, expected["odd"], f"uneven rows, {what}")
        assert odd.proj.weight.to_local().shape[0] == rows[what]


def test_sharded_equals_whole():
    """One 4-process run covers 4 and 2 ranks: starting a rank costs ~5 s of imports."""
    expected = {"tiny": whole(tiny_vl, seed=3), "odd": whole(Odd, seed=5, block_rows=4)}
    run_ranks(4, _sharded, expected)
