"""Regenerate the reference parts of the docs from the code that defines them.

    python docs/gen_reference.py           # rewrite the pages in place
    python docs/gen_reference.py --check   # exit 1 if a page is out of date

Each generated part sits between ``<!-- generated: NAME -->`` and ``<!-- /generated -->``
(on lines of their own for a table, inside a sentence for a list); everything outside
the markers is prose and is left alone. docs/rules.md's tables come from the attrs
classes of core/recipe/recipe.py (keys, accepted values, defaults, docs), the selector
constants, and the parameter classes of the built-in strategies. The hook lists of
README.md, docs/hooks.md and docs/plugins.md come from core/hookspecs.py (the hookspecs,
their firstresult flags, their first docstring lines), which is what `weft plugins`
prints. tests/test_docs_reference.py (rules.md) and tests/test_docs_pages.py (the hook pages)
fail when a page and the code disagree.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Any, Callable

import attrs

DOCS = pathlib.Path(__file__).resolve().parent
RULES_MD = DOCS / "rules.md"
#: The pages whose hook lists are generated (docs/rules.md has its own generators).
HOOK_PAGES = (DOCS.parent / "README.md", DOCS / "hooks.md", DOCS / "plugins.md")
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n?)(?P<body>.*?)(<!-- /generated -->)", re.DOTALL)


def _toml(value: Any) -> str:
    """A default as it would be written in TOML."""
    if value is None:
        return "unset"
    if value is attrs.NOTHING:
        return "required"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _bounds(validator: Any) -> str:
    """The range of weft's ``in_range`` validator, read from its closure."""
    if validator is None:
        return ""
    inner = getattr(validator, "_validators", (validator,))  # attrs.validators.and_
    for check in inner:
        code = getattr(check, "__code__", None)
        if getattr(check, "__qualname__", "") != "in_range.<locals>.check" or code is None:
            continue
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in check.__closure__ or ())))
        low, high = cells.get("low"), cells.get("high")
        if low is not None and high is not None:
            return f"{low} to {high}"
        if low is not None:
            return f">= {low}"
        if high is not None:
            return f"<= {high}"
    return ""


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def params_table(cls: type) -> str:
    """Markdown table of an attrs class: key, accepted, default, meaning."""
    from weft.core.recipe.convert import field_docs

    fields = {f.alias or f.name: f for f in attrs.fields(cls)}
    rows = ["| key | accepts | default | meaning |", "| --- | --- | --- | --- |"]
    for name, accepts, default, doc in field_docs(cls):
        bounds = _bounds(fields[name].validator)
        accepts = accepts.removesuffix(" or nothing")  # optional: the default column says "unset"
        accepted = f"{accepts} ({bounds})" if bounds else accepts
        rows.append(f"| `{name}` | {_escape(accepted)} | {_toml(default)} | {_escape(doc)} |")
    if len(rows) == 2:
        return "No parameters.\n"
    return "\n".join(rows) + "\n"


def section_table(name: str) -> Callable[[], str]:
    def render() -> str:
        from weft.core.recipe import recipe
        from weft.core.recipe.data import DataSource

        classes = {
            "model": recipe.ModelSection,
            "data": recipe.DataSection,
            "data.sources": DataSource,
            "train": recipe.TrainSection,
            "parallel": recipe.ParallelSection,
            "eval": recipe.EvalSection,
        }
        return params_table(classes[name])

    return render


def selectors_table() -> str:
    from weft.core.recipe.syntax import COMPARISONS, MODALITIES, NUMERIC_SELECTORS, SELECTOR_KEYS

    meaning = {
        "path": "glob on the module path (`\"\"` is the root)",
        "class": "glob on the module's class name",
        "modality": "the module's modality: " + ", ".join(f"`{m}`" for m in MODALITIES),
        "heads": "query heads of an attention module",
        "kv_heads": "key/value heads of an attention module",
        "head_dim": "head dimension of an attention module",
        "seq_len": "the run's sequence length: `train.max_seq_len`, or `train.micro_batch_tokens` when that is 0",
        "world_size": "ranks the plan is made for",
    }
    ops = ", ".join(f"`{op}`" for op in COMPARISONS)
    rows = ["| selector | matches | value |", "| --- | --- | --- |"]
    for key in SELECTOR_KEYS:
        value = (
            f"an integer (equality) or a table of comparisons ({ops})"
            if key in NUMERIC_SELECTORS
            else "a string or a list of strings (any matches)"
        )
        rows.append(f"| `{key}` | {meaning.get(key, '')} | {value} |")
    return "\n".join(rows) + "\n"


