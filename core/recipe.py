"""Recipes: TOML files parsed into frozen attrs classes, with includes and --set overrides.

Pure: imports no torch, so `weft plan` and the validation of a recipe happen before
any process group exists.
"""

from __future__ import annotations

import copy
import importlib.resources
import pathlib
import re
import sys
from typing import Any, Literal

import attrs

from weft.core.errors import RecipeError
from weft.core.hookspecs import HOOK_POINTS
from weft.core.presets import preset_names
from weft.core.schema import Where, build, did_you_mean, in_range

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 is not supported, kept for clarity
    import tomli as tomllib


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen(kw_only=True)
class ModelSection:
    path: str | None = attrs.field(default=None, metadata=_doc("local Hugging Face model directory"))
    preset: str | None = attrs.field(default=None, metadata=_doc("random init of a named shape (recipes/presets)"))
    processor: str | None = attrs.field(default=None, metadata=_doc("processor folder or bundled name; default: the model's"))
    rope_scaling: Literal["none", "yarn"] = attrs.field(default="none", metadata=_doc("text decoder's rotary scaling: none (as the model ships) or yarn"))
    rope_factor: float = attrs.field(default=1.0, validator=in_range(low=1.0, high=64.0), metadata=_doc("YaRN factor: the context grows to rope_original_max x this"))
    rope_original_max: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc("positions the model was trained on; 0 = from its config"))

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.preset is None):
            raise ValueError("set exactly one of model.path (a local HF directory) or model.preset (a named shape)")
        if self.rope_scaling == "yarn" and self.rope_factor <= 1.0:
            raise ValueError(f"model.rope_scaling = 'yarn' needs model.rope_factor above 1 (got {self.rope_factor:g}); "
                             "a run's warning 'positions.beyond_trained' names the factor its data needs")
        if self.rope_scaling == "none" and self.rope_factor != 1.0:
            raise ValueError(f"model.rope_factor = {self.rope_factor:g} does nothing without model.rope_scaling = 'yarn'")


@attrs.frozen(kw_only=True)
class DataSection:
    source: Literal["synthetic", "jsonl"] = attrs.field(default="synthetic", metadata=_doc("synthetic conversations or a JSONL chat file"))
    path: str | None = attrs.field(default=None, metadata=_doc("JSONL file (chat format), relative to the recipe"))
    num_samples: int = attrs.field(default=256, validator=in_range(low=1), metadata=_doc("synthetic samples"))
    min_side: int = attrs.field(default=28, validator=in_range(low=28), metadata=_doc("smallest synthetic image side, px"))
    max_side: int = attrs.field(default=112, validator=in_range(low=28), metadata=_doc("largest synthetic image side, px"))
    strict: bool = attrs.field(default=False, metadata=_doc("a bad sample stops the run instead of being skipped"))
    workers: int = attrs.field(default=-1, validator=in_range(low=-1), metadata=_doc("preprocessing processes; -1 = min(8, cores - 1), 0/1 = in-process"))
    cache: bool = attrs.field(default=True, metadata=_doc("cache tokenized samples next to the dataset (<file>.weft-cache/)"))

    def __attrs_post_init__(self) -> None:
        if self.source == "jsonl" and self.path is None:
            raise ValueError("data.source = 'jsonl' needs data.path")
        if self.min_side > self.max_side:
            raise ValueError(f"data.min_side ({self.min_side}) is larger than data.max_side ({self.max_side})")


