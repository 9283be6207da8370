"""Recipes: TOML files parsed into frozen attrs classes, with includes and --set overrides.

Pure: imports no torch, so `weft plan` and the validation of a recipe happen before
any process group exists.
"""

from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any, Literal

import attrs

from weft.core.errors import RecipeError
from weft.core.recipe.convert import Where, build, did_you_mean, in_range
from weft.core.recipe.data import DataSection, EvalSection, _doc
from weft.core.recipe.presets import is_preset_path, preset_names, typed_path
from weft.core.recipe.syntax import Rule, bundled_path, load_includes, parse_rules, parse_toml, read_toml_text
from weft.core.recipe.train import TrainSection

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 is not supported, kept for clarity
    import tomli as tomllib


@attrs.frozen(kw_only=True)
class ModelSection:
    path: str | None = attrs.field(default=None, metadata=_doc(
        "the model: a Hugging Face directory, a Hub id (org/name) in the local Hugging Face cache, or a .gguf file "
        "(converted once into weft's cache); docs/models.md"))
    revision: str | None = attrs.field(default=None, metadata=_doc(
        "with a Hub id in model.path: the branch, tag or commit in the local cache (default main)"))
    preset: str | None = attrs.field(default=None, metadata=_doc("random init of a named shape (recipes/presets)"))
    processor: str | None = attrs.field(default=None, metadata=_doc(
        "processor folder (a path relative to the recipe, as model.path) or bundled name; default: the model's"))
    rope_scaling: Literal["none", "yarn", "linear", "dynamic"] = attrs.field(default="none", metadata=_doc(
        "text decoder's rotary scaling: none (as the model ships), yarn, linear or dynamic (NTK); a rope rule too"))
    rope_factor: float = attrs.field(default=1.0, validator=in_range(low=1.0, high=64.0),
                                     metadata=_doc("scaling factor: the context grows to rope_original_max x this"))
    rope_original_max: int = attrs.field(default=0, validator=in_range(low=0),
                                         metadata=_doc("positions the model was trained on; 0 = from its config"))

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.preset is None):
            raise ValueError("set exactly one of model.path (a local HF directory) or model.preset (a named shape)")
        if self.revision is not None and self.path is None:
            raise ValueError("model.revision names a revision of model.path's Hub id; this recipe gives no model.path")
        if self.rope_scaling != "none" and self.rope_factor <= 1.0:
            raise ValueError(f"model.rope_scaling = {self.rope_scaling!r} needs model.rope_factor above 1 (got "
                             f"{self.rope_factor:g}); a run's warning 'positions.beyond_trained' names the factor")
        if self.rope_scaling == "none" and self.rope_factor != 1.0:
            raise ValueError(f"model.rope_factor = {self.rope_factor:g} does nothing "
                             "without model.rope_scaling (yarn, linear or dynamic)")


@attrs.frozen(kw_only=True)
class ParallelSection:
    nproc: int = attrs.field(default=1, validator=in_range(low=1),
                             metadata=_doc("local processes `weft run` starts (not under torchrun); --nproc overrides"))
    dp_replicate: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("HSDP replicas"))
    dp_shard: int = attrs.field(default=-1, validator=in_range(low=-1),
                                metadata=_doc("FSDP shard degree; -1 = what is left"))
    ulysses: int | Literal["auto"] = attrs.field(default=1,
                                                 metadata=_doc("Ulysses (head all-to-all) degree, or 'auto'"))
    ring: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("ring attention degree"))
    backend: Literal["auto", "gloo", "nccl"] = attrs.field(default="auto",
                                                           metadata=_doc("process-group backend; auto = nccl on GPU"))
    device: Literal["auto", "cpu", "cuda"] = attrs.field(default="auto",
                                                         metadata=_doc("where to train; auto = cuda if present"))
    expandable_segments: bool = attrs.field(default=True, metadata=_doc(
        "CUDA allocator grows its segments instead of fragmenting (torch's expandable_segments); "
        "a PYTORCH_CUDA_ALLOC_CONF of your own wins"))
    timeout_s: float = attrs.field(default=1800.0, validator=in_range(low=1.0), metadata=_doc(
        "seconds a training step may last before weft names the ranks that stopped responding and ends the run "
        "(the first step includes compilation); multi-rank runs only"))

    def __attrs_post_init__(self) -> None:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard = 0 is not accepted; use a positive degree or -1 (fill)")
        if isinstance(self.ulysses, int) and self.ulysses < 1:
            raise ValueError(f"parallel.ulysses = {self.ulysses} is out of range; accepted: >= 1 or 'auto'")


