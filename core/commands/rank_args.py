"""What `weft eval` and `weft generate` hand their ranks, checked first in the parent: the
recipe (or ``--model-dir``'s), ``--run-dir`` / ``--step`` or ``--adapter``, the processor's and
weights' files, then the ranks' arguments. A mistake is a message before any rank starts."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import tempfile
from typing import Any, Callable, Iterator

from weft.core.errors import WeftError


def recipe_from(path: str, overrides: list[str]) -> Any:
    from weft.core.recipe import Recipe

    return Recipe.from_toml(path, overrides=tuple(overrides))


@contextlib.contextmanager
def model_dir_recipe(args: Any) -> Iterator[None]:
    """``--model-dir DIR``: a recipe of just ``model.path = DIR``, written into a temporary folder
    (which outlives the ranks), becomes the command's recipe while the context lasts. A WeftError
    raised meanwhile (the parent's checks, a rank's noted error) names ``--model-dir DIR``, the
    folder the user gave, where it would name that temporary file."""
    if (args.recipe is None) == (args.model_dir is None):
        raise WeftError("give a recipe or --model-dir, not both" if args.recipe else "give a recipe or --model-dir",
                        where="--model-dir")
    if args.model_dir is None:
        yield
        return
    from weft.core.model_source import local_model_dir

    given = str(args.model_dir)
    local = local_model_dir(given, base=pathlib.Path.cwd(), revision=None, where="--model-dir")
    if not (local / "config.json").is_file():
        raise WeftError(f"{args.model_dir} has no config.json; --model-dir takes a Hugging Face model directory, a "
                        "Hub id in the local Hugging Face cache or a .gguf file", where="--model-dir")
    with tempfile.TemporaryDirectory() as folder:
        recipe = pathlib.Path(folder) / "model-dir.toml"
        # A local path made absolute (the recipe lives elsewhere); a Hub id as given.
        path = str(args.model_dir.resolve()) if args.model_dir.exists() else given
        recipe.write_text(f"[model]\npath = {json.dumps(path)}\n")
        args.recipe = str(recipe)
        try:
            yield
        except WeftError as error:
            _name_the_folder(error, recipe=recipe, flag=f"--model-dir {args.model_dir}")
            raise


def _name_the_folder(error: WeftError, *, recipe: pathlib.Path, flag: str) -> None:
    """``error``'s words with ``flag`` in place of the temporary recipe (its line number, and the
    ``(model.path)`` that the flag already says, with it), in place."""
    # The longer first: one may hold the other (/tmp/x in /private/tmp/x).
    paths = sorted({str(recipe), str(recipe.resolve())}, key=len, reverse=True)
    pattern = re.compile("|".join(rf"{re.escape(path)}(?::\d+)?(?: \(model\.path\))?" for path in paths))

    def swap(text: str | None) -> str | None:
        return None if text is None else pattern.sub(lambda _: flag, text)

    error.where, error.message = swap(error.where), swap(error.message)
    error.args = (swap(str(error)), *error.args[1:])


def for_ranks(args: Any, overrides: list[str], options: dict, *,
              needs: Callable[[Any], dict]) -> tuple[Any, list[str]]:
    """Check what the ranks need, then their arguments: the recipe is read here first, so
    its mistakes are messages before any rank starts. ``needs(recipe)``: what the command
    reads from the processor folder (core/run/model_files.py)."""
    if args.step is not None and args.run_dir is None:
        raise WeftError("--step picks a checkpoint of --run-dir; give --run-dir too", where="--step")
    if args.run_dir is not None and not (args.run_dir / "checkpoints").is_dir():
        raise WeftError(f"{args.run_dir} has no checkpoints/ folder; --run-dir takes a weft run directory",
                        where="--run-dir")
    if args.adapter is not None:
        _check_adapter_dir(args)
        options = {**options, "adapter_dir": str(args.adapter.resolve())}
    recipe = recipe_from(args.recipe, overrides)
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.run.model_files import check_processor_files, check_weight_files, reads_images

    config, processor = plugin_manager_from_env().models.for_recipe(recipe).config(recipe)
    check_processor_files(recipe, processor, needs=needs(recipe), vision=reads_images(config))
    check_weight_files(recipe)  # read by every rank, with --run-dir too (its checkpoint's weights replace them)
    given = [args.recipe, *(a for o in overrides for a in ("--set", o)), "--options", json.dumps(options)]
    if args.run_dir is not None:
        given += ["--run-dir", str(args.run_dir.resolve())] + (["--step", str(args.step)] if args.step else [])
    return recipe, given


def _check_adapter_dir(args: Any) -> None:
    if args.run_dir is not None:
        raise WeftError("--adapter gives the adapters' weights, --run-dir a run's: give one of them", where="--adapter")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (args.adapter / name).is_file():
            raise WeftError(f"{args.adapter} has no {name}; --adapter takes a PEFT adapter directory "
                            "(adapter_config.json and adapter_model.safetensors, as `weft export` writes for a LoRA "
                            "run)", where="--adapter")
