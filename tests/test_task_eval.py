"""`weft eval --task`: questions scored by accuracy. Both scorings against hand-computed ones on
the tiny model (each choice's summed log-likelihood from transformers' own forward; the
generated answer from transformers' own greedy ``generate``), the same scores under data
parallelism, ring and Ulysses, the per-question JSONL, and the task file's mistakes as exit-2
messages naming the file and line."""

from __future__ import annotations

import itertools
import json
import math
import pathlib

import pytest
import torch
from PIL import Image

from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny-vl.toml")
_CALLS = itertools.count()
CHOICES = [
    # A conversation's own "context" key is its data, not a plain-text question (tests/test_text_choice.py).
    {"id": "colour", "messages": [{"role": "user", "content": "Pick a colour"}], "choices": ["red", "blue green"],
     "answer": "red", "context": "a field of the dataset's own"},
    {"id": "image", "messages": [{"role": "user", "content": "<image>Which colour is this?"}], "images": ["red.png"],
     "choices": ["red", "blue", "a shade of green"], "answer": 0},
    # A training line as it is: its last turn is the reference reply, and the answer.
    {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}],
     "choices": ["one two", "three"]},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("task")
    Image.new("RGB", (56, 84), (200, 30, 30)).save(folder / "red.png")
    (folder / "choices.jsonl").write_text("".join(json.dumps(line) + "\n" for line in CHOICES))
    return folder


def evaluate(folder: pathlib.Path, task: str, *extra: str) -> tuple[dict, list[dict]]:
    results = folder / f"{task}-{next(_CALLS)}.results.jsonl"
    done = run_weft("eval", RECIPE, "--task", str(folder / task), "--results", str(results), "--json", *extra,
                    cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), [json.loads(line) for line in results.read_text().splitlines()]


def hand_scores(messages: list[dict], choices: list[str]) -> list[float]:
    """Each choice's summed log-likelihood from transformers' forward over the chat template's
    rendering: the choice's tokens after the generation prompt, before the closing <|im_end|>."""
    from model_helpers import family_of
    from weft.core.recipe import Recipe
    from weft.strategies.data.conversation import load_processor

    recipe = Recipe.from_toml(RECIPE)
    model = family_of(recipe).build(recipe, device="cpu", seed=recipe.train.seed).eval()
    tokenizer = load_processor(family_of(recipe).config(recipe)[1])[0]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    found = []
    for choice in choices:
        own = tokenizer.encode(choice, add_special_tokens=False)
        full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": choice}], tokenize=True,
                                             return_dict=False)
        assert full[:len(prompt)] == prompt and full[len(prompt):len(prompt) + len(own)] == own
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([full])).logits[0].double()  # (S, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        found.append(sum(float(logprobs[len(prompt) - 1 + k, token]) for k, token in enumerate(own)))
    return found


@pytest.fixture(scope="module")
def one_rank(folder) -> tuple[dict, list[dict]]:
    return evaluate(folder, "choices.jsonl", "--nproc", "1")


def test_choices_are_scored_by_their_summed_log_likelihood(one_rank):
    summary, rows = one_rank
    for line, row in zip(CHOICES, rows):
        if "images" in line:
            continue  # the image question: its scores are compared across plans below
        choices = line["choices"]
        want = hand_scores(line["messages"][:1], choices)
        assert row["log_likelihoods"] == pytest.approx(want, rel=1e-5, abs=1e-5), (row, want)
        best = max(range(len(want)), key=lambda j: want[j])
        per_byte = [w / len(c.encode()) for w, c in zip(want, choices)]
        assert row["prediction"] == choices[best] and row["right"] == (choices[best] == (line.get("answer") or
                                                                                         "one two"))
        assert row["prediction_norm"] == choices[max(range(len(want)), key=lambda j: per_byte[j])]
    assert [r["id"] for r in rows] == ["colour", "image", "line-3"] and rows[1]["answer"] == "red"
    right = sum(r["right"] for r in rows)
    assert summary["right"] == right and summary["accuracy"] == pytest.approx(right / 3)
    assert summary["questions"] == 3 and summary["by_scoring"] == {"choices": 3, "generation": 0}
    low, high = summary["interval_95"]
    assert low <= right / 3 <= high


@pytest.mark.parametrize("mesh", [[], ["--set", "parallel.ring=2"], ["--set", "parallel.ulysses=2"]],
                         ids=["dp2", "ring2", "ulysses2"])
def test_every_plan_gives_the_one_rank_scores(folder, one_rank, mesh):
    summary, rows = evaluate(folder, "choices.jsonl", "--nproc", "2", *mesh)
    for got, want in zip(rows, one_rank[1]):
        assert got["log_likelihoods"] == pytest.approx(want["log_likelihoods"], rel=1e-5, abs=1e-5)
    assert summary["accuracy"] == one_rank[0]["accuracy"] and summary["world_size"] == 2