def points_table() -> str:
    from weft.core.hookspecs import HOOK_POINTS
    from weft.core.recipe.rule_engine import MULTI_POINTS, POINT_KINDS

    kinds = {"unit": "each shard unit", "root": "the root", "attention": "each attention module",
             "params": "each module outside the units holding parameters"}
    rows = ["| rule key | hook | decides for | value |", "| --- | --- | --- | --- |"]
    for point in HOOK_POINTS:
        value = "a table or a list of tables (all apply)" if point in MULTI_POINTS else "a table"
        where = " and ".join(kinds[k] for k in POINT_KINDS[point])
        where = "the root only: one run-wide decision" if POINT_KINDS[point] == ("root",) else where
        rows.append(f"| `{point}` | `weft_{point}` | {where} | {value} |")
    return "\n".join(rows) + "\n"


def presets_list() -> str:
    from weft.core.recipe.presets import preset_names

    return ", ".join(f"`{name}`" for name in preset_names()) + "\n"


def defaults_table() -> str:
    """The rules of recipes/rules/defaults.toml, lowest precedence, in order."""
    from weft.core.recipe.syntax import default_rules

    rows = ["| rule | when | chooses |", "| --- | --- | --- |"]
    for rule in default_rules():
        when = _when(rule.when) or "every module"
        chooses = "; ".join(
            f"`{point}` = "
            + " + ".join(
                f"`{a.strategy}`" + (f" ({', '.join(f'{k}={v!r}' for k, v in a.params)})" if a.params else "")
                for a in actions
            )
            for point, actions in rule.actions
        )
        rows.append(f"| {_escape(rule.name)} | {when} | {chooses} |")
    return "\n".join(rows) + "\n"


def _when(selector: Any) -> str:
    parts = [
        f"{key} {' or '.join(values)}"
        for key, values in (("path", selector.paths), ("class", selector.classes), ("modality", selector.modalities))
        if values
    ]
    parts += [
        f"{key} " + " and ".join(f"{c.op} {c.value}" for c in comparisons) for key, comparisons in selector.numbers
    ]
    return ", ".join(parts)


def strategies_section() -> str:
    """Every built-in strategy with its parameters (third-party ones: `weft plugins`)."""
    from weft.core.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(entry_points=False)  # built-ins only: installed plugins must not change the docs
    out = []
    for strategy in pm.registry.all():
        out.append(
            f"#### `{strategy.point}` / `{strategy.name}`\n\n"
            f"{strategy.summary} (plugin `{strategy.plugin}`)\n\n"
            f"{params_table(strategy.params)}"
        )
    return "\n".join(out)




def hook_specs() -> list[tuple[str, str, bool, str]]:
    """(hook, signature, firstresult, summary) of every hookspec, in the order `weft plugins`
    lists them: the two registration hooks, then the hook points in the order a run meets them."""
    import inspect

    from weft.core import hookspecs

    out = []
    for point in ("strategies", "models", *hookspecs.HOOK_POINTS):
        name = f"weft_{point}"
        fn = getattr(hookspecs, name)
        opts = getattr(fn, f"{hookspecs.PROJECT}_spec")
        summary = inspect.getdoc(fn).split("\n\n")[0].replace("\n", " ").replace("``", "`")
        out.append((name, f"{name}({', '.join(inspect.signature(fn).parameters)})", bool(opts.get("firstresult")),
                    summary))
    return out


