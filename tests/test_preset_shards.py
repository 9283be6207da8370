"""A preset materialised shard by shard (meta build, FSDP2, each rank drawing its rows) equals
the whole model built in one process, whatever the world size."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks


def _gather(rank: int, world: int, preset: str, out: str) -> None:
    import structlog

    from weft.core.context import RunContext
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.core.train.prepare import prepare_model

    recipe = Recipe.from_dict({"model": {"preset": preset}, "train": {"seed": 7}})
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), rank=rank, world_size=world, log=structlog.get_logger())
    run = prepare_model(recipe=recipe, pm=build_plugin_manager(entry_points=False), ctx=ctx)
    full = {name: p.full_tensor().detach().clone() for name, p in run.model.named_parameters()}
    if rank == 0:
        torch.save(full, out)


@pytest.mark.parametrize("preset, world", [("qwen2_5_vl_tiny", 2), ("qwen3_vl_tiny", 4)])
def test_sharded_preset_equals_a_whole_build(preset, world, tmp_path):
    from model_helpers import build_model
    from weft.core.recipe import Recipe

    out = tmp_path / "gathered.pt"
    run_ranks(world, _gather, preset, str(out))
    gathered = torch.load(out)
    whole = dict(build_model(Recipe.from_dict({"model": {"preset": preset}}), device="cpu", seed=7).named_parameters())
    assert gathered.keys() == whole.keys()
    for name, param in whole.items():
        assert torch.equal(gathered[name], param.detach()), name  # bit for bit
    other = dict(build_model(Recipe.from_dict({"model": {"preset": preset}}), device="cpu", seed=8).named_parameters())
    assert not torch.equal(other["lm_head.weight"], whole["lm_head.weight"])
