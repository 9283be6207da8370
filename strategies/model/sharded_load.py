"""Load a Hugging Face safetensors checkpoint into an already sharded model, shard by shard.

Each rank reads only the rows of each tensor that its FSDP shard holds (safetensors'
``get_slice`` reads just those bytes), so a model never sits whole in one process.
Checkpoints saved by transformers use the legacy names of vision-language models
(``model.layers.*``, ``visual.*``) while the classes name them
``model.language_model.*`` and ``model.visual.*``: both spellings are looked up.
"""

from __future__ import annotations

import json
import pathlib
from typing import Callable

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

#: (prefix in the model, prefix in checkpoints saved by transformers), tried in order.
RENAMES: tuple[tuple[str, str], ...] = (("model.language_model.", "model."), ("model.visual.", "visual."))


def checkpoint_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names: dict[str, pathlib.Path] = {}
    for file in files:
        with _open(file) as handle:
            names.update({name: file for name in handle.keys()})
    return names


def _open(file: pathlib.Path):
    """safe_open, with an error that names the file (a truncated download, a wrong file)."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError, OSError, ...
        raise ValueError(f"{file} is not a readable safetensors file ({type(error).__name__}: {error})") from None


#: PEFT's adapter layers keep the layer they wrap as ``base_layer``: its weights are the
#: checkpoint's under the layer's own name. Their adapters (``lora_A``, ``lora_B``) are not in a
#: base checkpoint: the adapter hook fills them after the base's weights are loaded.
BASE_LAYER = ".base_layer."
ADAPTER_PART = ".lora_"


def source_name(name: str, available: dict) -> str | None:
    name = name.replace(BASE_LAYER, ".")
    if name in available:
        return name
    for ours, theirs in RENAMES:
        if name.startswith(ours) and theirs + name[len(ours):] in available:
            return theirs + name[len(ours):]
    return None


def load_sharded(model: torch.nn.Module, path: pathlib.Path, *, tied: dict[str, str] | None = None,
                 include: Callable[[str], bool] | None = None, name_map: Callable[[str], str] | None = None) -> int:
    """Copy every parameter and persistent buffer of ``model`` from the checkpoint at ``path``.

    ``tied``: model name -> name of the tensor it shares (tied embeddings), used when the
    checkpoint leaves the tied copy out; ``include``: only the tensors whose name it accepts
    (one unit's, strategies/model/materialize.py); ``name_map``: a model name to the name it
    has in the files (a PEFT adapter directory's). Returns the number of tensors loaded.
    """
    available = checkpoint_files(path)
    handles: dict[pathlib.Path, object] = {}
    missing = []
    loaded = 0
    persistent = {name for name, _ in model.named_buffers()} - _non_persistent(model)
    targets = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    if include is not None:
        targets = [(n, t) for n, t in targets if include(n)]
    for model_name, tensor in targets:
        name = name_map(model_name) if name_map is not None else model_name
        if ADAPTER_PART in name and source_name(name, available) is None and name_map is None:
            continue  # an adapter's own parameter, filled by its init after the base's weights
        source = source_name(name, available) or (source_name(tied[name], available) if tied and name in tied else None)
        if source is None:
            missing.append(model_name)
            continue
        file = available[source]
        handle = handles.get(file) or handles.setdefault(file, _open(file))
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                shape, offset = compute_local_shape_and_global_offset(
                    tensor.shape, tensor.device_mesh, tensor.placements
                )
                if local.numel():
                    rows = handle.get_slice(source)[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                    local.copy_(rows.to(local.dtype))
            else:
                tensor.copy_(handle.get_tensor(source).to(tensor.dtype))
        loaded += 1
    if missing:
        example = ", ".join(sorted(available)[:3])
        raise KeyError(
            f"{len(missing)} tensors of the model are not in {path}: {', '.join(missing[:5])}...; "
            f"the checkpoint holds e.g. {example}"
        )
    return loaded


def _non_persistent(model: torch.nn.Module) -> set[str]:
    names = set()
    for module_name, module in model.named_modules():
        for buffer in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{module_name}.{buffer}" if module_name else buffer)
    return names


def reset_non_persistent_buffers(model: torch.nn.Module) -> int:
    """Recompute rotary tables after ``to_empty`` (their memory is uninitialised there).

    transformers' own ``_init_weights`` knows each rotary embedding's formula; it is
    called only on those modules, which hold no parameters.
    """
    count = 0
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and module._non_persistent_buffers_set:
            model._init_weights(module)
            count += 1
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point() and not torch.isfinite(buffer).all():
            raise RuntimeError(
                f"buffer {name} is not initialised after loading; this transformers version does not recompute it"
            )

    return count
