"""What would make a step fit: the one table of memory levers.

Two readers: the out-of-memory message of a run (core/train/oom.py: the levers not pulled yet,
each with the rule or key that pulls it) and the planner's rule changes (``weft plan
--estimate``, core/plan/estimate_view.py: the same levers applied in turn to the estimate until
the recipe fits). Both read the plan's shard units as the estimate describes them
(core/plan/estimate_inputs.py), so they name the same levers in the same order.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import attrs


@attrs.frozen(kw_only=True)
class Lever:
    change: str  # what to set: 'train.loss = "fused"'
    why: str  # what it saves
    where: str  # the rule (file:line) or key to edit
    #: The estimate's model of it: (units, setup) -> (units, setup); None where the estimate
    #: answers otherwise (a shorter micro-batch: its longest length that fits).
    apply: Callable[[list, Any], tuple[list, Any]] | None = None
    group: str = ""  # levers of one group (ring 2, 4, 8) are one line in a message


def levers(recipe: Any, units: list) -> list[Lever]:
    """The levers the recipe has not pulled yet, most effective first."""
    def each(pred, **kw):
        return lambda us, s: ([attrs.evolve(u, **kw) if pred(u) else u for u in us], s)

    found = []
    layers = ("text", "vision")
    lighter = [u for u in units if u.modality in layers and u.checkpoint != "full"]
    if lighter:
        found.append(Lever(
            change=f'checkpoint = "full" for the decoder layers and vision blocks (now "{lighter[0].checkpoint}" on '
                   f"{len(lighter)}, {lighter[0].path} first)", why="(a layer keeps only its input)",
            where=lighter[0].source, apply=each(lambda u: u.modality in layers, checkpoint="full")))
    if recipe.train.loss != "fused":
        found.append(Lever(change='train.loss = "fused"', why="(the logits and their gradient never exist)",
                           where=f"{recipe.source} (train.loss)",
                           apply=lambda us, s: (us, attrs.evolve(s, loss="fused"))))
    wide = [u for u in units if u.storage_bytes == 4]
    if wide:
        found.append(Lever(change='storage_dtype = "bfloat16"', why="(weights, gradients and AdamW states at half the "
                           "bytes)", where=wide[0].source, apply=each(lambda u: True, storage_bytes=2)))
    kept = [u for u in units if u.modality == "text" and not u.offload_activations]
    if kept:
        found.append(Lever(change="offload_activations = true", why="(the layers' inputs in pinned host memory)",
                           where=kept[0].source,
                           apply=each(lambda u: u.modality == "text", checkpoint="full", offload_activations=True)))
    # Host memory: of the offloaded layer inputs keep every second (not under FSDP: a gathered
    # unit cannot run its forward again inside the backward).
    thick = [u for u in units if u.modality == "text" and u.offload_activations and u.offload_keep_every == 1
             and not u.gathers]
    if thick:
        found.append(Lever(change="offload_keep_every = 2", why="(every second layer input in host memory, the others "
                           "regenerated in backward: half the host memory, one more forward of half the layers)",
                           where=thick[0].source,
                           apply=each(lambda u: u.modality == "text" and u.offload_activations and not u.gathers,
                                      offload_keep_every=2)))
    now = f"now ring {recipe.parallel.ring}, ulysses {recipe.parallel.ulysses}"
    for ring in (2, 4, 8):
        if ring > recipe.parallel.ring:
            found.append(Lever(change=f"parallel.ring = {ring} over {ring} GPUs", group="sequence parallelism",
                               why=f"({now}: each rank holds 1/(ring x ulysses) of the sequence)",
                               where=f"{recipe.source} (parallel.ring)",
                               apply=lambda us, s, ring=ring: (us, attrs.evolve(s, ring=max(s.ring, ring)))))
    found.append(Lever(change="a smaller train.micro_batch_tokens", why=f"(now {recipe.train.micro_batch_tokens:,})",
                       where=f"{recipe.source} (train.micro_batch_tokens)"))
    return found


def advice(recipe: Any, units: list) -> list[str]:
    """The levers as sentences for a message: one per group, the rule to edit named."""
    lines, groups = [], set()
    for lever in levers(recipe, units):
        if lever.group and lever.group in groups:
            continue
        groups.add(lever.group)
        lines.append(f"{lever.change} {lever.why} in {_rule(lever.where)}")
    return lines


def _rule(where: str) -> str:
    """The rule to change: the recipe's own, or a new one where weft's default decided."""
    if pathlib.Path(where.rsplit(":", 1)[0]).name == "defaults.toml":
        return f"a shard rule of your own (weft's default rule decides now: {where})"
    return where