@attrs.frozen(kw_only=True)
class TrainSection:
    max_steps: int = attrs.field(default=20, validator=in_range(low=1), metadata=_doc("optimizer steps"))
    seed: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc("seeds model init, data order, dropout"))
    checkpoint_every: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc("steps between checkpoints; 0 = only at the end"))
    keep_checkpoints: int = attrs.field(default=2, validator=in_range(low=1), metadata=_doc("newest checkpoints kept"))
    micro_batch_tokens: int = attrs.field(default=2048, validator=in_range(low=16), metadata=_doc("padded tokens per micro-batch per rank"))
    step_tokens: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc("accumulate micro-batches until this many tokens (all ranks); 0 = one round"))
    max_seq_len: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc("longest sample; 0 = micro_batch_tokens; the seq_len rule selector"))
    lr: float = attrs.field(default=1e-3, validator=in_range(low=0.0), metadata=_doc("peak learning rate"))
    min_lr_ratio: float = attrs.field(default=0.1, validator=in_range(low=0.0, high=1.0), metadata=_doc("cosine floor as a fraction of lr"))
    warmup_steps: int = attrs.field(default=2, validator=in_range(low=0), metadata=_doc("linear warmup steps"))
    weight_decay: float = attrs.field(default=0.0, validator=in_range(low=0.0), metadata=_doc("AdamW weight decay"))
    beta1: float = attrs.field(default=0.9, validator=in_range(low=0.0, high=1.0), metadata=_doc("AdamW beta1"))
    beta2: float = attrs.field(default=0.95, validator=in_range(low=0.0, high=1.0), metadata=_doc("AdamW beta2"))
    precision: Literal["fp32", "bf16"] = attrs.field(default="fp32", metadata=_doc("fp32, or bf16 autocast"))
    log_every: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("steps between console lines"))

    @property
    def seq_len(self) -> int:
        return self.max_seq_len or self.micro_batch_tokens


@attrs.frozen(kw_only=True)
class ParallelSection:
    nproc: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("local processes `weft run` starts (not under torchrun); --nproc overrides"))
    dp_replicate: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("HSDP replicas"))
    dp_shard: int = attrs.field(default=-1, validator=in_range(low=-1), metadata=_doc("FSDP shard degree; -1 = what is left"))
    ulysses: int | Literal["auto"] = attrs.field(default=1, metadata=_doc("Ulysses (head all-to-all) degree, or 'auto'"))
    ring: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("ring attention degree"))
    backend: Literal["auto", "gloo", "nccl"] = attrs.field(default="auto", metadata=_doc("process-group backend; auto = nccl on GPU"))
    device: Literal["auto", "cpu", "cuda"] = attrs.field(default="auto", metadata=_doc("where to train; auto = cuda if present"))

    def __attrs_post_init__(self) -> None:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard = 0 is not accepted; use a positive degree or -1 (fill)")
        if isinstance(self.ulysses, int) and self.ulysses < 1:
            raise ValueError(f"parallel.ulysses = {self.ulysses} is out of range; accepted: >= 1 or 'auto'")


NUMERIC_SELECTORS: tuple[str, ...] = ("heads", "kv_heads", "head_dim", "seq_len", "world_size")
MODALITIES: tuple[str, ...] = ("vision", "projector", "text", "embedding", "head")
COMPARISONS: tuple[str, ...] = ("eq", "ne", "gt", "ge", "lt", "le")
#: Spellings from other languages, for the did-you-mean of a bad comparison.
_COMPARISON_ALIASES: dict[str, str] = {
    "==": "eq", "=": "eq", "!=": "ne", "neq": "ne", ">": "gt", ">=": "ge", "gte": "ge",
    "<": "lt", "<=": "le", "lte": "le",
}
SELECTOR_KEYS: tuple[str, ...] = ("path", "class", "modality", *NUMERIC_SELECTORS)
RULE_KEYS: tuple[str, ...] = ("name", "when", *HOOK_POINTS)


@attrs.frozen(kw_only=True)
class Comparison:
    op: str
    value: int


@attrs.frozen(kw_only=True)
class Selector:
    """The `when` table of a rule; every given key must match (AND)."""

    paths: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    modalities: tuple[str, ...] = ()
    numbers: tuple[tuple[str, tuple[Comparison, ...]], ...] = ()


@attrs.frozen(kw_only=True)
class Action:
    """One hook point's strategy choice in a rule; params are validated at plan time."""

    strategy: str
    params: tuple[tuple[str, Any], ...] = ()


@attrs.frozen(kw_only=True)
class Rule:
    name: str
    when: Selector
    actions: tuple[tuple[str, tuple[Action, ...]], ...]
    source: str  # "file:line"

    def action(self, point: str) -> tuple[Action, ...] | None:
        for name, actions in self.actions:
            if name == point:
                return actions
        return None


