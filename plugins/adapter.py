"""Adapter hook: LoRA by rule, through PEFT's own layers (the format transformers, vLLM and
SGLang load), on the modules a rule names; the base frozen.

A linear layer takes the ``adapter`` decision of its innermost planned module (attention
module, shard unit, root) that names a strategy other than ``none``: a rule on the root
with ``targets = "all-linear"`` adapts the whole model, and a rule on some layers with
another ``r`` overrides it there.
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Adapters, NoParams, Strategy

ALL_LINEAR = "all-linear"


def _targets(instance, attribute, value) -> None:
    if isinstance(value, str) and value != ALL_LINEAR:
        raise ValueError(f"targets must be {ALL_LINEAR!r} or a list of module names (e.g. [\"q_proj\", \"v_proj\"]), "
                         f"got {value!r}")
    if not isinstance(value, str) and not value:
        raise ValueError("targets = [] names no layer; give module names or \"all-linear\"")


@attrs.frozen(kw_only=True)
class LoraParams:
    r: int = attrs.field(default=16, validator=in_range(low=1), metadata={"doc": "rank of the update B @ A"})
    alpha: float = attrs.field(default=32.0, validator=in_range(low=0.0), metadata={
        "doc": "the update is scaled by alpha / r (alpha / sqrt(r) with rslora)"})
    dropout: float = attrs.field(default=0.0, validator=in_range(low=0.0, high=0.999), metadata={
        "doc": "dropout on the adapter's input (the base's path has none)"})
    targets: tuple[str, ...] | str = attrs.field(default=ALL_LINEAR, validator=_targets, metadata={
        "doc": "linear layers to adapt inside the matched module: their names or name suffixes (\"q_proj\", "
               "\"mlp.down_proj\"), or \"all-linear\": every linear layer but the output head"})
    rslora: bool = attrs.field(default=False, metadata={"doc": "rank-stabilised LoRA: scale by alpha / sqrt(r)"})
    dora: bool = attrs.field(default=False, metadata={
        "doc": "DoRA (PEFT's use_dora): each adapted layer's weight as a magnitude per output row times the "
               "direction of W + B @ A, the magnitudes trained too (drawn as the rows' norms, so the model starts "
               "as the base); each forward also computes W + B @ A's row norms (a weight-sized product a layer)"})
    b_init: Literal["zeros", "normal"] = attrs.field(default="zeros", metadata={
        "doc": "zeros: the adapted model starts as the base; normal: B drawn like A (N(0, 1/r)), so A's gradients "
               "are not zero at step 0 (for `weft check` of them)"})


def check_peft(params, *, recipe, plan) -> str | None:
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return "needs the peft package (pip install 'weft[lora]')"
    if params.dora and (quantized := plan.quantized_units()):
        # PEFT's DoRA reads a quantised base through bitsandbytes' call, which torchao's NF4
        # weight does not answer (its forward fails): refused here rather than at step 1.
        return (f"dora = true over a 4-bit base ({len(quantized)} units with quantize = 'nf4', e.g. "
                f"{next(iter(quantized))}): PEFT's DoRA layers cannot read torchao's NF4 weights; drop dora or "
                "quantize")
    return None


NONE = Strategy(point="adapter", name="none", params=NoParams, inert=True,
                summary="no adapter: the module's own weights train")
LORA = Strategy(point="adapter", name="lora", params=LoraParams, check=check_peft,
                summary="PEFT LoRA on the module's linear layers; the base frozen (no gradients, no optimizer "
                        "state, no gradient reduction)")


@hookimpl
def weft_strategies():
    return [NONE, LORA]


@hookimpl
def weft_adapter(model, plan, ctx):
    folder = getattr(ctx, "adapter_dir", None) if ctx is not None else None
    if folder is not None:  # weft eval/generate --adapter: the directory's adapter, not the rules'
        return _from_directory(model, folder, ctx=ctx)
    decided = [m for m in plan.modules_for("adapter") if m.get("adapter").strategy == LORA.name]
    if not decided:
        return None
    from weft.core.errors import PlanError

    by_layer = _layers_by_decision(model, decided)
    for unit in decided:  # each rule must reach a layer, or it trains nothing it promises
        decision = unit.get("adapter")
        if not any(d.source == decision.source for d, _ in by_layer.values()):
            raise PlanError(f"adapter rule {decision.rule!r}: targets {_shown(decision.params.targets)} name no "
                            f"linear layer under {unit.info.path or '(root)'}; its linear layers are named "
                            f"{_leaf_names(model, unit.info.path)}", where=f"{decision.source} (adapter.targets)")
    before = {name for name, _ in model.named_parameters()}
    from peft import inject_adapter_in_model

    inject_adapter_in_model(_one_config(by_layer), model)
    # PEFT's layers keep the base layer as ``base_layer`` (renaming its weights) and add
    # ``lora_A`` / ``lora_B``: the adapters are the parameters under PEFT's ``lora_`` prefix.
    added = {name: p for name, p in model.named_parameters() if name not in before and ".lora_" in name}
    # The base frozen: no gradients, so no optimizer state and no FSDP2 reduce-scatter for it.
    for name, p in model.named_parameters():
        p.requires_grad_(name in added)
    params_of = {}  # adapter parameter name -> its rule's params
    for path, (decision, _) in by_layer.items():
        for name in added:
            if name.startswith(path + "."):
                params_of[name] = decision.params
    summary = {"layers": len(by_layer), "parameters": sum(p.numel() for p in added.values()),
               "ranks": sorted({d.params.r for d, _ in by_layer.values()})}
    if ctx is not None and ctx.log is not None:
        ctx.log.info("adapter.lora", **summary)
    return Adapters(names=tuple(sorted(added)), init=lambda m, *, seed: _init(m, params_of=params_of, seed=seed),
                    summary=summary, merge=_merge, save=_save)


def _from_directory(model, folder, *, ctx):
    """A saved PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``) on the model:
    its layers added as its config says, frozen (eval and generate train nothing), their
    weights read after the base's, each rank its shards (strategies/model/sharded_load.py)."""
    from peft import LoraConfig, inject_adapter_in_model

    from weft.core.errors import WeftError

    try:
        config = LoraConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, OSError) as error:
        raise WeftError(f"{folder}/adapter_config.json is not a LoRA adapter's config ({error})",
                        where="--adapter") from None
    before = {name for name, _ in model.named_parameters()}
    try:
        inject_adapter_in_model(config, model)
    except ValueError as error:  # PEFT: its target modules are not in this model
        raise WeftError(f"the adapter in {folder} does not fit this model: {error}", where="--adapter") from None
    # PEFT renames each adapted layer's weights (under ``base_layer``): new names, old tensors.
    added = tuple(sorted(name for name, _ in model.named_parameters() if name not in before and ".lora_" in name))
    for p in model.parameters():
        p.requires_grad_(False)
    summary = {"layers": sum(1 for n in added if ".lora_A." in n), "parameters": sum(
        p.numel() for n, p in model.named_parameters() if n in added), "from": str(folder)}
    if ctx.log is not None:
        ctx.log.info("adapter.loaded", **summary)
    return Adapters(names=added, init=lambda m, *, seed: _load(m, folder=folder, names=frozenset(added)),
                    summary=summary, merge=_merge, save=_save)


