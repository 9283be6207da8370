"""docs/rules.md's generated tables match the code (run `python docs/gen_reference.py` to refresh)."""

from __future__ import annotations

import difflib
import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rules_md_is_up_to_date():
    gen = load_generator()
    current = gen.RULES_MD.read_text(encoding="utf-8")
    fresh = gen.render(current)
    diff = "".join(
        difflib.unified_diff(current.splitlines(True), fresh.splitlines(True), "docs/rules.md", "generated", n=1)
    )
    assert fresh == current, f"docs/rules.md is out of date; run: python docs/gen_reference.py\n{diff}"


def test_every_recipe_key_is_in_a_table():
    """A key added to a section class shows up in the docs (guards the generator itself)."""
    import attrs

    from weft.core.recipe import DataSection, ModelSection, ParallelSection, TrainSection

    text = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    for cls in (ModelSection, DataSection, TrainSection, ParallelSection):
        for field in attrs.fields(cls):
            assert f"| `{field.alias or field.name}` |" in text, (
                f"{cls.__name__}.{field.name} missing from docs/rules.md"
            )



def test_check_mode_reports_drift(tmp_path, monkeypatch, capsys):
    gen = load_generator()
    stale = tmp_path / "rules.md"
    stale.write_text(gen.RULES_MD.read_text(encoding="utf-8").replace("| `max_steps` |", "| `max_stepz` |"))
    monkeypatch.setattr(gen, "RULES_MD", stale)
    assert gen.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