@attrs.frozen(kw_only=True)
class Recipe:
    model: ModelSection
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    parallel: ParallelSection = ParallelSection()
    rules: tuple[Rule, ...] = ()
    source: str = "<memory>"
    raw: dict = attrs.field(factory=dict, eq=False, repr=False)  # the merged TOML data, for the run dir

    @classmethod
    def from_toml(cls, path: str | pathlib.Path, *, overrides: tuple[str, ...] = ()) -> "Recipe":
        path = pathlib.Path(path)
        if not path.exists() and path.suffix in ("", ".toml") and len(path.parts) == 1:
            # A bare name of a bundled recipe: `weft run tiny-vl` from any folder.
            path = bundled_path(path.name if path.suffix else f"{path.name}.toml") or path
        text = _read(path, what="recipe")
        data = _parse(text, path)
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
        known = ("include", "model", "data", "train", "parallel", "rules")
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
        if given.is_absolute():
            return given
        base = pathlib.Path(self.source).parent if self.source != "<memory>" else pathlib.Path.cwd()
        return base / given

    def model_dir(self) -> pathlib.Path:
        """``model.path`` resolved; only for recipes that give one."""
        if self.model.path is None:
            raise ValueError("this recipe builds a preset; it has no model.path")
        return self.relative(self.model.path)

    def data_file(self) -> pathlib.Path:
        """``data.path`` resolved: the one place a recipe's data path is resolved."""
        if self.data.path is None:
            raise RecipeError("data.source = 'jsonl' needs data.path", where=f"{self.source} (data.path)")
        return self.relative(self.data.path)


def _check_preset(model: ModelSection, *, where: Where) -> None:
    """A bare preset name must be a bundled preset (a path-like one is read at build time)."""
    name = model.preset
    if name is None or "/" in name or "\\" in name or name.endswith(".toml"):
        return
    names = preset_names()
    if name not in names:
        raise RecipeError(
            f"unknown model.preset {name!r}{did_you_mean(name, names)} Bundled presets: {', '.join(names) or '(none)'}",
            where=where.at("model.preset"),
        )


def parse_rules(items: Any, *, where: Where, prefix: str) -> list[Rule]:
    if not isinstance(items, list):
        raise RecipeError(f"{prefix} must be a list of tables ([[rules]])", where=where.at(prefix))
    return [_parse_rule(item, where=where, prefix=f"{prefix}[{i}]", index=i) for i, item in enumerate(items)]


def _parse_rule(item: Any, *, where: Where, prefix: str, index: int) -> Rule:
    if not isinstance(item, dict):
        raise RecipeError("each rule must be a table", where=where.at(prefix))
    for key in item:
        if key not in RULE_KEYS:
            raise RecipeError(
                f"unknown rule key {key!r}{did_you_mean(key, RULE_KEYS)} "
                f"Accepted: name, when, and the hook points {', '.join(HOOK_POINTS)}",
                where=where.at(f"{prefix}.{key}"),
            )
    actions = []
    for point in HOOK_POINTS:
        if point in item:
            actions.append((point, _parse_actions(item[point], where=where, prefix=f"{prefix}.{point}", point=point)))
    if not actions:
        raise RecipeError(
            f"a rule must choose a strategy for at least one hook point ({', '.join(HOOK_POINTS)})",
            where=where.at(prefix),
        )
    line = where.line_of(prefix)
    source = f"{where.path}:{line}" if line else f"{where.path}#rule{index + 1}"
    name = item.get("name", f"rule {index + 1}")
    if not isinstance(name, str):
        raise RecipeError(f"rule name must be a string, got {name!r}", where=where.at(f"{prefix}.name"))
    return Rule(
        name=name,
        when=_parse_selector(item.get("when", {}), where=where, prefix=f"{prefix}.when"),
        actions=tuple(actions),
        source=source,
    )


