"""Give each attention module the function its Plan decision names, through AttentionInterface.

transformers picks an attention function per sub-config (vision tower, text model)
by name. When every module of a tower uses the same binding, that name is set
directly; when they differ, one dispatcher keyed by module is registered for the
tower. Nothing inside transformers is patched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import AttentionInterface

from weft.core.registry import AttentionBinding

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.mesh import WeftMesh
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe.rule_engine import Plan


def install_attention(*, model: Any, plan: Plan, mesh: WeftMesh, ctx: RunContext,
                      pm: WeftPluginManager) -> dict[str, str]:
    """Returns {sub-config key: attention implementation name} as set on the model."""
    towers: dict[str, dict[str, AttentionBinding]] = {}
    for module_plan in plan.modules_for("attention"):
        info = module_plan.info
        binding = pm.attention(decision=module_plan.get("attention"), module_path=info.path, plan=plan, mesh=mesh,
                               ctx=ctx)
        if binding.fn is not None:
            AttentionInterface.register(binding.name, binding.fn)
        tower = "vision_config" if info.modality == "vision" else "text_config"
        towers.setdefault(tower, {})[info.path] = binding
    chosen: dict[str, str] = {}
    for tower, bindings in towers.items():
        names = {b.name for b in bindings.values()}
        if len(names) == 1:
            chosen[tower] = names.pop()
        else:
            chosen[tower] = _register_dispatcher(model, tower, bindings)
    has_towers = hasattr(model.config, "vision_config")
    set_attention_names(model, chosen if has_towers else chosen["text_config"])
    ctx.log.info("attention.installed", **chosen)
    return chosen


def set_attention_names(model: Any, names: str | dict[str, str]) -> None:
    """``model.set_attn_implementation(names)`` for names registered in AttentionInterface.

    transformers >= 5.25 takes any name with "flash" in it for a flash-attn kernel and looks it
    up (on the Hub when the package is absent), yet weft's vision attention is a registered
    function whose name says "flash" only so that the tower is called with the whole sequence
    and its cu_seqlens. Such a name is therefore set through a stand-in ("sdpa", which passes
    the check on every model weft runs) and then written to the config, whose setter carries
    it into the sub-configs the modules read at each call."""
    by_key = names if isinstance(names, dict) else {"": names}
    stand_in = {key: "sdpa" if "flash" in name else name for key, name in by_key.items()}
    if stand_in == by_key:
        model.set_attn_implementation(names)
        return
    model.set_attn_implementation(stand_in if isinstance(names, dict) else stand_in[""])
    model.config._attn_implementation = names


def _register_dispatcher(model: Any, tower: str, bindings: dict[str, AttentionBinding]) -> str:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    table = {id(model.get_submodule(path)): ALL_ATTENTION_FUNCTIONS[b.name] for path, b in bindings.items()}

    def dispatch(module, query, key, value, attention_mask, **kwargs):
        return table[id(module)](module, query, key, value, attention_mask, **kwargs)

    # "flash" in the name would change how transformers calls the tower; a mixed
    # tower gets the plain per-window calling convention.
    name = f"weft_mixed_{tower}_{id(model):x}"
    AttentionInterface.register(name, dispatch)
    return name
