"""Every malformed recipe under tests/bad_recipes/ is refused by `weft plan` with exit 2,
a message naming the file, and no traceback.

Each case file starts with ``# expect: <substring of the error>`` and may have a second
line ``# args: <extra CLI args>``. Helper files for the include cases live in
tests/bad_recipes/includes/ (not cases themselves).
"""

from __future__ import annotations

import importlib.resources
import pathlib
import shlex
import subprocess
import sys

import pytest

from weft.core.commands.main import main

HERE = pathlib.Path(__file__).parent
BAD = HERE / "bad_recipes"
CASES = sorted(BAD.glob("*.toml"))
TINY_VL = pathlib.Path(str(importlib.resources.files("weft.recipes"))) / "tiny-vl.toml"


def read_case(path: pathlib.Path) -> tuple[str, list[str]]:
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("# expect: "), f"{path.name}: first line must be '# expect: ...'"
    expect = lines[0].removeprefix("# expect: ").strip()
    args = shlex.split(lines[1].removeprefix("# args: ")) if len(lines) > 1 and lines[1].startswith("# args: ") else []
    return expect, args


@pytest.mark.quick
def test_there_are_enough_cases():
    assert len(CASES) >= 32


@pytest.mark.quick
@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_recipe(path, capsys):
    expect, args = read_case(path)
    code = main(["plan", str(path), *args])
    out = capsys.readouterr()
    assert code == 2, f"exit {code}; stdout: {out.out[-500:]}; stderr: {out.err[-500:]}"
    assert out.err.startswith("weft: error: ")
    assert expect in out.err, out.err
    assert path.name in out.err, out.err
    assert "Traceback" not in out.err + out.out
    assert out.out == ""


# ---------------------------------------------------------------------------
# a few as real processes: the exit status and stderr a user's shell sees
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["unknown_key_did_you_mean", "bad_toml_syntax", "mesh_product_mismatch"])
def test_bad_recipe_subprocess(name):
    path = BAD / f"{name}.toml"
    expect, args = read_case(path)
    result = subprocess.run(
        [sys.executable, "-m", "weft", "plan", str(path), *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert expect in result.stderr
    assert path.name in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# ---------------------------------------------------------------------------
# --set errors
# ---------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    "override, expect",
    [
        ("train.max_step=10", "--set train.max_step=10: unknown key 'max_step'; did you mean 'max_steps'?"),
        ("trian.max_steps=10", "--set trian.max_steps=10: unknown section 'trian'; did you mean 'train'?"),
        ("rules.attention=sdpa", "unknown section 'rules'. Accepted: model, data, train, parallel"),
        ("train.max_steps", "--set takes KEY=VALUE (e.g. train.max_steps=10), got 'train.max_steps'"),
        ("max_steps=10", "the key 'max_steps' must be SECTION.KEY"),
        ("train.lr.peak=1", "the key 'train.lr.peak' must be SECTION.KEY"),
        ("eval.data.pth=x.jsonl", "--set eval.data.pth=x.jsonl: unknown key 'pth'; did you mean 'path'?"),
        (
            "train.max_steps=ten",
            "(--set train.max_steps=ten): 'ten' (string) is not accepted for 'max_steps'; expected an integer",
        ),
        (
            "train.max_steps=1.5",
            "(--set train.max_steps=1.5): 1.5 (number) is not accepted for 'max_steps'; expected an integer",
        ),
        ("train.max_steps=0", "(--set train.max_steps=0): max_steps = 0 is out of range; accepted: between 1 and "
                              "2**40"),
        ("data.strict=yes", "'yes' (string) is not accepted for 'strict'; expected true or false"),
        ("train.precision=bfloat16", "expected one of 'fp32', 'bf16'; did you mean 'bf16'?"),
        ("parallel.ulysses=3", "parallel.ulysses = 3 does not divide the heads"),  # with --world-size 3 below
        (
            "model.preset=qwen2_5_vl_tiyn",
            "(--set model.preset=qwen2_5_vl_tiyn): unknown model.preset 'qwen2_5_vl_tiyn'; "
            "did you mean 'qwen2_5_vl_tiny'?",
        ),

        ("data.source=jsonl", "data.source = 'jsonl' needs data.path"),
    ],
)
def test_set_errors(override, expect, capsys, tmp_path):
    recipe = tmp_path / "minimal.toml"
    recipe.write_text('[model]\npreset = "qwen2_5_vl_tiny"\n\n[train]\nmax_steps = 4\n')
    code = main(["plan", str(recipe), "--world-size", "3", "--set", override])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert expect in out.err, out.err
    assert "Traceback" not in out.err


def test_set_error_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "weft", "plan", str(TINY_VL), "--set", "train.max_step=10"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "did you mean 'max_steps'?" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.quick
def test_missing_recipe_file(capsys, tmp_path):
    missing = tmp_path / "nope.toml"
    assert main(["plan", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"recipe {str(missing)!r} does not exist" in err and "Traceback" not in err


@pytest.mark.quick
def test_recipe_is_a_directory(capsys, tmp_path):
    assert main(["plan", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read recipe" in err and "Traceback" not in err


@pytest.mark.quick
def test_good_recipe_still_plans(capsys):
    """The control: the bundled recipe passes, so the failures above are the files' fault."""
    assert main(["plan", str(TINY_VL), "--world-size", "4", "--json"]) == 0
    assert '"world_size": 4' in capsys.readouterr().out