def _parse_actions(value: Any, *, where: Where, prefix: str, point: str) -> tuple[Action, ...]:
    # Collect-all points (guard, grad_sync) may list several strategies.
    tables = value if isinstance(value, list) and point in ("guard", "grad_sync") else [value]
    if not tables:
        # An empty list would silently drop the point (e.g. no gradient all-reduce at all).
        raise RecipeError(f"{point} = [] chooses no strategy; give at least one (e.g. {point} = [\"...\"])", where=where.at(prefix))
    actions = []
    for i, table in enumerate(tables):
        here = f"{prefix}[{i}]" if len(tables) > 1 or isinstance(value, list) else prefix
        if isinstance(table, str):
            table = {"strategy": table}
        if not isinstance(table, dict) or not isinstance(table.get("strategy"), str):
            listing = " or a list of them" if point in ("guard", "grad_sync") else ""
            raise RecipeError(
                f"{point} must be a table with a 'strategy' string (e.g. {point} = {{ strategy = \"...\" }}){listing}; got {value!r}",
                where=where.at(here),
            )
        params = tuple((k, v) for k, v in table.items() if k != "strategy")
        actions.append(Action(strategy=table["strategy"], params=params))
    return tuple(actions)


def _parse_selector(when: Any, *, where: Where, prefix: str) -> Selector:
    if not isinstance(when, dict):
        raise RecipeError(f"'when' must be a table of selectors ({', '.join(SELECTOR_KEYS)})", where=where.at(prefix))
    for key in when:
        if key not in SELECTOR_KEYS:
            raise RecipeError(
                f"unknown selector {key!r}{did_you_mean(key, SELECTOR_KEYS)} Accepted: {', '.join(SELECTOR_KEYS)}",
                where=where.at(f"{prefix}.{key}"),
            )

    def strings(key: str) -> tuple[str, ...]:
        value = when.get(key, [])
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RecipeError(f"selector {key!r} must be a string or a list of strings, got {value!r}", where=where.at(f"{prefix}.{key}"))
        return tuple(value)

    modalities = strings("modality")
    for modality in modalities:
        if modality not in MODALITIES:
            raise RecipeError(
                f"unknown modality {modality!r}{did_you_mean(modality, MODALITIES)} Accepted: {', '.join(MODALITIES)}",
                where=where.at(f"{prefix}.modality"),
            )
    numbers = []
    for key in NUMERIC_SELECTORS:
        if key in when:
            numbers.append((key, _parse_comparisons(when[key], where=where, prefix=f"{prefix}.{key}")))
    return Selector(paths=strings("path"), classes=strings("class"), modalities=modalities, numbers=tuple(numbers))


