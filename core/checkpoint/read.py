"""Checkpoint reading: which checkpoints a run holds, whether one is whole and plain data (its
manifest's sizes and CRC-32s, its metadata read as data), and its tensors into a model — for
``--resume`` (core/run/checkpoint.py), `weft export`, and `weft eval` / `weft generate
--run-dir`. Every pickle a checkpoint holds is read through dcp_read.py.

A checkpoint is a folder ``checkpoints/step-N`` with ``manifest.json`` written last (the size
and CRC-32 of every file): a folder without a manifest is not a checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import re
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from weft.core.checkpoint import dcp_read
from weft.core.errors import WeftError

_STEP = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"


def checkpoint_dirs(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Finished checkpoints (a manifest present), oldest first. Not yet verified: see ``verify``."""
    root = run_dir / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step-*")
             if (m := _STEP.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def describe(path: pathlib.Path) -> dict:
    """A file's manifest entry: its size and CRC-32."""
    return {"size": path.stat().st_size, "crc32": crc32(path)}


def crc32(path: pathlib.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify(path: pathlib.Path, *, rank: int = 0, world: int = 1, checksums: bool = True) -> str | None:
    """None when ``path`` is whole; else why not. Sizes are checked here for every file,
    checksums (unless ``checksums`` is False) for this rank's share (files i with i % world ==
    rank): the caller combines the ranks' answers. What is read to decide is read as plain data."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable {MANIFEST} ({error})"
    for index, (name, want) in enumerate(sorted(files.items())):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {want['size']}"
        if checksums and index % world == rank and crc32(file) != want["crc32"]:
            return f"{name} does not match its checksum"
    try:
        # The manifest is no signature: what is read here must also be plain data.
        json.loads((path / "meta.json").read_text())["step"]
        rng = path / f"rng-rank{rank}.pt"
        if rng.is_file():
            torch.load(rng, weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to read it plainly refuses the checkpoint
        return f"{error.__class__.__name__} reading its metadata or rng-rank{rank}.pt (only tensors and numbers " \
               f"are loaded, never pickled objects): {str(error).splitlines()[0][:200] if str(error) else ''}"
    return dcp_read.plain_data(path)  # DCP's index and its non-tensor values: plain data or refused


def saved_positions(path: pathlib.Path) -> int:
    """The largest position id the run had reached when ``path`` was saved; -1 when unknown
    (a checkpoint from before weft kept it)."""
    largest = json.loads((path / "meta.json").read_text()).get("largest_position", -1)
    return largest if isinstance(largest, int) else -1


class CheckpointRefused(WeftError):
    """A checkpoint a command was pointed at is not whole or not plain data (exit 2)."""


def refuse_unless_sound(path: pathlib.Path) -> None:
    """For the commands that read one checkpoint (export, eval, generate): every file present at
    its size, the metadata plain data, or :class:`CheckpointRefused` saying why. The checksums
    are left to ``--resume`` (reading every byte of a 7B run's optimizer states to export its
    weights would cost minutes); the refusal of code does not depend on them."""
    reason = verify(path, checksums=False)
    if reason is not None:
        raise CheckpointRefused(f"this checkpoint is refused: {reason}", where=str(path))


def load_checkpoint_into(model: torch.nn.Module, path: pathlib.Path) -> None:
    """Fill a plain (unsharded) model with a checkpoint's weights, any saving world size, in
    the dtypes they were saved in (a bf16 rule stays bf16 in the export)."""
    refuse_unless_sound(path)
    saved = dcp_read.read_metadata(path).state_dict_metadata
    for name, param in model.named_parameters():
        meta = saved.get(f"model.{name}")
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if dtype is not None and dtype != param.dtype:
            param.data = param.data.to(dtype)
    # Frozen weights are not in a checkpoint (core/run/checkpoint.py): the model as built holds
    # them; everything that trains must be there.
    wanted = {k: v for k, v in get_model_state_dict(model).items() if f"model.{k}" in saved}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trained - set(wanted))
    if missing:
        raise WeftError(f"checkpoint {path} lacks {len(missing)} trained tensors of this model, e.g. {missing[:3]}",
                        where=str(path))
    state = {"model": wanted}
    dcp_read.load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))


def load_run_weights(model: Any, run_dir: pathlib.Path, step: int | None) -> str:
    """A weft run's checkpoint (the newest, or step ``step``) into this plan's model."""
    found = [p for p in checkpoint_dirs(run_dir) if step is None or p.name == f"step-{step}"]
    if not found:
        raise WeftError(f"no checkpoint{f' for step {step}' if step is not None else ''} under "
                        f"{run_dir / 'checkpoints'}", where="--run-dir")
    try:
        load_checkpoint_into(model, found[-1])
    except WeftError:  # a refused checkpoint (damaged, or not plain data) says so itself
        raise
    except Exception as error:  # noqa: BLE001 - DCP's errors name keys, not the user's mistake
        raise WeftError(f"{found[-1]} does not fit this recipe's model ({error.__class__.__name__}: "
                        f"{str(error).splitlines()[0][:200] if str(error) else ''}); evaluate with the recipe the "
                        "run trained (its recipe.json)", where="--run-dir") from error
    return str(found[-1])
