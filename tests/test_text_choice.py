"""Plain-text questions (`"context"` task lines) for the text-only families: each choice scored
as the context's continuation, no chat template (lm-evaluation-harness's framing), against a
hand computation through transformers' own forward; a generated continuation against
transformers' greedy ``generate``; and examples/text_choice's held-out task, built from
standard-library files the recipe never trains on."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "text_choice"
RECIPE = ('[model]\npreset = "qwen2_text_tiny"\n[data]\nsource = "text"\npath = "<stdlib>/json/*.py"\ntokens = 128\n'
          '[train]\nseed = 3\nprecision = "fp32"\n[parallel]\nnproc = 1\n')
LINES = [
    {"id": "def", "context": "def decode(self, s):\n", "choices": ["    return s", "import os", "x = [1, 2]"],
     "answer": 0},
    {"id": "gen", "context": "class JSONDecoder(object):\n    ", "answer": "def"},
]


def make_passages():
    spec = importlib.util.spec_from_file_location("make_passages", EXAMPLE / "make_passages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> tuple[pathlib.Path, dict, list[dict]]:
    folder = tmp_path_factory.mktemp("text_task")
    (folder / "text.toml").write_text(RECIPE)
    (folder / "task.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    results = folder / "task.results.jsonl"
    done = run_weft("eval", str(folder / "text.toml"), "--task", str(folder / "task.jsonl"), "--results",
                    str(results), "--max-new-tokens", "3", "--json", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, json.loads(done.stdout), [json.loads(line) for line in results.read_text().splitlines()]


def model_and_tokenizer(recipe_path: pathlib.Path):
    from model_helpers import family_of
    from weft.core.recipe import Recipe
    from weft.strategies.data.conversation import load_processor

    recipe = Recipe.from_toml(recipe_path)
    family = family_of(recipe)
    model = family.build(recipe, device="cpu", seed=recipe.train.seed).eval()
    return model, load_processor(family.config(recipe)[1])[0]


def test_a_choice_is_scored_as_the_contexts_continuation(scored):
    folder, summary, rows = scored
    model, tokenizer = model_and_tokenizer(folder / "text.toml")
    line, row = LINES[0], rows[0]
    context = tokenizer.encode(line["context"], add_special_tokens=False)
    want = []
    for choice in line["choices"]:
        own = tokenizer.encode(choice, add_special_tokens=False)  # encoded apart, as lm-evaluation-harness does
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context + own])).logits[0].double()  # (S, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        want.append(sum(float(logprobs[len(context) - 1 + k, t]) for k, t in enumerate(own)))
    assert row["scoring"] == "choices" and row["log_likelihoods"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    best = max(range(3), key=lambda j: want[j])
    assert row["prediction"] == line["choices"][best] and row["right"] == (best == 0)
    assert summary["questions"] == 2 and summary["by_scoring"] == {"choices": 1, "generation": 1}


def test_a_generated_continuation_is_transformers_greedy_one(scored):
    from weft.core.train.task_file import normalize

    folder, _, rows = scored
    model, tokenizer = model_and_tokenizer(folder / "text.toml")
    ids = torch.tensor([tokenizer.encode(LINES[1]["context"], add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    eos = {model.generation_config.eos_token_id} | set(tokenizer.all_special_ids)
    tokens = out[0, ids.shape[1]:].tolist()
    while tokens and tokens[-1] in eos:
        tokens.pop()
    assert rows[1]["scoring"] == "generation"
    assert normalize(rows[1]["prediction"]) == normalize(tokenizer.decode(tokens))
    assert rows[1]["right"] == (normalize(rows[1]["prediction"]) == "def")


@pytest.mark.quick
@pytest.mark.parametrize("line, message", [
    ('{"context": "", "choices": ["a", "b"], "answer": 0}', "'context' must be a non-empty string"),
    ('{"context": ["x"], "answer": "a"}', "'context' must be a non-empty string"),
    ('{"context": "x", "choices": ["a"], "answer": 0}', "'choices' must list two or more"),
])
def test_a_malformed_context_line_is_exit_2_naming_its_line(weft, tmp_path, line, message):
    (tmp_path / "text.toml").write_text(RECIPE)
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "a", "answer": "b"}\n' + line + "\n")
    done = weft("eval", str(tmp_path / "text.toml"), "--task", str(task), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{task}:2: " in done.stderr and message in done.stderr, done.stderr[-2000:]


@pytest.mark.quick
def test_the_held_out_passages_come_from_files_training_never_reads(tmp_path):
    """Every question's file is in a package (training reads <stdlib>/*.py only), its context the
    file's own text up to a cut inside a line, the right choice that line's tail, four distinct
    choices; the same seed, the same file."""
    import sysconfig

    module = make_passages()
    out = tmp_path / "held.jsonl"
    assert module.main([str(out), "--questions", "40", "--seed", "1"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for line in lines:
        name, row, col = line["id"].rsplit(":", 2)
        assert "/" in name  # inside a package: never a top-level module the recipe trains on
        text = (stdlib / name).read_text(encoding="utf-8", errors="replace").splitlines()
        row, col = int(row) - 1, int(col) - 1
        assert line["choices"][line["answer"]] == text[row][col:col + module.TAIL_CHARS]
        assert line["context"] == "\n".join(text[row - module.PASSAGE_LINES:row]) + "\n" + text[row][:col]
        assert text[row][col - 1] in module.CUT_AFTER and len(set(line["choices"])) == 4
    module.main([str(tmp_path / "again.jsonl"), "--questions", "40", "--seed", "1"])
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()
    recipe = (EXAMPLE / "text_choice.toml").read_text()
    assert 'path = "<stdlib>/*.py"' in recipe  # what "never trains on" above relies on
