"""The files a run reads from its model directory and processor folder, checked before any rank starts.

Weights: ``model.path``'s safetensors, one file or the shards its
``model.safetensors.index.json`` lists; a shard the index names but the directory lacks (an
interrupted download) is named here, not found by every rank as it reads.

A model directory as downloaded is the processor folder too (unless ``model.processor``
names another): the tokenizer's files and the image processor's ``preprocessor_config.json``.
A directory that lacks one the data or the prompt needs would otherwise fail inside every
rank with transformers' OSError and a traceback; here it is one message naming the file,
the key that points at the folder, and what needs it (exit 2).

A directory's files are read as data, never as code: an ``auto_map`` (in config.json,
tokenizer_config.json or preprocessor_config.json) names the directory's own Python classes,
which weft never imports (``trust_remote_code`` is never true). Where transformers ships the
class itself (the file's model_type, tokenizer_class or image_processor_type, or the model's
config) the auto_map is ignored; where only the directory's code could read the file, that is
one message naming the file and its auto_map (exit 2), not transformers' advice to pass
``trust_remote_code=True``.

What needs what mirrors how the data is read (plugins/batching/samples.py, the prompt of `weft
generate`): chat conversations (``data.source = "jsonl"``, or synthetic without
``data.tokens``) go through the tokenizer and the image processor; long synthetic samples
(``data.tokens``) read the tokenizer of a folder that has one, and for ``data.images`` /
``data.videos`` the image processor with the tokenizer; a text prompt needs both. Bundled processor names
("tiny_vl") ship complete and are not checked.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib
from typing import Any

from weft.core.errors import WeftError

#: The files that may name a directory's own code, with the auto class each is read by and the key
#: that names transformers' own class in it.
OWN_CODE = {"config.json": ("AutoConfig", "model_type"), "tokenizer_config.json": ("AutoTokenizer", "tokenizer_class"),
            "preprocessor_config.json": ("AutoImageProcessor", "image_processor_type")}
#: Any one of these is a tokenizer: a fast tokenizer, a BPE vocabulary (with merges.txt),
#: a SentencePiece model.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
IMAGE_PROCESSOR = "preprocessor_config.json"


def data_needs(recipe: Any) -> dict[str, str]:
    """``{"tokenizer" | "image processor": why}`` for the recipe's data."""
    data = recipe.data
    if data.source == "synthetic" and data.tokens:
        if data.images or data.videos:
            why = ("data.images / data.videos with data.tokens (long synthetic samples whose images go through "
                   "the image processor, read with the tokenizer)")
            return {"tokenizer": why, "image processor": why}
        return {}
    why = ("data.source = 'jsonl' (chat conversations through the tokenizer and the image processor)"
           if data.source == "jsonl" else
           "data.source = 'synthetic' (chat conversations about generated images, through the tokenizer and "
           "the image processor)")
    return {"tokenizer": why, "image processor": why}


def prompt_needs() -> dict[str, str]:
    why = "`weft generate --prompt` (a user turn encoded through the tokenizer and the image processor)"
    return {"tokenizer": why, "image processor": why}


def reads_images(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower's
    config): a text-only model's folder needs no image processor, and has none."""
    return getattr(config, "vision_config", None) is not None