def test_a_generated_answer_is_transformers_greedy_answer(folder):
    """The reply is generated greedily (the static cache) and matched after normalisation: the
    answer transformers' own ``generate`` gives is right, one word more is wrong."""
    from model_helpers import transformers_greedy
    from weft.core.infer.decode import stop_tokens
    from weft.core.recipe import Recipe

    greedy = transformers_greedy(RECIPE, prompt="Which colour is this?", image=str(folder / "red.png"), new=4)
    tokens = list(greedy["tokens"])
    while tokens and tokens[-1] in set(stop_tokens(greedy["model"])):
        tokens.pop()
    text = greedy["family"].decode_tokens(Recipe.from_toml(RECIPE), tokens)
    question = {"messages": [{"role": "user", "content": "<image>Which colour is this?"}], "images": ["red.png"]}
    lines = [dict(question, id="same", answer=f"  {text.upper()} "), dict(question, id="more", answer=text + " more")]
    (folder / "generated.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary, rows = evaluate(folder, "generated.jsonl", "--nproc", "1", "--max-new-tokens", "4")
    assert [r["prediction"] for r in rows] == [text, text] and [r["right"] for r in rows] == [True, False]
    assert summary["by_scoring"] == {"choices": 0, "generation": 2} and summary["accuracy"] == 0.5


@pytest.mark.quick
@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"answer": "x"}', "no conversation"),
    ('{"messages": [{"role": "user", "content": "q"}], "answer": {"text": "x"}}',
     "'answer' must be a non-empty string"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "a line without 'answer' needs the reference reply"),
    ('{"messages": [{"role": "user", "content": "q"}], "choices": ["only"], "answer": "only"}',
     "'choices' must list two or more non-empty strings"),
    ('{"messages": [{"role": "user", "content": "q"}], "choices": ["a", "a"], "answer": "a"}', "the same text twice"),
    ('{"messages": [{"role": "user", "content": "q"}], "choices": ["a", "b"], "answer": "c"}',
     "'answer' must be one of the choices"),
    ('{"messages": [{"role": "user", "content": "q"}], "choices": ["a", "b"], "answer": 2}', "no index of the 2"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "only the reference reply"),
])
def test_a_malformed_line_is_exit_2_naming_its_line(weft, tmp_path, line, message):
    task = tmp_path / "task.jsonl"
    task.write_text('{"messages": [{"role": "user", "content": "fine"}], "answer": "yes"}\n\n' + line + "\n")
    done = weft("eval", RECIPE, "--task", str(task), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{task}:3: " in done.stderr and message in done.stderr, done.stderr[-2000:]


@pytest.mark.quick
def test_normalisation_and_the_interval():
    from weft.core.train.task_file import normalize, wilson

    assert normalize("  Seven.\n") == normalize("seven") == "seven"
    assert normalize("Ｓｅｖｅｎ  Up!") == "seven up" and normalize("'7'") == "7"
    assert normalize("seven up") != normalize("sevenup")
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)  # not the normal approximation's 0
    low, high = wilson(95, 100)
    assert (low, high) == pytest.approx((0.8883, 0.9785), abs=1e-4)
    assert wilson(10, 10)[1] == 1.0 and wilson(5, 10)[0] == pytest.approx(1 - wilson(5, 10)[1])
    assert not math.isnan(wilson(0, 0)[0])


def test_a_run_scores_its_task_at_each_evaluation(folder, tmp_path):
    """[eval] task: eval_accuracy (and its interval) in the evaluation steps' rows, each question's
    row in eval/task-step-N.jsonl, the scores `weft eval --task` gives on that step's checkpoint;
    eval.best_by = "accuracy" keeps the checkpoint of the highest accuracy."""
    run = tmp_path / "run"
    task = str(folder / "choices.jsonl")
    done = run_weft("run", RECIPE, "--nproc", "1", "--run-dir", str(run), "--set", "train.max_steps=4",
                    "--set", "train.checkpoint_every=2", "--set", "eval.every=2", "--set", f"eval.task={task}",
                    "--set", "eval.keep_best=true", "--set", "eval.best_by=accuracy", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in scored] == [2, 4]
    assert all(r["eval_accuracy_low"] <= r["eval_accuracy"] <= r["eval_accuracy_high"] for r in scored)
    in_run = [json.loads(line) for line in (run / "eval" / "task-step-4.jsonl").read_text().splitlines()]
    summary, after = evaluate(folder, "choices.jsonl", "--nproc", "1", "--run-dir", str(run), "--step", "4")
    for got, want in zip(after, in_run):
        assert got["log_likelihoods"] == pytest.approx(want["log_likelihoods"], rel=1e-5, abs=1e-5)
    assert summary["accuracy"] == scored[-1]["eval_accuracy"]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["eval_accuracy"] == max(r["eval_accuracy"] for r in scored)
    assert best["step"] == next(r["step"] for r in scored if r["eval_accuracy"] == best["eval_accuracy"])


@pytest.mark.quick
@pytest.mark.parametrize("sets, message", [
    (["eval.best_by=accuracy"], "eval.best_by = \"accuracy\" keeps the checkpoint of the highest eval_accuracy"),
    (["eval.task=task.jsonl"], "eval.task is scored at each evaluation, and [eval] gives no every"),
])
def test_task_keys_without_what_they_need_are_exit_2(weft, tmp_path, sets, message):
    done = weft("plan", RECIPE, *(a for s in sets for a in ("--set", s)), cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_a_run_refuses_a_task_it_cannot_score_before_training(weft, tmp_path):
    task = tmp_path / "gen.jsonl"
    task.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "answer": "hi"}) + "\n")
    done = weft("run", RECIPE, "--nproc", "1", "--run-dir", str(tmp_path / "run"), "--set", "eval.every=2",
                "--set", f"eval.task={task}", cwd=tmp_path)
    assert done.returncode == 2 and "1 of eval.task's questions have no choices (line 1 first)" in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