def _parse_comparisons(value: Any, *, where: Where, prefix: str) -> tuple[Comparison, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (Comparison(op="eq", value=value),)
    if not isinstance(value, dict) or not value:
        raise RecipeError(
            f"a numeric selector takes an integer or a table of comparisons ({', '.join(COMPARISONS)}), got {value!r}",
            where=where.at(prefix),
        )
    out = []
    for op, number in value.items():
        if op not in COMPARISONS:
            hint = f"; did you mean {_COMPARISON_ALIASES[op]!r}?" if op in _COMPARISON_ALIASES else did_you_mean(op, COMPARISONS)
            raise RecipeError(f"unknown comparison {op!r}{hint} Accepted: {', '.join(COMPARISONS)}", where=where.at(f"{prefix}.{op}"))
        if not isinstance(number, int) or isinstance(number, bool):
            raise RecipeError(f"comparison {op} needs an integer, got {number!r}", where=where.at(f"{prefix}.{op}"))
        out.append(Comparison(op=op, value=number))
    return tuple(out)


def load_includes(includes: Any, *, where: Where, base: pathlib.Path, seen: tuple[str, ...]) -> list[Rule]:
    """Rules of included files, in order, after the including file's own rules.

    A name is a path relative to the including file; if no such file exists it is
    looked up among the bundled rule files (``weft/recipes/...``).
    """
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise RecipeError(f"include must be a list of rule-file names, got {includes!r}", where=where.at("include"))
    rules: list[Rule] = []
    for name in includes:
        path = resolve_include(name, base=base, where=where)
        if _same_file(path) in {_same_file(pathlib.Path(s)) for s in seen}:
            raise RecipeError(f"include cycle: {' -> '.join(seen)} -> {path}", where=where.at("include"))
        text = _read(path, what="included rule file", where=where.at("include"))
        data = _parse(text, path)
        inner = Where(str(path), text)
        for key in data:
            if key not in ("include", "rules"):
                raise RecipeError(
                    f"an included rule file holds only 'include' and [[rules]]; found {key!r}",
                    where=inner.at(key),
                )
        rules += parse_rules(data.get("rules", []), where=inner, prefix="rules")
        rules += load_includes(data.get("include", []), where=inner, base=path.parent, seen=seen + (str(path),))
    return rules


def _same_file(path: pathlib.Path) -> str:
    """A key equal for every spelling of one file (relative, absolute, with '..')."""
    try:
        return str(path.resolve())
    except (OSError, RuntimeError):
        return str(path)


def _is_file(path: pathlib.Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # name too long, NUL byte, ...
        return False


def resolve_include(name: str, *, base: pathlib.Path, where: Where) -> pathlib.Path:
    local = base / name
    if _is_file(local):
        return local
    bundled = bundled_path(name)
    if bundled is not None:
        return bundled
    available = ", ".join(bundled_rule_files()) or "(none)"
    raise RecipeError(
        f"included file {name!r} not found next to the recipe ({local}) nor among the bundled rule files: {available}",
        where=where.at("include"),
    )


def bundled_path(name: str) -> pathlib.Path | None:
    root = pathlib.Path(str(importlib.resources.files("weft.recipes")))
    for candidate in (root / name, root / "rules" / name, root / "rules" / f"{name}.toml", root / f"{name}.toml"):
        if _is_file(candidate):
            return candidate
    return None


def bundled_rule_files() -> list[str]:
    root = pathlib.Path(str(importlib.resources.files("weft.recipes"))) / "rules"
    return sorted(f"rules/{p.name}" for p in root.glob("*.toml"))


def default_rules() -> list[Rule]:
    """The built-in defaults: lowest precedence, after every recipe rule."""
    path = bundled_path("rules/defaults.toml")
    assert path is not None, "weft/recipes/rules/defaults.toml is missing from the installation"
    text = path.read_text()
    return parse_rules(_parse(text, path).get("rules", []), where=Where(str(path), text), prefix="rules")


def apply_override(data: dict, override: str) -> None:
    """Apply one ``--set a.b=value`` to the raw recipe data; the value is read as TOML."""
    if "=" not in override:
        raise RecipeError(f"--set takes KEY=VALUE (e.g. train.max_steps=10), got {override!r}", where="--set")
    key, _, text = override.partition("=")
    key = key.strip()
    flag = f"--set {override.strip()}"
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise RecipeError(
            f"the key {key!r} must be SECTION.KEY with a section among model, data, train, parallel",
            where=flag,
        )
    section, name = parts
    sections = {"model": ModelSection, "data": DataSection, "train": TrainSection, "parallel": ParallelSection}
    if section not in sections:
        raise RecipeError(f"unknown section {section!r}{did_you_mean(section, sections)} Accepted: {', '.join(sections)}", where=flag)
    fields = [f.name for f in attrs.fields(sections[section])]
    if name not in fields:
        raise RecipeError(f"unknown key {name!r}{did_you_mean(name, fields)} Accepted: {', '.join(fields)}", where=flag)
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = text.strip()  # a bare word is a string: --set model.preset=qwen2_5_vl_7b
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise RecipeError(f"[{section}] is not a table in the recipe", where=flag)
    if section == "model" and name in ("path", "preset"):
        # Choosing one source of weights replaces the other.
        table.pop("path", None)
        table.pop("preset", None)
    table[name] = value


def _read(path: pathlib.Path, *, what: str, where: str | None = None) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{what} {str(path)!r} does not exist", where=where) from None
    except (OSError, UnicodeDecodeError) as error:
        raise RecipeError(f"cannot read {what} {str(path)!r}: {error}", where=where) from None


def _parse(text: str, path: pathlib.Path) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        # Python 3.14 gives lineno/msg; earlier versions only "... (at line L, column C)".
        message = getattr(error, "msg", None) or str(error)
        line = getattr(error, "lineno", None)
        found = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
        if found:
            line = line or int(found.group(1))
            message = f"{message[: found.start()]} (column {found.group(2)})"
        place = f"{path}:{line}" if line else str(path)
        raise RecipeError(f"not valid TOML: {message}", where=place) from None
    except RecursionError:
        raise RecipeError("not valid TOML: arrays or tables nested too deeply", where=str(path)) from None
