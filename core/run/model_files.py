"""The files a run reads from its model directory and processor folder, checked before any rank starts.

Weights: ``model.path``'s safetensors, one file or the shards its
``model.safetensors.index.json`` lists; a shard the index names but the directory lacks (an
interrupted download) is named here, not found by every rank as it reads.

A model directory as downloaded is the processor folder too (unless ``model.processor``
names another): the tokenizer's files and the image processor's ``preprocessor_config.json``.
A directory that lacks one the data or the prompt needs would otherwise fail inside every
rank with transformers' OSError and a traceback; here it is one message naming the file,
the key that points at the folder, and what needs it (exit 2).

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


def check_processor_files(recipe: Any, processor: str | None, *, needs: dict[str, str]) -> None:
    """One WeftError naming the first file the folder lacks; nothing when it has them."""
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
