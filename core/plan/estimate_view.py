"""``weft plan --estimate``: the estimate of a planned recipe, as a table or JSON, with the longest
length that fits and, when the recipe does not fit, the rule changes that would make it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from weft.core.plan.estimate import GIB, longest_fit, memory
from weft.core.plan.estimate_inputs import contributions_of, setup_of, shape_of, units_of
from weft.core.plan.gpus import GPUS
from weft.core.plan.memory_advice import levers
from weft.core.plan.step_time import step_seconds

if TYPE_CHECKING:
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Plan

#: Allocator slack and CUDA context beside what torch counts as allocated.
HEADROOM_GIB = 2.0


#: A plan that fits but whose predicted peak comes within this share of the device's memory is
#: warned about: the prediction is up to ~1.5 GiB under the measured peaks (docs/estimate.md),
#: and what the allocator reserves beyond them is fragmentation that differs run to run
#: (measured: a 7B 32K recipe at 135.7 of 139.8 GiB ran out of memory at step 2 in one of two
#: runs, 12.6 GiB reserved but unallocated).
NEAR_LIMIT = 0.03


#: Host memory per GPU of the machines this project measures on (128 GiB with one H200,
#: 256 GiB with two): ``--host-gib`` gives a node's own.
HOST_GIB_PER_GPU = 128.0


def estimate(recipe: Recipe, plan: Plan, model: Any, *, gpu: str, host_gib: float | None = None) -> dict:
    kind = GPUS[gpu]
    units, extra = units_of(plan, model), contributions_of(plan)
    shape, setup = shape_of(model, units), setup_of(recipe, plan)
    per_node = min(plan.mesh.world_size, 8)  # ranks sharing one host's memory
    host_budget = (host_gib if host_gib is not None else HOST_GIB_PER_GPU * per_node) * GIB
    budget = (kind.memory_gib - HEADROOM_GIB) * GIB
    mem = memory(units, shape, setup, extra=extra)
    step = step_seconds(units, shape, setup, kind, extra=extra)
    multiple = 1024 * setup.sp

    def within(m: dict) -> bool:
        return m["total"] <= budget and m["host"] * per_node <= host_budget

    def fits(tokens: int) -> bool:
        return within(memory(units, shape, attrs.evolve(setup, tokens=tokens), extra=extra))

    result = {
        "gpu": kind.name, "rates_measured": kind.measured, "gpu_memory_gib": kind.memory_gib,
        "tokens": setup.tokens, "mesh": {"dp_replicate": setup.dp_replicate, "dp_shard": setup.dp_shard,
                                         "ring": setup.ring, "ulysses": setup.ulysses},
        "memory_gib": {k: round(v / GIB, 2) for k, v in mem.items() if k != "host"},
        "host_gib": round(mem["host"] / GIB, 1), "host_budget_gib": round(host_budget / GIB, 1),
        "ranks_per_host": per_node,
        "step_s": {k: round(v, 3) for k, v in step.items() if k not in ("tokens_per_s", "mfu")},
        "tokens_per_s": round(step["tokens_per_s"]), "ranks": plan.mesh.world_size,
        "tokens_per_s_per_gpu": round(step["tokens_per_s"] / plan.mesh.world_size), "mfu": round(step["mfu"], 3),
        "fits": within(mem),
        # Adapters (plugins/adapter.py): trained beside a frozen base, which holds its weights only.
        "adapter_parameters": sum(u.adapter_params for u in units),
        # float8 by rule: its products at its scaling's measured speed-up on this GPU (gpus.py); a
        # compiled unrecomputed float8 MLP keeps one intermediate fewer (estimate.py FLOAT8_MLP_SAVED),
        # a recomputed one holds more while it is made again (FLOAT8_RECOMPUTE_MLP).
        "float8_units": sum(1 for m in plan.modules_for("shard")
                            if getattr(m.get("shard").params, "matmul", "default") == "float8"),
        "headroom_gib": round(kind.memory_gib - mem["total"] / GIB, 2),
        "warning": near_limit(recipe, peak_gib=mem["total"] / GIB, device_gib=kind.memory_gib, gpu=kind.name)
        if within(mem) else None,
        "longest_tokens": longest_fit(fits, low=multiple, high=1 << 24, multiple=multiple),
        "changes": [] if within(mem) else _changes(recipe, units, shape, setup, within, extra=extra),
    }
    return result


def near_limit(recipe: Any, *, peak_gib: float, device_gib: float, gpu: str) -> str | None:
    """One line when the predicted peak leaves less than NEAR_LIMIT of the device free."""
    if peak_gib < (1 - NEAR_LIMIT) * device_gib:
        return None
    allocator = ("parallel.expandable_segments is on (it limits fragmentation; it cannot make room)"
                 if recipe.parallel.expandable_segments else
                 "set parallel.expandable_segments = true (the allocator then grows segments instead of fragmenting)")
    return (f"the predicted peak, {peak_gib:.1f} GiB, leaves {device_gib - peak_gib:.1f} GiB of the {gpu}'s "
            f"{device_gib} GiB free, under {NEAR_LIMIT:.0%}: the prediction can be ~1.5 GiB short and the "
            f"allocator's fragmentation varies from run to run, so some runs may run out of memory; {allocator}; "
            f"for headroom recompute more (checkpoint = \"full\") or lower train.micro_batch_tokens (now "
            f"{recipe.train.micro_batch_tokens})")


def _changes(recipe: Any, units: list, shape: Any, setup: Any, within, *, extra: tuple = ()) -> list[dict]:
    """Rule changes, pulled one after another until the recipe fits; each with the rule to edit."""
    out = []
    for lever in levers(recipe, units):
        if lever.apply is None:
            continue
        units, setup = lever.apply(units, setup)
        mem = memory(units, shape, setup, extra=extra)
        out.append({"change": lever.change, "where": lever.where, "total_gib": round(mem["total"] / GIB, 1),
                    "host_gib": round(mem["host"] / GIB, 1), "fits": within(mem)})
        if out[-1]["fits"]:
            break
    return out


def render_estimate(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    measured = "measured rates" if result["rates_measured"] else "rates scaled from the H200's (not measured)"
    console.print(f"[bold]estimate[/] for one step of {result['tokens']:,} tokens on {result['gpu']} "
                  f"({result['gpu_memory_gib']} GiB; {measured}), mesh {result['mesh']}")
    if result.get("adapter_parameters"):
        console.print(f"adapters: {result['adapter_parameters']:,} parameters trained (gradients, optimizer "
                      "states); the base frozen: its weights only, and no weight-gradient products")
    console.print(_parts(Table("per-rank GPU memory", "GiB"), result["memory_gib"], total="total (peak)"))
    console.print(f"host memory: ~{result['host_gib']} GiB per rank, {result['ranks_per_host']} per host "
                  f"(budget {result['host_budget_gib']} GiB: --host-gib)")
    console.print(_parts(Table("step time (per rank)", "s"), result["step_s"], total="total"))
    if result.get("float8_units"):
        console.print(f"float8: {result['float8_units']} units multiply in float8 by rule; their products are "
                      "counted at their scaling's speed-up measured on the H200 (core/plan/gpus.py; none where "
                      "not measured); a compiled, unrecomputed layer's MLP keeps one intermediate fewer in "
                      "tensorwise and rowwise (measured at 32K; the estimate is 3% above), and a layer made "
                      "again whole holds its casts' float8 copies besides (measured at 128K)")
    console.print(f"predicted: {result['tokens_per_s']:,} tokens/s over {result['ranks']} GPUs "
                  f"({result['tokens_per_s_per_gpu']:,} per GPU), MFU {result['mfu']:.1%}; "
                  + ("[green]fits[/]" if result["fits"] else "[red]does not fit[/]"))
    if result.get("warning"):
        console.print(f"[yellow]warning:[/] {result['warning']}")
    longest = result["longest_tokens"]
    console.print(f"longest sequence that fits this recipe: {longest:,} tokens" if longest
                  else "no length fits this recipe")
    for change in result["changes"]:
        console.print(f"  then {change['change']} -> {change['total_gib']} GiB"
                      f"{' (fits)' if change['fits'] else ''}: {change['where']}")


def _parts(table, parts: dict, *, total: str):
    """One row per part, the total in bold."""
    for part, value in parts.items():
        table.add_row(f"[bold]{total}[/]" if part == "total" else part, f"{value:,.2f}")
    return table