@attrs.frozen(kw_only=True)
class Recipe:
    model: ModelSection
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    parallel: ParallelSection = ParallelSection()
    eval: EvalSection = EvalSection()
    rules: tuple[Rule, ...] = ()
    source: str = "<memory>"
    raw: dict = attrs.field(factory=dict, eq=False, repr=False)  # the merged TOML data, for the run dir

    @classmethod
    def from_toml(cls, path: str | pathlib.Path, *, overrides: tuple[str, ...] = ()) -> "Recipe":
        path = pathlib.Path(path)
        if not path.exists() and len(path.parts) == 1:
            # A bare name of a bundled recipe: `weft run tiny-vl` (or qwen2.5-vl-7b-32k-1gpu,
            # whose dot is no suffix) from any folder.
            path = bundled_path(path.name if path.name.endswith(".toml") else f"{path.name}.toml") or path
        text = read_toml_text(path, what="recipe")
        data = parse_toml(text, path)
        overridden = {}
        for override in overrides:
            apply_override(data, override)
            overridden[override.partition("=")[0].strip()] = override.strip()
        return cls.from_dict(data, source=str(path), text=text, overridden=overridden)

    @classmethod
    def from_dict(
        cls, data: Any, *, source: str = "<memory>", text: str | None = None, overridden: dict[str, str] | None = None
    ) -> "Recipe":
        """``overridden``: dotted key -> the ``--set`` text that set it, for error locations."""
        where = Where(source, text, overridden=overridden)
        if not isinstance(data, dict):
            raise RecipeError("a recipe must be a table of sections", where=source)
        known = ("include", "model", "data", "train", "parallel", "eval", "rules")
        for key in data:
            if key not in known:
                raise RecipeError(
                    f"unknown section {key!r}{did_you_mean(key, known)} Accepted: {', '.join(known)}",
                    where=where.at(key),
                )
        if "model" not in data:
            raise RecipeError("the [model] section is missing; give model.preset or model.path", where=source)
        model = build(ModelSection, data["model"], where=where, prefix="model")
        _check_preset(model, where=where)
        sections = {
            name: build(klass, data.get(name, {}), where=where, prefix=name)
            for name, klass in (("data", DataSection), ("train", TrainSection), ("parallel", ParallelSection))
        }
        sections["eval"] = _eval_section(data, where=where)
        _check_keep_best(sections["eval"], sections["train"], where=where)
        base = pathlib.Path(source).parent if source != "<memory>" else pathlib.Path.cwd()
        rules = parse_rules(data.get("rules", []), where=where, prefix="rules")
        try:
            rules += load_includes(data.get("include", []), where=where, base=base, seen=(source,))
        except RecipeError as error:
            if source in str(error):
                raise
            # The problem sits in an included file: also name the recipe the user gave.
            raise RecipeError(f"{error.message} (in a file included by {source})", where=error.where) from None
        return cls(model=model, rules=tuple(rules), source=source, raw=copy.deepcopy(data), **sections)

    def relative(self, path: str) -> pathlib.Path:
        """A path of the recipe (``model.path``, ``data.path``): absolute as given, else
        relative to the recipe's folder (the current folder for an in-memory recipe)."""
        given = pathlib.Path(path)
        return given if given.is_absolute() else self.base() / given

    def base(self) -> pathlib.Path:
        """The folder the recipe's relative paths start from: its file's, or the current one."""
        return pathlib.Path(self.source).parent if self.source != "<memory>" else pathlib.Path.cwd()

    def model_dir(self) -> pathlib.Path:
        """``model.path`` as a local directory: a folder relative to the recipe, a Hub id's snapshot
        in the local cache, or a GGUF file's converted folder (core/model_source.py); only for
        recipes that give one."""
        if self.model.path is None:
            raise ValueError("this recipe builds a preset; it has no model.path")
        from weft.core.model_source import local_model_dir  # torch only where a GGUF file is converted

        return local_model_dir(self.model.path, base=self.base(), revision=self.model.revision,
                               where=f"{self.source} (model.path)")

    def warmup_warning(self, *, steps: int | None = None) -> str | None:
        """The warning for a ``train.warmup_steps`` the recipe (or --set) gives that the run's steps
        never get past (TrainSection.warmup_warning), else None: the default warmup in a shorter
        trial run is no one's mistake."""
        train = self.raw.get("train")
        if not isinstance(train, dict) or "warmup_steps" not in train:
            return None
        return self.train.warmup_warning(steps=steps)

    def task_file(self) -> pathlib.Path | None:
        """``eval.task`` resolved, or None."""
        return None if self.eval.task is None else self.relative(self.eval.task)

    def data_file(self) -> pathlib.Path:
        """``data.path`` resolved: the one place a recipe's data path is resolved."""
        if self.data.path is None:
            raise RecipeError("data.source = 'jsonl' needs data.path", where=f"{self.source} (data.path)")
        return self.relative(self.data.path)

    def data_files(self) -> list[tuple[str, pathlib.Path]]:
        """(the key that names it, the file) of each data file: ``data.path``, or each of
        ``[[data.sources]]`` in order."""
        if self.data.sources:
            return [(f"data.sources[{n}].path", self.relative(source.path)) for n, source in
                    enumerate(self.data.sources)]
        return [("data.path", self.data_file())]


