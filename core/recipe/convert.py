"""Typed conversion of plain TOML data into frozen attrs classes, with readable errors.

Hand-written rather than cattrs: weft's messages must name the file, line and key,
the value given and what is accepted, with "did you mean" for typos; a converter
library would need as much code again to reshape its errors. Pure: imports no torch.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from typing import Any, Literal

import attrs

from weft.core.errors import RecipeError


class Where:
    """Locates a dotted key in a TOML text so errors can name its line.

    tomllib keeps no positions; a line scan of table headers and ``key =``
    lines is enough for the shapes recipes use (tables and arrays of tables).
    """

    _header = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?\s*(#.*)?$")
    _key = re.compile(r"^\s*([A-Za-z0-9_\-\"']+)\s*=")

    def __init__(self, path: str, text: str | None, *, overridden: dict[str, str] | None = None) -> None:
        self.path = path
        self.lines = text.splitlines() if text else []
        #: dotted key -> the ``--set`` that gave its value: errors there name the flag, not the file's line.
        self.overridden = dict(overridden or {})

    def line_of(self, dotted: str) -> int | None:
        """1-based line of ``a.b`` / ``rules[2].attention.strategy``; None if not found.

        ``rules[2]`` is the third ``[[rules]]`` header. A key inside an inline
        table (``attention = { strategy = ... }``) resolves to that table's line.
        One scan of the text builds an index, so a recipe of thousands of rules
        is located in linear time.
        """
        exact, keys = self._index()
        parts = tuple(re.findall(r"[^.\[\]]+|\[\d+\]", dotted))
        found = [line for line in (exact.get(parts), exact.get((*parts, "[0]"))) if line is not None]
        if found:
            return min(found)
        # The first key line in the file whose path is a proper prefix (an inline table holding the key).
        inline = [keys[parts[:n]] for n in range(1, len(parts)) if parts[:n] in keys]
        return min(inline) if inline else None

    def _index(self) -> tuple[dict[tuple, int], dict[tuple, int]]:
        """(path -> first line of that header or key, path -> first line of that key)."""
        if getattr(self, "_built", None) is None:
            exact: dict[tuple, int] = {}
            keys: dict[tuple, int] = {}
            table: list[str] = []
            counts: dict[str, int] = {}
            for number, line in enumerate(self.lines, start=1):
                header = self._header.match(line)
                if header:
                    name = header.group(2).replace('"', "").replace("'", "").replace(" ", "")
                    if header.group(1) == "[[":
                        counts[name] = counts.get(name, -1) + 1
                        table = name.split(".") + [f"[{counts[name]}]"]
                    else:
                        table = name.split(".")
                    exact.setdefault(tuple(table), number)
                    continue
                key = self._key.match(line)
                if key:
                    full = (*table, key.group(1).strip("\"'"))
                    exact.setdefault(full, number)
                    keys.setdefault(full, number)
            self._built = (exact, keys)
        return self._built

    def at(self, dotted: str) -> str:
        if dotted in self.overridden:
            return f"{self.path} (--set {self.overridden[dotted]})"
        line = self.line_of(dotted) if dotted else None
        return f"{self.path}:{line} ({dotted})" if line else f"{self.path} ({dotted})" if dotted else self.path


def did_you_mean(word: str, choices: typing.Iterable[str], *, otherwise: str = ".") -> str:
    """'; did you mean 'x'?' for the closest choice, else ``otherwise``.

    Callers write ``f"unknown key {k!r}{did_you_mean(k, keys)} Accepted: ..."``; the
    default '.' keeps that a sentence when nothing is close.
    """
    close = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else otherwise


def describe(annotation: Any) -> str:
    """Human text for what a field accepts."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(annotation))
    if origin is tuple:
        return f"a list of {describe(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "nothing"
    if annotation is float:
        return "a number"
    if annotation is int:
        return "an integer"
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return "a string"
    if attrs.has(annotation):  # a section in a section ([eval.data])
        return "a table"
    return getattr(annotation, "__name__", str(annotation))


