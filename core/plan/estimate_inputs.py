"""The estimate's inputs from a plan: units with their parameter counts and shard rules, the
model's shape, and the step's setup (length, mesh, loss). Reads the meta-built model's
parameter counts and config; allocates nothing."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from weft.core.plan.estimate import Contribution, Setup, Shape, Unit

if TYPE_CHECKING:
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Plan

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def units_of(plan: Plan, model: Any) -> list[Unit]:
    """Every shard unit and the root, each with its own parameters (not nested units'); with
    ``model`` None (a run's out-of-memory advice), the rules alone and no parameter counts."""
    decided = [m for m in plan.modules_for("shard") if m.info.kind in ("unit", "root")]
    paths = [m.info.path for m in decided]
    counts, trained = {}, set()
    for path in paths:
        module = (model.get_submodule(path) if path else model) if model is not None else None
        counts[path] = {id(p): p.numel() for p in module.parameters()} if module is not None else {}
        trained |= {id(p) for p in module.parameters() if p.requires_grad} if module is not None else set()
    # An adapter rule: its hook (``weft_adapter``, on the planner's meta model) froze the base, and
    # what still requires a gradient there is the adapters' parameters (plugins/adapter.py).
    adapted = model is not None and bool(plan.adapted())
    units = []
    for m in decided:
        path = m.info.path
        inner = [q for q in paths if q != path and (q.startswith(path + ".") if path else True)]
        taken = {pid for q in inner for pid in counts[q]}
        own = {pid: n for pid, n in counts[path].items() if pid not in taken}
        adapters = sum(n for pid, n in own.items() if pid in trained) if adapted else 0
        decision = m.get("shard")
        params = decision.params
        record = plan.strategy(decision)  # what the strategy declares it shards over (core/registry.py)
        units.append(Unit(
            path=path, modality=m.info.modality if m.info.kind == "unit" else None,
            params=sum(own.values()) - adapters, adapter_params=adapters,
            strategy=decision.strategy, storage_bytes=_BYTES[getattr(params, "storage_dtype", None) or "float32"],
            checkpoint=getattr(params, "checkpoint", "off") if m.info.kind == "unit" else "off",
            offload_activations=getattr(params, "offload_activations", False),
            offload_keep_every=getattr(params, "offload_keep_every", 1),
            offload=getattr(params, "offload", False),
            mlp_tile_tokens=getattr(params, "mlp_tile_tokens", 0),
            trainable=getattr(params, "trainable", True) and not adapted,
            quantized_params=_quantized(model, path, own) if getattr(params, "quantize", "none") != "none" else 0,
            state_bytes=_state_bytes(m, storage=_BYTES[getattr(params, "storage_dtype", None) or "float32"]),
            float8=getattr(params, "float8_recipe", "") if getattr(params, "matmul", "default") == "float8" else "",
            compiled=bool(getattr(params, "compile", False)),
            source=decision.source,
            shard_dims=record.shard_dims if record is not None else (),
            gathers=record.gathers if record is not None else False,
        ))
    return units


def contributions_of(plan: Plan) -> tuple[Contribution, ...]:
    """What the root's strategies (grad sync, optimizer, ...) add to the estimate beyond what the core
    counts: each record's ``estimate_memory`` and ``estimate_time``, its rule's params bound."""
    found = []
    for decision in plan.root().decisions:
        record = plan.strategy(decision)
        if record is None or (record.estimate_memory is None and record.estimate_time is None):
            continue
        memory, seconds = record.estimate_memory, record.estimate_time
        found.append(Contribution(source=decision.source,
                                  memory=functools.partial(memory, decision.params) if memory else None,
                                  seconds=functools.partial(seconds, decision.params) if seconds else None))
    return tuple(found)


def _quantized(model: Any, path: str, own: dict) -> int:
    """The unit's own linear weights a 4-bit rule quantises: whole 64-value blocks, adapters' not
    (as strategies/model/quantize.py does)."""
    if model is None:
        return 0
    import torch

    module = model.get_submodule(path) if path else model
    return sum(layer.weight.numel() for name, layer in module.named_modules()
               if isinstance(layer, torch.nn.Linear) and "lora_" not in name and id(layer.weight) in own
               and layer.weight.numel() % 64 == 0)


def _state_bytes(module: Any, *, storage: int) -> float | None:
    """The optimizer's state bytes per parameter, as its rule's parameters say (``state_bytes``)."""
    optimizer = module.get("optimizer")
    answer = getattr(getattr(optimizer, "params", None), "state_bytes", None)
    return answer(storage) if callable(answer) else None


def shape_of(model: Any, units: list[Unit]) -> Shape:
    config = model.config
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", None)
    heads = text.num_attention_heads
    layer = next((u.params for u in units if u.modality == "text"), 0)
    vision_params = sum(u.params for u in units if u.modality == "vision")
    return Shape(
        hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size,
        layer_params=layer,
        vision_hidden=getattr(vision, "hidden_size", 0) if vision is not None else 0,
        vision_intermediate=getattr(vision, "intermediate_size", 0) if vision is not None else 0,
        vision_blocks=getattr(vision, "depth", 0) if vision is not None else 0,
        vision_params=vision_params,
    )


def setup_of(recipe: Recipe, plan: Plan, *, tokens: int | None = None) -> Setup:
    mesh = plan.mesh
    rows = rows_of(recipe)
    return Setup(
        tokens=tokens or recipe.train.micro_batch_tokens, patches=patches_of(recipe) * rows, rows=rows,
        dp_shard=mesh.dp_shard, dp_replicate=mesh.dp_replicate, ring=mesh.ring, ulysses=mesh.ulysses,
        loss=recipe.train.loss, micro_batches=micro_batches_of(recipe, plan, tokens=tokens),
    )


def micro_batches_of(recipe: Recipe, plan: Plan, *, tokens: int | None = None) -> int:
    """Micro-batches one rank runs a step: ``train.step_tokens`` over the data-parallel ranks'
    micro-batches (their SP ranks share one), at least one; 0 step tokens: one round."""
    each = (tokens or recipe.train.micro_batch_tokens) * plan.mesh.dp_shard * plan.mesh.dp_replicate
    return max(1, math.ceil(recipe.train.step_tokens / each)) if recipe.train.step_tokens else 1


def rows_of(recipe: Any) -> int:
    """Sequences in one micro-batch of synthetic data of ``data.tokens`` tokens: as many as fit
    ``train.micro_batch_tokens``, a preference pair's two (``data.pair_response_tokens``) each a row
    of its own, each with its images; other sources: 1 (the micro-batch one sequence)."""
    data = recipe.data
    if getattr(data, "source", "") != "synthetic" or not getattr(data, "tokens", 0):
        return 1
    per_sample = 2 if getattr(data, "pair_response_tokens", 0) else 1
    return max(1, recipe.train.micro_batch_tokens // (data.tokens * per_sample)) * per_sample


def patches_of(recipe: Any) -> int:
    """Vision patches of one sample of synthetic data (its ``data.images`` sides over 14-pixel
    patches, and its ``data.videos``' in temporal patches of 2 frames); other sources: 0
    (their images are known only once read: ``weft plan`` shows them)."""
    data = recipe.data
    if getattr(data, "source", "") != "synthetic":
        return 0
    images = sum((h // 14) * (w // 14) for h, w in (getattr(data, "images", None) or []))
    return images + sum(max(1, f // 2) * (h // 14) * (w // 14) for f, h, w in (getattr(data, "videos", None) or []))
