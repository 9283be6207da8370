"""A transformers model with weft's SP attention installed through AttentionInterface equals the unsharded model.

Tiny text-only Qwen2 (transformers' own class, preset qwen2_text_tiny), float32:
logits and every parameter gradient of the sharded run match one process.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from distributed import run_ranks


def _worker(rank: int, world: int, ulysses: int, ring: int, strategy: str) -> None:
    import structlog

    from weft.core.context import RunContext
    from weft.core.mesh import build_device_mesh
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.core.train.attention_install import install_attention
    from weft.strategies.sequence.layout import usp_shard

    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_text_tiny"},
        "parallel": {"ulysses": ulysses, "ring": ring},
        "rules": [{"when": {"modality": "text"}, "attention": {"strategy": strategy}}],
    })
    pm = build_plugin_manager(entry_points=False)
    model = pm.models.for_recipe(recipe).build(recipe, device="cpu", seed=0)
    reference = copy.deepcopy(model)  # keeps transformers' own sdpa
    plan, _ = plan_recipe(recipe, pm=pm, world_size=world, model=model)
    mesh = build_device_mesh(plan.mesh, device_type="cpu")
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), rank=rank, world_size=world, log=structlog.get_logger())
    installed = install_attention(model=model, plan=plan, mesh=mesh, ctx=ctx, pm=pm)
    assert installed["text_config"].startswith(f"weft_{strategy if strategy != 'auto' else 'usp'}"), installed

    g = torch.Generator().manual_seed(1)
    batch, seq = 2, 32
    input_ids = torch.randint(0, 300, (batch, seq), generator=g)
    # Labels shifted on the whole sequence, before the split: position t predicts t+1.
    labels = torch.cat([input_ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    count = (labels != -100).sum()

    logits_ref = reference(input_ids=input_ids).logits
    F.cross_entropy(logits_ref.flatten(0, 1), labels.flatten(), ignore_index=-100,
                    reduction="sum").div(count).backward()

    ring_rank, ulysses_rank = mesh["ring"].get_local_rank(), mesh["ulysses"].get_local_rank()

    def shard(t):
        return usp_shard(t, dim=1, ring_rank=ring_rank, ring=ring, ulysses_rank=ulysses_rank, ulysses=ulysses,
                         layout="zigzag")

    positions = shard(torch.arange(seq).expand(batch, seq))
    logits = model(input_ids=shard(input_ids), position_ids=positions).logits
    local_labels = shard(labels)
    F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), ignore_index=-100,
                    reduction="sum").div(count).backward()

    want = shard(logits_ref.detach())
    err = ((logits.detach() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"logits relative error {err:.3g}"
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)  # each SP rank holds its part of the sequence's gradient
        err = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)).item()
        assert err <= 1e-4, f"{name}: gradient relative error {err:.3g}"


CONFIGS = [(1, 4, "ring"), (4, 1, "ulysses"), (2, 2, "usp"), (2, 2, "auto")]


def _all_configs(rank: int, world: int) -> None:
    # One set of processes for every mesh shape: starting 4 ranks costs more than the checks.
    for ulysses, ring, strategy in CONFIGS:
        _worker(rank, world, ulysses, ring, strategy)


def test_text_model_with_sp_attention_equals_unsharded():
    """ring 4 (zigzag), ulysses 4 (4 query / 2 KV heads: KV replicated), usp 2 x 2, auto."""
    run_ranks(4, _all_configs)
