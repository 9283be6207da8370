"""Atomic, self-checking checkpoints through torch.distributed.checkpoint: the trained weights,
optimizer, schedule, RNG, step (frozen weights are rebuilt from the recipe: ``_TRAINED_ONLY``).

A checkpoint is written to ``checkpoints/.tmp-step-N`` and renamed to ``step-N`` by
rank 0 after every rank finished, so a crash mid-save leaves the last good checkpoint
untouched; the newest ``keep`` are kept, and beside them the one ``best.json`` names (the
lowest held-out loss, ``eval.keep_best``). ``manifest.json`` is written last, inside the
temporary folder: the size and CRC-32 of every file (each rank checksums the files it
wrote). A folder without a manifest is not a checkpoint.

Nothing here runs what a checkpoint holds: the step, the schedule and the largest position id
the run had reached are JSON (``meta.json``), the RNG states tensors loaded with
``weights_only=True``, DCP's index and its non-tensor values read by
core/checkpoint/dcp_read.py (an allowlist of DCP's own classes; ``weights_only``). A pickle
planted in a checkpoint is refused, never run, even with the manifest rewritten to match it.

``--resume`` takes the newest checkpoint that passes ``verify`` (core/checkpoint/read.py: every
file present, sizes and checksums matching, checked by the ranks in parallel) and says, in one
line, which newer ones it passed over and why, and which ``step-N`` folders have no manifest
(damaged or planted: never a save of weft's, whose folder gets its name only after its manifest
is written). Each of those is renamed ``step-N.refused-<UTC time>`` before the run goes on, and a
save that finds its ``step-N`` taken renames that one ``step-N.replaced-<UTC time>``: the
evidence is kept, never overwritten or deleted, and the rotation (which counts ``step-N``
names only) never removes it. A save that fails (disk full, permission) removes its
temporary folder, leaves the previous checkpoint as it was, and raises
:class:`CheckpointError`: one paragraph naming the folder, the OS's error (strerror, errno),
the bytes of the state being saved and the space free there.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from weft.core.checkpoint import dcp_read
from weft.core.checkpoint.read import MANIFEST, checkpoint_dirs, describe, saved_positions, unfinished_dirs, verify
from weft.core.errors import EXIT_RUNTIME, WeftError
from weft.core.run.checkpoint_state import os_reason, plain, rng_state, set_rng_state, size_words, state_bytes
from weft.core.run.collectives import any_rank, collective_device, global_max
from weft.core.whole_files import write_json_whole

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.models import PositionWatch

#: Names the checkpoint of the lowest held-out loss (``eval.keep_best``): the rotation keeps it.
BEST = "best.json"
#: What trains, not what is rebuilt: frozen parameters (a frozen unit, the base under adapters,
#: 4-bit weights) are made again from the run's recipe (``model.path`` or the seed) when it
#: resumes or exports, so a checkpoint of a LoRA run holds its adapters and their optimizer
#: states (megabytes), not a copy of the base.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
_LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


class CheckpointError(WeftError):
    """A checkpoint could not be written, or none could be read back."""

    exit_code = EXIT_RUNTIME


def save(*, run_dir: pathlib.Path, step: int, model, optimizer, scheduler, rank: int, keep: int,
         positions: PositionWatch | None = None) -> pathlib.Path:
    """``positions``: the run's watch of the position ids; the ranks' largest so far is kept in
    ``meta.json`` (a resumed run's summary and export then count the steps before it too)."""
    root = run_dir / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
    device = collective_device(next(model.parameters()).device)
    largest = global_max(positions.largest if positions is not None else -1, device=device)
    error, mine = None, {}
    if rank == 0:
        try:
            tmp.mkdir(parents=True)
        except OSError as caught:
            error = caught
    if not any_rank(error is not None, device=device):  # every rank takes the same branch
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))  # raises on every rank
            torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
            mine = {name: describe(tmp / name) for name in _own_files(tmp, rank)}
        except (OSError, RuntimeError, CheckpointException) as caught:
            error = caught
    if any_rank(error is not None, device=device):
        needed = state_bytes(model_sd, optim_sd, device=device)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        previous = checkpoint_dirs(run_dir)
        free = shutil.disk_usage(root if root.exists() else run_dir).free
        raise CheckpointError(
            f"saving the step-{step} checkpoint failed: {os_reason(error)}. The state being saved is "
            f"{size_words(needed)} (every rank's share) and {size_words(free)} are free on that disk. The partial "
            "folder was removed; " + (f"the previous checkpoint {previous[-1]} is intact: free space (or give the "
                                      "run a --run-dir on another disk) and continue with --resume."
                                      if previous else "no earlier checkpoint exists."),
            where=str(tmp))
    described = [None] * dist.get_world_size()
    dist.all_gather_object(described, mine)
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(
            {"step": step, "scheduler": plain(scheduler.state_dict()), "world_size": dist.get_world_size(),
             "largest_position": largest}))
        files = {name: entry for part in described for name, entry in part.items()}
        for path in sorted(tmp.iterdir()):  # DCP's .metadata and meta.json: rank 0's
            files.setdefault(path.name, describe(path))
        # The manifest last: until it exists, the folder is not a checkpoint.
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        if final.exists():  # a folder --resume did not take (or one put there since): kept, not overwritten
            moved = set_aside(final, why="replaced")
            print(f"weft: {final} was there before this save: moved aside to {moved.name}", file=sys.stderr)
        tmp.rename(final)
        _rotate(run_dir, keep=keep)
    dist.barrier()
    return final


