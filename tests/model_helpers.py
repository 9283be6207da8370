"""Test helpers: a recipe's model built through its family, as the core does."""

from __future__ import annotations

from weft.core.plugin_manager import build_plugin_manager


def family_of(recipe):
    return build_plugin_manager(entry_points=False).models.for_recipe(recipe)


def build_model(recipe, *, device="cpu", seed=0):
    return family_of(recipe).build(recipe, device=device, seed=seed)


def optimizer_for(recipe, model, *, world_size=1):
    """The optimizer and schedule a run of ``recipe`` makes for ``model`` (its plan's groups)."""
    import torch

    from weft.core.context import RunContext
    from weft.core.plan.planner import plan_recipe
    from weft.core.train.optimizer_setup import make_optimizer

    pm = build_plugin_manager(entry_points=False)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=world_size, model=model)
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"))
    return make_optimizer(recipe, model, plan=plan, pm=pm, ctx=ctx)


def transformers_greedy(recipe_path: str, *, prompt: str, image: str, new: int) -> dict:
    """transformers' own greedy ``generate`` of ``new`` tokens on a recipe's model (its seed's
    weights) for one prompt with one image: the model, family and inputs, the tokens and
    their log-probabilities (float64 log-softmax of the scores)."""
    import torch

    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    recipe = Recipe.from_toml(recipe_path)
    family = plugin_manager_from_env().models.for_recipe(recipe)
    model = family.build(recipe, device="cpu", seed=recipe.train.seed).eval()
    inputs = family.prompt_inputs(recipe, text=prompt, images=[image])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(s.double(), dim=-1)[0, t]) for s, t in zip(out.scores, tokens)]
    return {"model": model, "family": family, "inputs": inputs, "tokens": tokens, "logprobs": logprobs}


class ListLog:
    """A structlog-shaped logger that keeps (event, fields) pairs."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    warning = error = debug = info