def check_processor_files(recipe: Any, processor: str | None, *, needs: dict[str, str], vision: bool = True) -> None:
    """One WeftError naming the first file the folder lacks; nothing when it has them.
    ``vision`` false (a text-only model, ``reads_images``): no image processor is asked for."""
    if not vision:
        needs = {k: v for k, v in needs.items() if k != "image processor"}
    if processor is None or not needs or _bundled(processor):
        return
    folder = pathlib.Path(processor).resolve()
    key = "model.processor" if recipe.model.processor else "model.path"
    where = f"{recipe.source} ({key})"
    if not folder.is_dir():
        raise WeftError(f"{key} {str(folder)!r} is not a folder", where=where)
    hint = (f"copy it from the model's Hub repository into {folder}, or set model.processor to a folder "
            "that has the processor's files")
    if "image processor" in needs and not (folder / IMAGE_PROCESSOR).is_file():
        raise WeftError(f"{folder} has no {IMAGE_PROCESSOR} (the image processor's settings), which "
                        f"{needs['image processor']} needs; {hint}", where=where)
    if "tokenizer" in needs and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise WeftError(f"{folder} has no tokenizer ({' or '.join(TOKENIZER_FILES)}), which {needs['tokenizer']} "
                        f"needs; {hint}", where=where)
    for name in ("tokenizer_config.json", "preprocessor_config.json"):
        if (name == "tokenizer_config.json" or "image processor" in needs) and _names_own_code(folder / name):
            _check_native(folder, name, where=where)


def _names_own_code(file: pathlib.Path) -> bool:
    try:
        return file.is_file() and "auto_map" in json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False  # not JSON, or not an object: the rank's reading of it says so


def _check_native(folder: pathlib.Path, name: str, *, where: str) -> None:
    """Read the file as the ranks will, with transformers' own classes only (rare: an auto_map is
    there); transformers refusing for want of the directory's code becomes weft's message. Any
    other failure is left to the ranks, which report it as they always have."""
    import transformers

    auto = getattr(transformers, OWN_CODE[name][0])
    extra = {"backend": "pil"} if name == "preprocessor_config.json" else {}  # as the ranks read it
    try:
        auto.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False, **extra)
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise own_code_error(folder / name, where=where) from None
    except Exception:  # not this check's business (see above)
        pass


def own_code_error(file: pathlib.Path, *, where: str) -> WeftError:
    """The message for ``file`` whose ``auto_map`` names code transformers does not ship."""
    auto, key = OWN_CODE[file.name]
    try:
        given = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        given = {}
    given = given if isinstance(given, dict) else {}
    mapped = given.get("auto_map")
    named = mapped.get(auto, mapped) if isinstance(mapped, dict) else mapped
    native = f"{key} {given[key]!r} is not one of transformers' classes" if given.get(key) else f"it gives no {key}"
    return WeftError(
        f"{file}: auto_map names the directory's own code ({auto}: {named}) and {native}, so only that code could "
        "read it; weft never runs a model directory's code (trust_remote_code is never true). Accepted: a "
        "directory whose config, tokenizer and image processor transformers ships (model_type, tokenizer_class and "
        "image_processor_type naming transformers' own classes; an auto_map beside them is ignored)", where=where)


def _bundled(processor: str) -> bool:
    """A bare name of a folder shipped in weft.recipes, which is read before any path of that
    name (strategies/data/conversation.py's processor_dir)."""
    if os.sep in processor or "/" in processor:
        return False
    return (importlib.resources.files("weft.recipes") / processor).is_dir()


def check_weight_files(recipe: Any) -> None:
    """``model.path`` has its safetensors: every shard its index names, or one file at least."""
    if recipe.model.path is None:
        return
    folder = recipe.model_dir().resolve()
    where = f"{recipe.source} (model.path)"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise WeftError(f"{index} is not a safetensors index (a weight_map of tensor names to files): "
                            f"{type(error).__name__}: {error}", where=where) from None
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise WeftError(f"{folder} lacks {len(missing)} of the {len(shards)} weight files its "
                            f"model.safetensors.index.json lists: {', '.join(missing[:4])}"
                            f"{', ...' if len(missing) > 4 else ''} (an interrupted download?); download them again",
                            where=where)
    elif not any(folder.glob("*.safetensors")):
        others = sorted(p.name for p in folder.glob("*.bin"))[:2]
        found = f"; it has {', '.join(others)}: weft reads safetensors only" if others else ""
        raise WeftError(f"{folder} has no model.safetensors (nor shards with model.safetensors.index.json){found}",
                        where=where)