def _rotate(run_dir: pathlib.Path, *, keep: int) -> None:
    """The checkpoints past the newest ``keep`` removed, but the best (``best.json``). Only
    ``step-N`` folders with a manifest count: a folder set aside (``set_aside``) is never removed."""
    kept = (best(run_dir) or {}).get("checkpoint")
    for old in checkpoint_dirs(run_dir)[:-keep]:
        if old.name != kept:
            shutil.rmtree(old, ignore_errors=True)


def best(run_dir: pathlib.Path) -> dict | None:
    """``checkpoints/best.json``: the best checkpoint so far (``step``, ``checkpoint``, and its
    ``eval_loss`` or ``eval_accuracy``: eval.best_by), or None."""
    try:
        return json.loads((run_dir / "checkpoints" / BEST).read_text())
    except (OSError, ValueError):
        return None


def mark_best(run_dir: pathlib.Path, *, step: int, rank: int, keep: int, metric: str = "eval_loss",
              value: float | None = None, eval_loss: float | None = None) -> dict:
    """Name ``step-N`` (just saved) the best by ``metric`` (``eval_loss``, ``eval_accuracy``),
    atomically (rank 0), and let the one it supersedes go the way of the rotation."""
    entry = {"step": step, "checkpoint": f"step-{step}", metric: value if value is not None else eval_loss}
    if rank == 0:
        write_json_whole(run_dir / "checkpoints" / BEST, entry, indent=1)
        _rotate(run_dir, keep=keep)
    return entry


def load(*, path: pathlib.Path, model, optimizer, scheduler, rank: int) -> int:
    """Restore a checkpoint in place; returns the step it was taken after."""
    meta = json.loads((path / "meta.json").read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
    # A parameter no gradient reached before the save (the vision tower while every sample so
    # far was text) had no optimizer state then: it gets none now either, as in the run that
    # never stopped (torch's state_dict made one for every parameter, its step already counted).
    saved = set(dcp_read.read_metadata(path).state_dict_metadata)
    stateless = [fqn for fqn in optim_sd["state"] if not any(k.startswith(f"optim.state.{fqn}.") for k in saved)]
    for fqn in stateless:
        del optim_sd["state"][fqn]
    state = {"model": model_sd, "optim": optim_sd}
    dcp_read.load(state, path)  # every trained tensor must be there: DCP raises otherwise
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_LOAD_TRAINED)
    if stateless:
        # The state dict's names drop the wrappers' parts (recomputation's, torch.compile's).
        params = {re.sub(r"(_checkpoint_wrapped_module|_orig_mod)\.", "", name): p
                  for name, p in model.named_parameters()}
        for fqn in stateless:
            optimizer.state.pop(params.get(fqn), None)
    scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng-rank{rank}.pt"
    if rng.is_file() and meta["world_size"] == dist.get_world_size():
        set_rng_state(torch.load(rng, weights_only=True))
    return int(meta["step"])


