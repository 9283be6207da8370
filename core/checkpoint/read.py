"""Checkpoint reading: which checkpoints a run holds, whether one is whole and plain data (its
manifest's sizes and CRC-32s, its metadata read as data), and its tensors into a model — for
``--resume`` (core/run/checkpoint.py), `weft export`, and `weft eval` / `weft generate
--run-dir`. Every pickle a checkpoint holds is read through dcp_read.py.

A checkpoint is a folder ``checkpoints/step-N`` with ``manifest.json`` written last (the size
and CRC-32 of every file): a folder without a manifest is not a checkpoint (``--resume`` names
it: ``unfinished_dirs``). Every command that reads a checkpoint checks the manifest of the files
it reads, sizes and CRC-32s: ``--resume`` passes a damaged one over to the one before it,
`weft export`, `weft eval --run-dir` and `weft generate --run-dir` refuse it (exit 2, naming the
file and the checkpoints to take instead): they were pointed at that checkpoint, and quietly
using another would export or score weights nobody asked for.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from weft.core.checkpoint import dcp_read
from weft.core.errors import WeftError

_STEP = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"


def checkpoint_dirs(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Finished checkpoints (a manifest present), oldest first. Not yet verified: see ``verify``."""
    return [p for p in _step_dirs(run_dir) if (p / MANIFEST).is_file()]


def unfinished_dirs(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """``step-N`` folders without a manifest, oldest first: not checkpoints (a save renames its
    folder to ``step-N`` only after the manifest is written), so damaged or planted."""
    return [p for p in _step_dirs(run_dir) if p.is_dir() and not (p / MANIFEST).is_file()]


def _step_dirs(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every ``checkpoints/step-N`` entry, by step."""
    found = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").glob("step-*") if (m := _STEP.match(p.name))]
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
    rank): the caller combines the ranks' answers. What is read to decide is read as plain data,
    and every file a reader opens must be one the manifest lists."""
    try:
        files = _manifest_files(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable {MANIFEST} ({error})"
    entries = sorted(files.items())
    for name, want in entries:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {want['size']}"
    rng = f"rng-rank{rank}.pt"
    for name in (".metadata", "meta.json") + ((rng,) if (path / rng).is_file() else ()):
        if name not in files:
            return f"{name} is not in its {MANIFEST} (a file weft's saves always list)"
    if checksums:
        mine = [(name, want) for index, (name, want) in enumerate(entries) if index % world == rank]
        for (name, want), got in zip(mine, _crc32s([path / name for name, _ in mine])):
            if got != want["crc32"]:
                return (f"{name} does not match its checksum (CRC-32 {got:08x}, the manifest says "
                        f"{want['crc32']:08x}): it changed after the save")
    try:
        json.loads((path / "meta.json").read_text())["step"]
    except Exception as error:  # noqa: BLE001 - any failure to read it plainly refuses the checkpoint
        return f"meta.json is not readable ({error.__class__.__name__}: {_first_line(error)})"
    if (path / rng).is_file():
        try:  # The manifest is no signature: what is read here must also be plain data.
            dcp_read.plain_file(path / rng)
        except dcp_read.UnsafeCheckpoint as error:
            return error.message
        except Exception as error:  # noqa: BLE001 - any failure to read it plainly refuses the checkpoint
            return f"{rng} is not readable ({error.__class__.__name__}: {_first_line(error)})"
    return dcp_read.plain_data(path, listed=set(files))  # DCP's index and its non-tensor values


def _manifest_files(path: pathlib.Path) -> dict[str, dict]:
    """The manifest's ``files``: plain names (no folders) to integer sizes and CRC-32s."""
    files = json.loads((path / MANIFEST).read_text())["files"]
    for name, want in files.items():
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise ValueError(f"it names {str(name)[:80]!r}, not a file of the folder")
        if not (isinstance(want["size"], int) and isinstance(want["crc32"], int)):
            raise TypeError(f"{name}'s size and crc32 are not integers")
    return files


def _crc32s(paths: list[pathlib.Path]) -> list[int]:
    """The files' CRC-32s, several read at once (zlib and the reads let go of the GIL): a 7B
    run's checkpoint is tens of GB, so checking it is bound by the disk, not one core."""
    if len(paths) < 2:
        return [crc32(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(crc32, paths))


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0][:200] if str(error) else ""


def saved_positions(path: pathlib.Path) -> int:
    """The largest position id the run had reached when ``path`` was saved; -1 when unknown
    (a checkpoint from before weft kept it)."""
    largest = json.loads((path / "meta.json").read_text()).get("largest_position", -1)
    return largest if isinstance(largest, int) else -1


class CheckpointRefused(WeftError):
    """A checkpoint a command was pointed at is not whole or not plain data (exit 2)."""


def refuse_unless_sound(path: pathlib.Path) -> None:
    """For the commands that read one checkpoint (export, eval, generate): every file present at
    its size and CRC-32 (each rank of a process group checking its share, the answers
    combined: every rank raises alike), the metadata plain data, or :class:`CheckpointRefused`
    saying why and which checkpoints to take instead. Every byte is read: the weights lie in
    the same DCP files as the optimizer's states, so a 7B run's check costs a read of its
    checkpoint (tens of GB; the files are read in parallel)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    reason = verify(path, rank=rank, world=world)
    if world > 1:
        reasons = [None] * world
        dist.all_gather_object(reasons, reason)
        reason = next((r for r in reasons if r), None)
    if reason is not None:
        others = [p.name for p in checkpoint_dirs(path.parent.parent) if p != path]
        instead = (f"the run's other checkpoints are {', '.join(others)}: --step "
                   f"{others[-1].removeprefix('step-')} reads the newest of them" if others
                   else "the run has no other checkpoint")
        raise CheckpointRefused(
            f"this checkpoint is refused: {reason}. Nothing was loaded from it; {instead} (`weft run --resume` "
            "passes a damaged checkpoint over to the newest whole one by itself).", where=str(path))


def load_checkpoint_into(model: torch.nn.Module, path: pathlib.Path, *, verified: bool = False) -> None:
    """Fill a plain (unsharded) model with a checkpoint's weights, any saving world size, in
    the dtypes they were saved in (a bf16 rule stays bf16 in the export). ``verified``: the
    caller already ran :func:`refuse_unless_sound` (each check reads every byte)."""
    if not verified:
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
