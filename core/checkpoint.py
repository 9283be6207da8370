"""Atomic checkpoints through torch.distributed.checkpoint: model, optimizer, schedule, RNG, step.

A checkpoint is written to ``checkpoints/.tmp-step-N`` and renamed to ``step-N``
by rank 0 after every rank finished, so a crash mid-save leaves the last good
checkpoint untouched; the newest ``keep`` are kept.
"""

from __future__ import annotations

import pathlib
import random
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(run_dir: pathlib.Path) -> list[pathlib.Path]:
    root = run_dir / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step-*")
             if (m := _STEP.match(p.name)) and (p / "meta.pt").is_file()]
    return [p for _, p in sorted(found)]


def save(*, run_dir: pathlib.Path, step: int, model, optimizer, scheduler, rank: int, keep: int) -> pathlib.Path:
    root = run_dir / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        # meta.pt is written last: a folder without it is not a checkpoint.
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "world_size": dist.get_world_size()},
                   tmp / "meta.pt")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(*, path: pathlib.Path, model, optimizer, scheduler, rank: int) -> int:
    """Restore a checkpoint in place; returns the step it was taken after."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = torch.load(path / "meta.pt", weights_only=False)
    scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng-rank{rank}.pt"
    if rng.is_file() and meta["world_size"] == dist.get_world_size():
        _set_rng_state(torch.load(rng, weights_only=False))
    return int(meta["step"])


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