def resume(ctx: RunContext, *, model, optimizer, scheduler) -> int:
    """``--resume``: the newest good checkpoint restored in place; returns its step. The newer
    ones passed over and the folders without a manifest are named in one line (log and stderr)
    and set aside. The position watch takes the run's largest position so far."""
    path, passed = newest_good(ctx.run_dir, rank=ctx.rank, world=ctx.world_size, device=ctx.device)
    for folder, reason in passed:
        ctx.log.warning("checkpoint.rejected", checkpoint=folder.name, reason=reason)
    if path is None:  # the run stops here: nothing is moved
        found = "; ".join(f"{folder.name}: {reason}" for folder, reason in passed) or "none found"
        raise CheckpointError(f"--resume: no usable checkpoint under {ctx.run_dir / 'checkpoints'} ({found})",
                              where="--resume")
    if passed and ctx.rank == 0:
        # Kept as evidence under another name: the resumed run's saves would otherwise reach step-N
        # and overwrite it, and the rotation would count it.
        moved = [set_aside(folder, why="refused") for folder, _ in passed]
        for (folder, _), aside in zip(passed, moved):
            ctx.log.warning("checkpoint.set_aside", checkpoint=folder.name, moved_to=aside.name)
        print(f"weft: resuming from {path.name}: passed over "
              + "; ".join(f"{folder.name}: {reason} (moved aside to {aside.name})"
                          for (folder, reason), aside in zip(passed, moved)), file=sys.stderr)
    if passed and ctx.world_size > 1:
        dist.barrier()  # every rank sees the folders moved before any save
    step = load(path=path, model=model, optimizer=optimizer, scheduler=scheduler, rank=ctx.rank)
    if ctx.positions is not None:
        ctx.positions.resumed(saved_positions(path))
    ctx.log.info("checkpoint.loaded", path=str(path), step=step)
    return step


def newest_good(run_dir: pathlib.Path, *, rank: int, world: int,
                device: torch.device) -> tuple[pathlib.Path | None, list[tuple[pathlib.Path, str]]]:
    """The newest checkpoint every rank found whole, and (folder, why) for each one passed over:
    the newer ones that failed ``verify`` and every ``step-N`` folder without a manifest, newest first."""
    passed = [(folder, f"it has no {MANIFEST}, so it is no finished save of weft's: not used")
              for folder in unfinished_dirs(run_dir)]
    found = None
    for path in reversed(checkpoint_dirs(run_dir)):
        reason = verify(path, rank=rank, world=world)
        if not any_rank(reason is not None, device=device):
            found = path
            break
        reasons = [None] * world
        dist.all_gather_object(reasons, reason)
        passed.append((path, next(r for r in reasons if r)))
    return found, sorted(passed, key=lambda entry: -_step_of(entry[0]))


def set_aside(folder: pathlib.Path, *, why: str) -> pathlib.Path:
    """``step-N`` renamed ``step-N.<why>-<UTC time>`` (a number added if taken): out of the
    checkpoints' names, so neither a save nor the rotation touches it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = folder.with_name(f"{folder.name}.{why}-{stamp}"), 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.{why}-{stamp}-{n}")
    return folder.rename(target)


def _step_of(folder: pathlib.Path) -> int:
    return int(folder.name.removeprefix("step-"))


def _own_files(folder: pathlib.Path, rank: int) -> list[str]:
    # DCP names each rank's data files __<rank>_<n>.distcp.
    return [p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rng-rank{rank}.pt"]