def convert(value: Any, annotation: Any) -> Any:
    """Return ``value`` converted to ``annotation`` or raise ValueError."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        if value in typing.get_args(annotation) and type(value) in {type(a) for a in typing.get_args(annotation)}:
            return value
        raise ValueError
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return convert(value, option)
            except ValueError:
                continue
        raise ValueError
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError
        (item,) = typing.get_args(annotation)[:1]
        return tuple(convert(v, item) for v in value)
    if annotation is type(None):
        if value is None:
            return None
        raise ValueError
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer beyond float range
                raise ValueError from None
        raise ValueError
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if attrs.has(annotation):
        raise ValueError  # nested classes are built by build(), not convert()
    raise ValueError


def build(cls: type, data: Any, *, where: Where, prefix: str) -> Any:
    """Make an instance of attrs class ``cls`` from a TOML table, checking every key."""
    if not isinstance(data, dict):
        raise RecipeError(f"expected a table, got {_show(data)}", where=where.at(prefix))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.init}
    names = {f.alias or f.name: f for f in fields.values()}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            accepted = ", ".join(sorted(names)) or "(no keys)"
            raise RecipeError(
                f"unknown key {key!r}{did_you_mean(key, names)} Accepted keys here: {accepted}",
                where=where.at(dotted),
            )
        field = names[key]
        annotation = hints[field.name]
        if attrs.has(annotation):
            kwargs[field.name] = build(annotation, value, where=where, prefix=dotted)
            continue
        table = _table_of(annotation)
        if table is not None:  # an array of tables ([[data.sources]]), each checked as a table
            if not isinstance(value, list):
                raise RecipeError(f"{_show(value)} is not accepted for {key!r}; expected an array of tables "
                                  f"([[{dotted}]])", where=where.at(dotted))
            kwargs[field.name] = tuple(build(table, item, where=where, prefix=f"{dotted}[{n}]")
                                       for n, item in enumerate(value))
            continue
        try:
            kwargs[field.name] = convert(value, annotation)
        except ValueError:
            hint = did_you_mean(value, _literal_strings(annotation), otherwise="") if isinstance(value, str) else ""
            raise RecipeError(
                f"{_show(value)} is not accepted for {key!r}; expected {describe(annotation)}{hint}",
                where=where.at(dotted),
            ) from None
    try:
        return cls(**kwargs)
    except FieldValueError as error:  # one field's validator: point at that key
        dotted = f"{prefix}.{error.field}" if prefix else error.field
        raise RecipeError(
            str(error), where=where.at(dotted) if dotted in _dotted_keys(data, prefix) else where.at(prefix),
        ) from None
    except (ValueError, TypeError) as error:
        raise RecipeError(str(error), where=where.at(prefix)) from None


def _table_of(annotation: Any) -> type | None:
    """The attrs class of a ``tuple[Class, ...]`` field (an array of tables), else None."""
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return item if attrs.has(item) else None
    return None


def _dotted_keys(data: dict, prefix: str) -> set[str]:
    return {f"{prefix}.{k}" if prefix else k for k in data}


class FieldValueError(ValueError):
    """A validator's complaint about one field; ``build`` locates it at that key."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def field_docs(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, accepted, default, doc) for every field: used by docs and `weft plugins`."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in attrs.fields(cls):
        default = f.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        rows.append((f.alias or f.name, describe(hints[f.name]), default, f.metadata.get("doc", "")))
    return rows


def _literal_strings(annotation: Any) -> list[str]:
    """The string choices of a Literal (also inside a union), for did-you-mean."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return [a for a in typing.get_args(annotation) if isinstance(a, str)]
    if origin in (typing.Union, types.UnionType):
        return [s for a in typing.get_args(annotation) for s in _literal_strings(a)]
    return []


def _show(value: Any) -> str:
    text = repr(value)
    kind = type(value).__name__
    kind = {"dict": "table", "list": "list", "str": "string", "int": "integer", "float": "number",
            "bool": "boolean"}.get(kind, kind)
    return f"{text[:60]} ({kind})"


def in_range(*, low: float | None = None, high: float | None = None, high_text: str | None = None):
    """attrs validator: a finite number within [low, high] (nan and inf are refused).
    ``high_text``: how the message writes ``high`` (``2**63 - 1`` reads better than its 19 digits)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        finite = not isinstance(value, float) or math.isfinite(value)
        if not finite or low is not None and value < low or high is not None and value > high:
            top = high_text or high
            bounds = f">= {low}" if high is None else f"<= {top}" if low is None else f"between {low} and {top}"
            if not finite:
                bounds = f"a finite number {bounds}"
            raise FieldValueError(f"{attribute.name} = {value!r} is out of range; accepted: {bounds}",
                                  field=attribute.name)

    return check