def _load(model, *, folder, names: frozenset) -> None:
    import pathlib

    from weft.core.errors import WeftError
    from weft.strategies.model.sharded_load import load_sharded

    try:
        load_sharded(model, pathlib.Path(folder), include=names.__contains__, name_map=_peft_name)
    except (KeyError, ValueError) as error:
        raise WeftError(f"cannot load the adapter's weights: {error}", where="--adapter") from None


#: The name part of a DoRA layer's magnitudes (PEFT's ``lora_magnitude_vector``).
MAGNITUDE = ".lora_magnitude_vector."


def _peft_name(name: str) -> str:
    """A model's adapter parameter as PEFT's adapter directory names it (no adapter name; a DoRA
    magnitude without its ``.weight``)."""
    if MAGNITUDE in name:
        return "base_model.model." + name.split(MAGNITUDE)[0] + MAGNITUDE.rstrip(".")
    return "base_model.model." + name.replace(".default.", ".")


def _one_config(by_layer: dict):
    """One PEFT config for every rule (one adapter, as PEFT saves and vLLM loads it): the most
    common rank and alpha, other layers' by exact path in ``rank_pattern`` / ``alpha_pattern``.
    PEFT keeps one dropout and one scaling rule per adapter, so the rules must agree on those."""
    import collections
    import re

    from peft import LoraConfig

    from weft.core.errors import PlanError

    decisions = [d for d, _ in by_layer.values()]
    first = decisions[0]
    for d in decisions:
        if (d.params.dropout, d.params.rslora, d.params.dora) != (first.params.dropout, first.params.rslora,
                                                                 first.params.dora):
            raise PlanError(f"adapter rules {first.rule!r} ({first.source}) and {d.rule!r} give different dropout, "
                            "rslora or dora; one PEFT adapter has one of each: give them the same",
                            where=f"{d.source} (adapter)")
    r, alpha = collections.Counter((d.params.r, d.params.alpha) for d in decisions).most_common(1)[0][0]
    # Exact paths: PEFT matches a target by equality or a '.'-prefixed suffix, and a pattern as
    # a regex on the end of the name, so an escaped full path names one layer: the rules, not
    # PEFT's name matching, decide which layers are adapted.
    ranks = {re.escape(path): d.params.r for path, (d, _) in by_layer.items() if d.params.r != r}
    alphas = {re.escape(path): d.params.alpha for path, (d, _) in by_layer.items() if d.params.alpha != alpha}
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=first.params.dropout, use_rslora=first.params.rslora,
                      use_dora=first.params.dora,
                      target_modules=sorted(by_layer), rank_pattern=ranks, alpha_pattern=alphas, bias="none",
                      init_lora_weights="gaussian")