def hooks_table() -> str:
    rows = ["| hook | kind | job |", "| --- | --- | --- |"]
    for _, signature, first, summary in hook_specs():
        rows.append(f"| `{signature}` | {'firstresult' if first else 'collect-all'} | {_escape(summary)} |")
    return "\n".join(rows) + "\n"


def _code_list(names) -> str:
    return ", ".join(f"`{name}`" for name in names)


def hook_points_list() -> str:
    """The rule keys (and `Strategy.point` values), inline."""
    from weft.core.hookspecs import HOOK_POINTS

    return _code_list(HOOK_POINTS)


def multi_points_list() -> str:
    """The hook points a rule may give a list of strategies, inline."""
    from weft.core.hookspecs import MULTI_POINTS

    return _code_list(MULTI_POINTS)


def firstresult_list() -> str:
    return _code_list(name for name, _, first, _ in hook_specs() if first)


def collect_all_list() -> str:
    return _code_list(name for name, _, first, _ in hook_specs() if not first)


def builtin_plugins_list() -> str:
    """The built-in plugin that implements each hook point, in the hook points' order."""
    from weft.core.hookspecs import HOOK_POINTS
    from weft.core.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(entry_points=False)
    names: list[str] = []
    for point in HOOK_POINTS:
        names += [i.plugin_name for i in getattr(pm.hook, f"weft_{point}").get_hookimpls()
                  if i.plugin_name not in names]
    return _code_list(names)


#: docs/rules.md's blocks, every one of which it must hold.
GENERATORS: dict[str, Callable[[], str]] = {
    "section.model": section_table("model"),
    "section.data": section_table("data"),
    "section.data.sources": section_table("data.sources"),
    "section.train": section_table("train"),
    "section.parallel": section_table("parallel"),
    "section.eval": section_table("eval"),
    "presets": presets_list,
    "defaults": defaults_table,
    "selectors": selectors_table,
    "points": points_table,
    "strategies": strategies_section,
    "hooks.points": hook_points_list,
    "hooks.multi": multi_points_list,
}

HOOK_GENERATORS: dict[str, Callable[[], str]] = {
    "hooks.table": hooks_table,
    "hooks.points": hook_points_list,
    "hooks.firstresult": firstresult_list,
    "hooks.collect_all": collect_all_list,
    "hooks.builtins": builtin_plugins_list,
    "hooks.multi": multi_points_list,
}


def pages() -> dict[pathlib.Path, tuple[dict[str, Callable[[], str]], bool]]:
    """Each generated page: its generators, and whether it must hold every one of them."""
    return {RULES_MD: (GENERATORS, True), **{page: (HOOK_GENERATORS, False) for page in HOOK_PAGES}}


def render(text: str, generators: dict[str, Callable[[], str]] | None = None, *, every: bool = True,
           page: str = "docs/rules.md") -> str:
    """``text`` with every generated block replaced by a fresh rendering."""
    generators = GENERATORS if generators is None else generators
    missing = set(generators) - {m.group("name") for m in _BLOCK.finditer(text)} if every else set()
    if missing:
        raise SystemExit(
            f"{page} lacks the generated blocks {sorted(missing)}; "
            "add '<!-- generated: NAME -->' ... '<!-- /generated -->'"
        )

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in generators:
            raise SystemExit(f"{page} has an unknown generated block {name!r}; known: {', '.join(generators)}")
        return f"{match.group(1)}{generators[name]()}{match.group(4)}"

    return _BLOCK.sub(fill, text)


def render_page(path: pathlib.Path) -> tuple[str, str]:
    """(current, fresh) text of one generated page."""
    generators, every = pages()[path]
    current = path.read_text(encoding="utf-8")
    return current, render(current, generators, every=every, page=path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = 0
    for path in pages():
        current, fresh = render_page(path)
        if fresh == current:
            continue
        if args.check:
            print(f"{path.name} is out of date: run python docs/gen_reference.py", file=sys.stderr)
            stale = 1
        else:
            path.write_text(fresh, encoding="utf-8")
            print(f"{path.name} updated")
    return stale


if __name__ == "__main__":
    raise SystemExit(main())
