"""The shard rules' ``matmul = "float8"``: the units' linear layers swapped for float8 ones when
the model is sharded (the ``float8`` lever, plugins/shard/levers.py), and what `weft plan` says
of it (the shard strategies' ``describe``)."""

from __future__ import annotations


def describe(params, *, recipe, plan, model, family, positions) -> dict:
    """What `weft plan` prints of the shard rules' effect inside the units: the linear layers
    that multiply in float8, by rule, and those the rule leaves in their dtype."""
    import torch

    from weft.strategies.model.float8 import eligible

    lines = []
    by_rule: dict[str, list] = {}
    for unit in plan.modules_for("shard"):
        decision = unit.get("shard")
        if unit.info.kind == "unit" and getattr(decision.params, "matmul", "default") == "float8":
            by_rule.setdefault(f"{decision.rule!r} ({decision.source})", []).append(unit.info.path)
    for rule, paths in by_rule.items():
        taken, left = [], []
        for path in paths:
            for name, layer in model.get_submodule(path).named_modules():
                if isinstance(layer, torch.nn.Linear):
                    (taken if eligible(layer, name) else left).append(f"{path}.{name}")
        shown = f"; left in their dtype: {len(left)}, e.g. {left[0]}" if left else ""
        lines.append(f"float8 matmuls: {len(taken)} linear layers in {len(paths)} units by rule {rule}, e.g. "
                     f"{taken[0] if taken else '-'}{shown}")
    return {"lines": lines}


def float8_units(model, units, *, device) -> int:
    """Each unit's eligible linear layers swapped for torchao's Float8Linear (``units``: (module
    plan, its Float8 lever config) of the units that ask for it); a device without float8
    matrix units is the rule's error. Returns how many layers were swapped."""
    if not units:
        return 0
    from weft.strategies.model.float8 import convert, has_float8_units

    if not has_float8_units(device) and not all(config.float8_emulate for _, config in units):
        from weft.core.errors import PlanError

        rule = next(u.get("shard") for u, config in units if not config.float8_emulate)
        name = _device_name(device)
        raise PlanError(f"shard rule {rule.rule!r} asks for matmul = 'float8' on {len(units)} units, but {name} has "
                        "no float8 matrix units (GPUs of compute capability 8.9 or more: Ada, Hopper, Blackwell); "
                        "drop the key to multiply in the storage dtype, or set float8_emulate = true for float8's "
                        "numerics without its speed", where=f"{rule.source} (shard.matmul)")
    return sum(len(convert(model.get_submodule(u.info.path), recipe=config.float8_recipe,
                           emulate=config.float8_emulate)) for u, config in units)


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    return f"the {device.type} device"