def _layers_by_decision(model, decided) -> dict:
    """{linear layer path: (its lora decision, the deciding module's path)}, innermost decision first."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    deepest_first = sorted(decided, key=lambda u: -len(u.info.path.split(".")) if u.info.path else 0)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for unit in deepest_first:
            path = unit.info.path
            if path and name != path and not name.startswith(path + "."):
                continue
            targets = unit.get("adapter").params.targets
            leaf = name.rsplit(".", 1)[-1]
            hit = module is not head if targets == ALL_LINEAR else any(
                leaf == t or name.endswith("." + t) for t in targets)
            if hit:
                out[name] = (unit.get("adapter"), path)
            break  # the innermost decided module decides, whether its targets take the layer or not
    return out


def _init(model, *, params_of: dict, seed: int) -> None:
    """PEFT's "gaussian" init drawn from the seed: A ~ N(0, 1/r), B = 0, so the adapted model
    starts as the base. Seeded per name and row (strategies/model/seeded_init.py): the same
    values whatever the sharding, as `weft check`'s unsharded reference needs."""
    from weft.strategies.model.seeded_init import init_parameters, zero_parameters

    magnitudes = {n for n in params_of if MAGNITUDE in n}
    drawn = {n: p for n, p in params_of.items() if ".lora_A." in n or (p.b_init == "normal" and n not in magnitudes)}
    for r in sorted({p.r for p in drawn.values()}):
        init_parameters(model, seed=seed, std=1.0 / r, only=frozenset(n for n, p in drawn.items() if p.r == r))
    zero_parameters(model, only=frozenset(n for n in params_of if n not in drawn and n not in magnitudes))
    if magnitudes:
        from weft.strategies.model.dora import init_magnitudes

        init_magnitudes(model)


def _merge(model) -> None:
    """W + B @ A * scaling into each adapted layer's base weight (PEFT's merge), then the base
    layer back in the adapter layer's place: the model transformers' from_pretrained builds."""
    from peft.tuners.lora import LoraLayer

    from weft.strategies.model.quantize import dequantize

    dequantize(model)  # 4-bit base weights: merged in their dequantised values, the ones trained with
    adapted = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    for name, module in adapted:
        module.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config  # nothing of PEFT's left in the exported model's config


def _save(model, tensors: dict, out_dir, *, base: str) -> None:
    """PEFT's adapter directory, as ``PeftModel.save_pretrained`` writes it: adapter_config.json
    (the one adapter's config, ``base_model_name_or_path`` = ``base``) and
    adapter_model.safetensors (keys ``base_model.model.<layer>.lora_A.weight``: PeftModel's own
    names, without the adapter's name), loadable by ``PeftModel.from_pretrained``."""
    import pathlib

    from safetensors.torch import save_file

    config = model.peft_config["default"]
    config.base_model_name_or_path = base
    config.inference_mode = True
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    named = {_peft_name(name): t.contiguous() for name, t in tensors.items() if ".lora_" in name}
    save_file(named, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def _shown(targets) -> str:
    return repr(targets) if isinstance(targets, str) else repr(list(targets))


def _leaf_names(model, path: str) -> list[str]:
    import torch

    root = model.get_submodule(path) if path else model
    return sorted({n.rsplit(".", 1)[-1] for n, m in root.named_modules() if isinstance(m, torch.nn.Linear)})
