"""The rule language: ``[[rules]]`` tables parsed into frozen Rule objects with their
file:line, included rule files, and weft's bundled defaults.

Pure: imports no torch. The engine that applies rules to modules is core/recipe/rule_engine.py.
"""

from __future__ import annotations

import importlib.resources
import pathlib
import re
import sys
from typing import Any

import attrs

from weft.core.errors import RecipeError
from weft.core.hookspecs import HOOK_POINTS, MULTI_POINTS
from weft.core.recipe.convert import Where, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 is not supported, kept for clarity
    import tomli as tomllib


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
#: Points whose rule may leave out ``strategy``: the run's own (train.optimizer), until the planner fills it in.
DEFAULTED_POINTS: tuple[str, ...] = ("optimizer",)
RUN_STRATEGY = "<train.optimizer>"


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
    # Collect-all points (guard, grad_sync, metrics) may list several strategies.
    tables = value if isinstance(value, list) and point in MULTI_POINTS else [value]
    if not tables:
        # An empty list would silently drop the point (e.g. no gradient all-reduce at all).
        raise RecipeError(f"{point} = [] chooses no strategy; give at least one (e.g. {point} = [\"...\"])",
                          where=where.at(prefix))
    actions = []
    for i, table in enumerate(tables):
        here = f"{prefix}[{i}]" if len(tables) > 1 or isinstance(value, list) else prefix
        if isinstance(table, str):
            table = {"strategy": table}
        if point in DEFAULTED_POINTS and isinstance(table, dict) and "strategy" not in table:
            # optimizer = { lr = 2e-5 }: settings for these modules, the run's optimizer (train.optimizer).
            table = {"strategy": RUN_STRATEGY, **table}
        if not isinstance(table, dict) or not isinstance(table.get("strategy"), str):
            listing = " or a list of them" if point in MULTI_POINTS else ""
            raise RecipeError(
                f"{point} must be a table with a 'strategy' string "
                f"(e.g. {point} = {{ strategy = \"...\" }}){listing}; got {value!r}",
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
            raise RecipeError(f"selector {key!r} must be a string or a list of strings, got {value!r}",
                              where=where.at(f"{prefix}.{key}"))
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
            hint = (f"; did you mean {_COMPARISON_ALIASES[op]!r}?" if op in _COMPARISON_ALIASES
                    else did_you_mean(op, COMPARISONS))
            raise RecipeError(f"unknown comparison {op!r}{hint} Accepted: {', '.join(COMPARISONS)}",
                              where=where.at(f"{prefix}.{op}"))
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
        text = read_toml_text(path, what="included rule file", where=where.at("include"))
        data = parse_toml(text, path)
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
    return parse_rules(parse_toml(text, path).get("rules", []), where=Where(str(path), text), prefix="rules")


def read_toml_text(path: pathlib.Path, *, what: str, where: str | None = None) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{what} {str(path)!r} does not exist", where=where) from None
    except (OSError, UnicodeDecodeError) as error:
        raise RecipeError(f"cannot read {what} {str(path)!r}: {error}", where=where) from None


def parse_toml(text: str, path: pathlib.Path) -> dict:
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
