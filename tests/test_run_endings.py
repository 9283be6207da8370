"""How a run ends, as the README and summary.json say it: every exit code named, and a run a
guard stops at its first step says which step ran and which state is the last good one."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from fault_runs import FAST, rows
from weft.core import errors

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.quick
def test_readme_names_every_exit_code():
    """core/errors.py's codes are what a script checks; the README's list had 0, 1 and 2 while a
    guard's abort exits 3."""
    (sentence,) = re.findall(r"^Exit codes: (.*?)\. A user error", (ROOT / "README.md").read_text(), re.M | re.S)
    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert codes == {0, 1, 2, 3}
    for code in codes:
        assert re.search(rf"(^|, ){code} ", sentence), (code, sentence)


@pytest.fixture
def plugin_site(tmp_path_factory) -> dict:
    from plugin_site import plugin_env

    return plugin_env(tmp_path_factory.mktemp("plugins"), module="weft_test_plugins", entry="weft-test")


def test_abort_at_the_first_step_is_summarised(weft, tmp_path, plugin_site):
    """NaN from step 1 and a guard that aborts on the first: exit 3; the summary names the
    aborted step (its metrics row says aborted), the steps that ran (1, not the 3 planned) and
    the last good state (step 0: none saved). At 0149418 it said steps 3 and last_step None."""
    (tmp_path / "guarded.toml").write_text(FAST + '\n[[rules]]\nguard = [{ strategy = "finite", '
                                           'max_consecutive_skips = 1 }, { strategy = "nan_from", step = 1 }]\n')
    run_dir = tmp_path / "run"
    done = weft("run", "guarded.toml", "--run-dir", str(run_dir), "--set", "train.max_steps=3", cwd=tmp_path,
                env=plugin_site)
    assert done.returncode == errors.EXIT_GUARD == 3, done.stderr[-3000:]
    assert [r["step"] for r in rows(run_dir)] == [1] and "aborted" in rows(run_dir)[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["aborted_step"] == 1
    assert summary["steps"] == 1 and summary["max_steps"] == 3 and summary["last_step"] == 0
    assert summary["last_checkpoint"] is None
