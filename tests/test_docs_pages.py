"""The pages agree with the code and with each other: the hook lists are generated from
core/hookspecs.py (docs/gen_reference.py) and are what `weft plugins` prints; every relative
link leads to a file that exists and every #anchor to a heading of it."""

from __future__ import annotations

import difflib
import importlib.util
import json
import pathlib
import re

import pytest

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md"),
                *(ROOT / "examples").rglob("*.md")])
#: The hook lists each page must generate rather than write by hand.
HOOK_BLOCKS = {
    "README.md": {"hooks.points", "hooks.table"},
    "docs/hooks.md": {"hooks.builtins", "hooks.firstresult", "hooks.collect_all"},
    "docs/plugins.md": {"hooks.points", "hooks.firstresult", "hooks.collect_all", "hooks.multi"},
}
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose(page: pathlib.Path) -> str:
    """A page without its fenced code blocks (links and headings there are code)."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(page)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("name", sorted(HOOK_BLOCKS))
def test_hook_lists_are_generated_and_up_to_date(name):
    gen = load_generator()
    path = ROOT / name
    assert path in gen.HOOK_PAGES
    current, fresh = gen.render_page(path)
    held = {m.group("name") for m in gen._BLOCK.finditer(current)}
    assert HOOK_BLOCKS[name] <= held, f"{name} lacks the generated hook lists {sorted(HOOK_BLOCKS[name] - held)}"
    diff = "".join(difflib.unified_diff(current.splitlines(True), fresh.splitlines(True), name, "generated", n=1))
    assert fresh == current, f"{name} is out of date; run: python docs/gen_reference.py\n{diff}"


def test_generated_hooks_are_what_weft_plugins_prints(capsys, monkeypatch):
    from weft.core.commands import main as cli

    for var in ("WEFT_PLUGINS", "WEFT_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["plugins", "--json"]) == 0
    printed = [(h["hook"], h["firstresult"]) for h in json.loads(capsys.readouterr().out)["hook_points"]]
    assert printed == [(name, first) for name, _, first, _ in load_generator().hook_specs()]


def test_no_page_counts_the_hooks_by_hand():
    """A count written in prose goes stale with the next hook; the generated lists do not."""
    words = r"\d+|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen"
    counted = re.compile(rf"\b({words})\s+(pluggy\s+)?hook(s|\s+points)\b", re.IGNORECASE)
    found = [f"{page.relative_to(ROOT)}: {m.group(0)!r}" for page in PAGES for m in counted.finditer(prose(page))]
    assert not found, f"hook counts written by hand: {found}"


def test_weft_plugins_shows_each_parameters_doc(capsys, monkeypatch):
    """docs/plugins.md: `metadata={"doc": ...}` is what `weft plugins` shows next to the parameter."""
    from weft.core.commands import main as cli

    for var in ("WEFT_PLUGINS", "WEFT_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "how the sequence is split over the ring ranks" in out  # attention ring's `layout`


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no file {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {where.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_named_in_prose_exists(page):
    """A page named without a link (`see design.md`, `docs/faults.md`) exists too: next to the page,
    at the repository's root or in docs/. Names under shared/ are the project's measurement notes
    beside the checkout, which BENCHMARKS.md cites as its sources; they are not pages of weft."""
    names = {name for name in re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b", prose(page))
             if not name.startswith("shared/")}
    missing = sorted(n for n in names
                     if not any((base / n).exists() for base in (page.parent, ROOT, ROOT / "docs")))
    assert not missing, f"{page.relative_to(ROOT)} names pages that do not exist: {missing}"


def test_the_anchor_slugs_are_githubs():
    heading = "`weft_attention(decision, module_path, plan, mesh, ctx)`"
    assert slug(heading) == "weft_attentiondecision-module_path-plan-mesh-ctx"
    assert slug("Adapters (LoRA)") == "adapters-lora"
    assert slug("5. Select it from a rule") == "5-select-it-from-a-rule"
