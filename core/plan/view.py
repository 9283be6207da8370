"""Text views of a Plan and of the loaded plugins, for `weft plan` and `weft plugins`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import attrs

from weft.core import hookspecs
from weft.core.hookspecs import HOOK_POINTS
from weft.core.recipe.convert import field_docs

if TYPE_CHECKING:
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Plan


def _console():
    from rich.console import Console

    # Off a terminal (pipes, tests) never wrap: one module per line, greppable.
    return Console(width=None if sys.stdout.isatty() else 400, soft_wrap=not sys.stdout.isatty())


def _params(decision: Any, *, explain: bool = False) -> str:
    values = attrs.asdict(decision.params)
    shown = ", ".join(f"{k}={v}" for k, v in values.items() if v not in (None, ""))
    text = f"{decision.strategy}({shown})" if shown else decision.strategy
    # --explain: the strategy the rule named ('auto'), then what the Plan resolved it to.
    return f"{decision.resolved_from} -> {text}" if explain and decision.resolved_from else text


def render_plan(plan: Plan, *, explain: bool, recipe: Recipe, rope: dict | None = None) -> None:
    from rich.table import Table

    console = _console()
    mesh = plan.mesh
    console.print(
        f"[bold]{recipe.source}[/bold]  world_size={plan.world_size}  seq_len={plan.seq_len}  "
        f"mesh dp_replicate={mesh.dp_replicate} x dp_shard={mesh.dp_shard} x ulysses={mesh.ulysses} x ring={mesh.ring}"
    )
    if rope is not None:
        console.print(_rope_line(rope, seq_len=plan.seq_len))
    if recipe.eval.every:
        from rich.markup import escape

        console.print(escape(_eval_line(recipe)))  # its [data] is the recipe's section, not markup
    root = plan.root()
    glob = Table(title="run-wide decisions", show_lines=False)
    glob.add_column("hook point")
    glob.add_column("strategy")
    if explain:
        glob.add_column("rule")
    for decision in root.decisions:
        row = [decision.point, _params(decision, explain=explain)]
        row += [f"{decision.source}  {decision.rule}"] if explain else []
        glob.add_row(*row)
    console.print(glob)

    table = Table(title="modules")
    for column in ("module", "class", "modality", "heads", "kv", "d", "point", "strategy"):
        table.add_column(column)
    if explain:
        table.add_column("rule")
    for module in plan.modules:
        info = module.info
        if info.kind == "root":
            continue
        for decision in module.decisions:
            row = [
                info.path, info.class_name, info.modality or "",
                _num(info.heads), _num(info.kv_heads), _num(info.head_dim),
                decision.point, _params(decision, explain=explain),
            ]
            if explain:
                row.append(f"{decision.source}  {decision.rule}")
            table.add_row(*row)
    console.print(table)


def render_trainable(plan: Plan, model: Any) -> None:
    """What trains: the parameters outside frozen units (``trainable = false``) that an adapter
    rule left trainable (with one, the adapters alone), and those units."""
    frozen = plan.frozen_units()
    total = sum(p.numel() for p in model.parameters())
    held = {id(p) for path in frozen for p in model.get_submodule(path).parameters()}
    still = sum(p.numel() for p in model.parameters() if id(p) not in held and p.requires_grad)
    line = f"trains {still:,} of {total:,} parameters"
    adapted = sorted({m.get("adapter").rule for m in plan.adapted()})
    if adapted:
        line += f"; adapters by rule, the base frozen: {', '.join(adapted)}"
    if frozen:
        line += f"; frozen by rule (no gradients, no optimizer states): {len(frozen)} units, {frozen[0]}"
        line += f" ... {frozen[-1]}" if len(frozen) > 1 else ""
    _console().print(line)


def _eval_line(recipe: Any) -> str:
    """What [eval] evaluates: the [data] keys [eval.data] changes, or the training data itself."""
    held_out = recipe.eval.data
    if held_out is None:
        return (f"held-out evaluation every {recipe.eval.every} steps: on the training data itself ([data]; "
                "give [eval.data] for held-out samples)")
    import attrs

    changed = {k: v for k, v in attrs.asdict(held_out).items() if getattr(recipe.data, k) != v}
    keys = ", ".join(f"{k} = {v!r}" for k, v in changed.items()) or "none: the training data itself"
    return f"held-out evaluation every {recipe.eval.every} steps and after the last: [data] with {keys}"


def _rope_line(rope: dict, *, seq_len: int) -> str:
    how = (f"{rope['scaling']} x{rope['factor']:g} over {rope['trained_positions']} trained positions"
           if rope["scaling"] != "none" else f"as the model ships, {rope['trained_positions']} trained positions")
    line = f"rotary context {rope['context']} ({how})"
    if seq_len > rope["context"]:
        # Not an error: mRoPE images and packed documents keep position ids below the token count.
        line += (f"; seq_len {seq_len} is longer: fine while the data's position ids stay below {rope['context']}, "
                 "else the run warns 'positions.beyond_trained' with the YaRN factor it needs")
    return line


def render_positions(found: dict) -> None:
    console = _console()
    console.print(
        f"positions: {found['samples']} samples (max {found['max_tokens']} tokens; "
        f"{found['dropped_over_long']} over-long left out, "
        f"{found['bad']} bad); largest position id {found['largest_position']} "
        f"(median per sample {found['p50_position']}), "
        f"rotary context {found['context']}"
    )
    if found["beyond_context"]:
        console.print(f"[yellow]{found['beyond_context']} samples pass the context[/yellow]: "
                      "set model.rope_scaling = 'yarn' and "
                      f"model.rope_factor = {found['needed_factor']:g} "
                      f"(over {found['trained_positions']} trained positions)")
    else:
        console.print("every sample stays inside the rotary context: no scaling needed")


def render_vision_split(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="vision tower under sequence parallelism: the first step's images per rank")
    for column in ("dp rank", "sp rank", "images (index: t x h x w patches)", "vision strategy"):
        table.add_column(column)
    for row in rows:
        images = ", ".join(f"{i['index']}: {'x'.join(map(str, i['grid_thw']))} ({i['patches']})"
                           for i in row["images"]) or "none (dummy image)"
        table.add_row(str(row["dp_rank"]), str(row["sp_rank"]), images, row["vision"])
    _console().print(table)


def _num(value: int | None) -> str:
    return "" if value is None else str(value)


def plugins_table(pm: WeftPluginManager) -> dict:
    points = []
    for point in ("strategies", "models", *HOOK_POINTS):
        name = f"weft_{point}"
        spec = getattr(hookspecs, name)
        opts = getattr(spec, "weft_spec", None) or getattr(spec, f"{hookspecs.PROJECT}_spec", {})
        points.append({
            "hook": name,
            "firstresult": bool(opts.get("firstresult")) if isinstance(opts, dict) else False,
            "implemented_by": [impl.plugin_name for impl in getattr(pm.hook, name).get_hookimpls()],
        })
    strategies_of = pm.registry.all()  # collects weft_strategies first: fills pm.broken
    broken = {name: error for name, _, error in pm.broken}
    plugins = [{"name": name, "distribution": pm.distribution_of(name), "error": broken.get(name)}
               for name in pm.plugin_names()]
    # Entry points whose module raised on import: never registered, listed as left out all the same.
    plugins += [{"name": name, "distribution": where, "error": f"import: {error}"}
                for name, where, error in pm.unloaded]
    strategies = [
        {
            "point": s.point,
            "name": s.name,
            "plugin": s.plugin,
            "summary": s.summary,
            "params": [{"name": n, "accepts": a, "default": d, "doc": doc} for n, a, d, doc in field_docs(s.params)],
        }
        for s in strategies_of
    ]
    models = [{"name": a.name, "model_types": list(a.model_types), "plugin": plugin, "summary": a.summary}
              for plugin, a in pm.models.all()]
    return {"hook_points": points, "plugins": plugins, "strategies": strategies, "models": models}


def render_plugins(table: dict) -> None:
    from rich.table import Table

    console = _console()
    hooks = Table(title="hook points")
    for column in ("hook", "kind", "implemented by"):
        hooks.add_column(column)
    for point in table["hook_points"]:
        hooks.add_row(point["hook"], "firstresult" if point["firstresult"] else "collect-all",
                      ", ".join(point["implemented_by"]))
    console.print(hooks)
    plugins = Table(title="plugins")
    plugins.add_column("plugin")
    plugins.add_column("distribution")
    plugins.add_column("status")
    for plugin in table["plugins"]:
        error = plugin.get("error") or ""
        said = error.removeprefix("import: ")  # an entry point whose module raised on import, else weft_strategies
        status = f"[red]left out: {'its import' if said != error else 'weft_strategies'} raised {said}[/red]" \
            if error else "ok"
        plugins.add_row(plugin["name"], plugin["distribution"], status)
    console.print(plugins)
    strategies = Table(title="strategies")
    for column in ("point", "name", "plugin", "parameters", "summary"):
        strategies.add_column(column)
    for s in table["strategies"]:
        # One parameter a line, with its metadata doc: what a rule may write, and what it does.
        params = "\n".join(f"{p['name']}: {p['accepts']} = {p['default']!r}" + (f" ({p['doc']})" if p["doc"] else "")
                           for p in s["params"]) or "-"
        strategies.add_row(s["point"], s["name"], s["plugin"], params, s["summary"])
    console.print(strategies)
    models = Table(title="model families")
    for column in ("adapter", "model_type", "plugin", "summary"):
        models.add_column(column)
    for m in table["models"]:
        models.add_row(m["name"], ", ".join(m["model_types"]), m["plugin"], m["summary"])
    console.print(models)


def render_check(result: dict) -> None:
    """`weft check`'s table: both losses, gradient and gradient-norm differences."""
    from rich.table import Table

    console = _console()
    console.print(f"mesh {result['mesh']}  world_size={result['world_size']}  micro-batches={result['micro_batches']}")
    reference = "float32 " if result.get("bf16_floor") else ""
    table = Table(title=f"unsharded (1 process, {reference}reference) vs the recipe's plan, same micro-batches")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("loss (unsharded)", f"{result['loss_ref']:.8f}")
    table.add_row("loss (plan)", f"{result['loss']:.8f}")
    table.add_row("loss relative difference", f"{result['loss_rel_diff']:.2e}")
    table.add_row("largest gradient relative difference (before grad sync)",
                  f"{result['grad_max_rel_diff']:.2e} ({result['grad_max_rel_diff_param']})")
    for group, value in sorted(result["grad_max_rel_diff_by_group"].items()):
        table.add_row(f"  {group}", f"{value:.2e}")
    if result["grad_norm_rel_diff"] is not None:
        table.add_row("global gradient norm (unsharded / plan)",
                      f"{result['grad_norm_ref']:.6g} / {result['grad_norm']:.6g}")
        table.add_row("gradient norm relative difference", f"{result['grad_norm_rel_diff']:.2e}")
    if result["clipped_grad_max_rel_diff"] is not None:
        table.add_row("largest gradient relative difference (after clipping)",
                      f"{result['clipped_grad_max_rel_diff']:.2e}")
    console.print(table)
    tolerances = result["tolerances"]
    floor = result.get("bf16_floor")
    basis = (f"bf16: twice the unsharded model's own bf16 difference from float32, loss {floor['loss_rel_diff']:.2e}, "
             f"gradients {floor['grad_max_rel_diff']:.2e}" if floor else "float32")
    console.print(("[green]OK[/green]" if result["ok"] else "[red]DIFFERENT[/red]")
                  + f" (tolerances: loss {tolerances['loss']:.2g}, gradients {tolerances['grad']:.2g}; {basis})")
    if result["reduced_precision_units"]:
        console.print(f"note: {len(result['reduced_precision_units'])} units compute in a lower param_dtype by rule "
                      f"(e.g. {result['reduced_precision_units'][0]}); "
                      "their differences are precision, not parallelism")
