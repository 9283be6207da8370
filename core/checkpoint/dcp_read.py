"""Reading a torch.distributed.checkpoint folder without running anything it holds.

DCP keeps two kinds of pickle in a checkpoint: ``.metadata``, its index (which tensor lies in
which file at which offset, with shapes and dtypes), and, inside the ``.distcp`` files, every
value of the state that is not a tensor (an optimizer group's lr, betas, the name of its rule),
each through ``torch.save``. Torch reads the first with plain ``pickle.load`` and the second
with ``torch.load(weights_only=False)``: a file planted in a checkpoint (the manifest's checksums
are no signature: whoever writes the folder can rewrite them) would run whatever its
``__reduce__`` names, on resume, export, eval and generate alike.

Here the index is read by an unpickler that builds only what DCP's index is made of (the
standard library's "restricting globals": ``find_class`` answers from an allowlist; torch's own
weights-only unpickler would serve but refuses the protocol-4 frames DCP writes), and each
value with ``torch.load(weights_only=True)`` before torch's planner sees it. Anything else is
:class:`UnsafeCheckpoint`, naming the file and the class, exit 2 — never a call.

Every read of a checkpoint in weft goes through ``read_metadata``, ``load`` and ``plain_data``
here (tests/test_house_rules.py: no other module calls ``dcp.load``, ``FileSystemReader``,
``pickle`` or ``torch.load`` without ``weights_only=True``).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from weft.core.errors import WeftError

METADATA = ".metadata"  # DCP's index, one per checkpoint (weft never writes rank-local ones)


class UnsafeCheckpoint(WeftError):
    """A checkpoint file holds something other than plain data (a class or call outside DCP's
    own): refused unread, exit 2."""


def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> object: the classes and constants DCP's index is made of. Calling any
    of them builds data (a dataclass, an enum member, a size, a path), nothing else."""
    from torch.distributed.checkpoint import filesystem, metadata

    found = {("torch", "Size"): torch.Size,
             # DCP pickles a layout as a call of this with its name ("torch.strided"): a lookup.
             ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
             ("collections", "OrderedDict"): __import__("collections").OrderedDict,
             # StorageMeta.checkpoint_id: the folder it was saved to.
             ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
             ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
             ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo}
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):
        found[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            found[("torch", name)] = getattr(torch, name)
    return found


class _IndexUnpickler(pickle.Unpickler):
    """DCP's index and nothing else: every global it names must be in the allowlist."""

    def __init__(self, file, *, path: str) -> None:
        super().__init__(file)
        self.path, self.allowed = path, _allowed()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafeCheckpoint(
                f"{self.path} asks to build {module}.{name}, which is not part of a checkpoint's index (only "
                "torch.distributed.checkpoint's metadata classes, torch.Size, dtypes and paths are read): refused "
                "unread, nothing in it ran (a checkpoint weft writes never holds it)",
                where=self.path)
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.path} holds a persistent reference ({str(pid)[:80]!r}); an index has none",
                               where=self.path)


def read_index(file, *, path: str) -> Metadata:
    """DCP's index from an open binary file, built from allowed classes only."""
    try:
        found = _IndexUnpickler(file, path=path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as error:  # noqa: BLE001 - a damaged index is refused like a dangerous one
        raise UnsafeCheckpoint(f"{path} is not a readable checkpoint index ({error.__class__.__name__}: "
                               f"{str(error)[:200]})", where=path) from error
    if not isinstance(found, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(found).__name__}, not a checkpoint index", where=path)
    return found


def plain_value(data: io.BytesIO, *, what: str) -> Any:
    """A non-tensor value of a checkpoint (``torch.save``'d by DCP): numbers, strings,
    containers, dtypes, tensors — ``weights_only``, so nothing is called."""
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpoint(f"{what} is not plain data ({unpickling_reason(error)}): refused unread, nothing in "
                               "it ran", where=what) from error


def plain_file(path: pathlib.Path) -> Any:
    """A small file of tensors and numbers (a rank's RNG state), ``weights_only``: anything else
    is :class:`UnsafeCheckpoint`, nothing in it having run."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpoint(f"{path.name} holds something other than tensors and numbers "
                               f"({unpickling_reason(error)}): refused, nothing in it ran (a checkpoint weft writes "
                               "never holds it)", where=str(path)) from error


def unpickling_reason(error: pickle.UnpicklingError) -> str:
    """What a ``weights_only`` load refused, in weft's words. Torch's own message goes on to
    advise loading the file again with ``weights_only=False`` or allowlisting what it names:
    for a file planted in a checkpoint, that advice is how its code would run, so it is never
    relayed."""
    text = str(error)
    named = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if named:
        return f"it names {named.group(1)}, which is neither a tensor, a number nor a container"
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    if found:
        return re.split(r"\. (?:Please|Use|Re-run)", found.group(1))[0][:200]
    return f"{error.__class__.__name__}: " + (text.splitlines()[0][:120] if text and "weights_only" not in text
                                              else "not a weights-only pickle")


class SafeReader(FileSystemReader):
    """torch's file-system reader, its index read by :func:`read_index`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, METADATA)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_index(stream, path=str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's reader does
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """torch's default load planner, each non-tensor value proved plain data (``weights_only``)
    before torch's own ``load_bytes`` reads it: what loads there with ``weights_only`` names the
    same allowed globals under the full unpickler, so nothing else can run."""

    def __init__(self, *, folder: pathlib.Path) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        plain_value(value, what=f"{self.folder} ({read_item.dest_index.fqn})")
        value.seek(0)
        super().load_bytes(read_item, value)


def read_metadata(path: pathlib.Path) -> Metadata:
    """A checkpoint's index: what it holds, with shapes and dtypes."""
    return SafeReader(str(path)).read_metadata()


def load(state: dict, path: pathlib.Path) -> None:
    """``dcp.load`` of ``state`` from ``path`` (in place, resharded to this process group's
    layout), through the reader and planner above. A refusal on any rank is raised as itself."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(folder=path))
    except CheckpointException as error:  # DCP gathers each rank's exception
        for failure in error.failures.values():
            caught = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(caught, UnsafeCheckpoint):
                raise caught from None
        raise


def plain_data(path: pathlib.Path, *, listed: set[str] | None = None) -> str | None:
    """None when the checkpoint's index and every non-tensor value in it read as plain data,
    and every file the index points at is one of ``listed`` (the manifest's: a file it does not
    list was never checked); else why not. Reads the index and the few small values (bytes),
    not the tensors: a checkpoint is checked before anything is loaded from it (``verify``)."""
    try:
        metadata = read_metadata(path)
        unlisted = sorted({info.relative_path for info in (metadata.storage_data or {}).values()}
                          - (listed if listed is not None else set()))
        if listed is not None and unlisted:
            return f"{METADATA} points at {unlisted[0]}, which its manifest.json does not list"
        for index, info in (metadata.storage_data or {}).items():
            if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue
            if getattr(info, "transform_descriptors", None):
                continue  # a transformed (compressed) value: the planner checks it as it loads
            with (path / info.relative_path).open("rb") as f:
                f.seek(info.offset)
                plain_value(io.BytesIO(f.read(info.length)), what=f"{path / info.relative_path} ({index.fqn})")
    except UnsafeCheckpoint as error:
        return error.message
    except OSError as error:
        return f"{error.__class__.__name__} reading its index: {error}"
    return None