def _eval_section(data: dict, *, where: Where) -> EvalSection:
    """[eval], its [eval.data] read as [data] with those keys changed (checked as [data] is)."""
    table = data.get("eval", {})
    if not isinstance(table, dict):
        raise RecipeError("[eval] must be a table (every = N, and an [eval.data] table)", where=where.at("eval"))
    held_out = table.get("data")
    section = build(EvalSection, {k: v for k, v in table.items() if k != "data"}, where=where, prefix="eval")
    if held_out is None:
        return section
    if not isinstance(held_out, dict):
        raise RecipeError("[eval.data] must be a table of [data] keys", where=where.at("eval.data"))
    if "every" not in table:  # held-out samples named, their evaluation forgotten (an explicit 0 turns it off)
        raise RecipeError("[eval.data] names held-out samples but [eval] gives no every (steps between "
                          "evaluations): set eval.every", where=where.at("eval.data"))
    inherited = dict(data.get("data", {}))
    if "path" in held_out or "sources" in held_out:  # one file or a mixture: the held-out one replaces [data]'s
        for key in ("path", "sources", "mix_samples"):
            inherited.pop(key, None)
    merged = build(DataSection, {**inherited, **held_out}, where=where, prefix="eval.data")
    return attrs.evolve(section, data=merged)


def _check_keep_best(evaluation: EvalSection, train: TrainSection, *, where: Where) -> None:
    """eval.keep_best compares the held-out loss (or accuracy) at each checkpoint: each one needs
    an evaluation; a task is scored at the evaluations."""
    every, saved = evaluation.every, train.checkpoint_every
    if evaluation.task is not None and not every:
        raise RecipeError("eval.task is scored at each evaluation, and [eval] gives no every (steps between "
                          "evaluations): set eval.every", where=where.at("eval.task"))
    if evaluation.best_by == "accuracy" and evaluation.task is None:
        raise RecipeError("eval.best_by = \"accuracy\" keeps the checkpoint of the highest eval_accuracy, which "
                          "eval.task gives: name a task file", where=where.at("eval.best_by"))
    if evaluation.keep_best and not (every and saved > 0 and saved % every == 0):
        raise RecipeError(f"eval.keep_best keeps the checkpoint of the lowest eval_loss, so every checkpoint step "
                          f"must be an evaluation step: train.checkpoint_every ({saved}) must be a positive "
                          f"multiple of eval.every ({every})", where=where.at("eval.keep_best"))


def _check_preset(model: ModelSection, *, where: Where) -> None:
    """A bare preset name must be a bundled preset (a path-like one is read at build time)."""
    name = model.preset
    if name is None or is_preset_path(name):
        return
    names = preset_names()
    if name not in names:
        raise RecipeError(
            f"unknown model.preset {name!r}{did_you_mean(name, names)} Bundled presets: {', '.join(names) or '(none)'}",
            where=where.at("model.preset"),
        )


def apply_override(data: dict, override: str) -> None:
    """Apply one ``--set a.b=value`` to the raw recipe data; the value is read as TOML."""
    if "=" not in override:
        raise RecipeError(f"--set takes KEY=VALUE (e.g. train.max_steps=10), got {override!r}", where="--set")
    key, _, text = override.partition("=")
    key = key.strip()
    flag = f"--set {override.strip()}"
    parts = key.split(".")
    nested = len(parts) == 3 and parts[:2] == ["eval", "data"]  # [eval.data]: the held-out [data] keys
    if not (len(parts) == 2 or nested) or not all(parts):
        raise RecipeError(
            f"the key {key!r} must be SECTION.KEY with a section among model, data, train, parallel, eval "
            f"(or eval.data.KEY, a [data] key of the held-out data)",
            where=flag,
        )
    section, name = ("data", parts[2]) if nested else parts
    sections = {"model": ModelSection, "data": DataSection, "train": TrainSection, "parallel": ParallelSection,
                "eval": EvalSection}
    if section not in sections:
        raise RecipeError(f"unknown section {section!r}{did_you_mean(section, sections)} "
                          f"Accepted: {', '.join(sections)}", where=flag)
    # eval.data is a table of [data] keys: eval.data.KEY names one of them.
    fields = [f.name for f in attrs.fields(sections[section]) if (section, f.name) != ("eval", "data")]
    if name not in fields:
        raise RecipeError(f"unknown key {name!r}{did_you_mean(name, fields)} Accepted: {', '.join(fields)}", where=flag)
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = text.strip()  # a bare word is a string: --set model.preset=qwen2_5_vl_7b
    if typed_path(section, name, value):  # a path relative to where it was typed
        value = str(pathlib.Path.cwd() / value)
    table = data.setdefault("eval", {}).setdefault("data", {}) if nested else data.setdefault(section, {})
    if not isinstance(table, dict):
        raise RecipeError(f"[{'eval.data' if nested else section}] is not a table in the recipe", where=flag)
    if section == "model" and name in ("path", "preset"):
        # Choosing one source of weights replaces the other.
        table.pop("path", None)
        table.pop("preset", None)
    table[name] = value


