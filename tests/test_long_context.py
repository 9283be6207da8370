"""examples/long's generators (the passkey and the multimodal needle): each key where its line says
and nowhere else, lengths exact in the model's tokens as weft encodes them, haystacks only from
held-out files; and `weft report --heatmap`'s accuracy by depth x length."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
LONG = ROOT / "examples" / "long"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, LONG / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(LONG))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(LONG))
    return module


@pytest.fixture(scope="module")
def passkeys(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("passkey")
    assert example("make_passkey").main([str(out), "--train-samples", "12", "--train-length", "384",
                                         "--lengths", "256,1000", "--depths", "0,0.3,1", "--per-depth", "2",
                                         "--seed", "3"]) == 0
    return out


def lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_key_is_where_the_line_says_and_nowhere_else(passkeys):
    haystack, make_passkey = example("haystack"), example("make_passkey")
    encoder = haystack.Encoder("tiny_vl", base=passkeys)
    keys = []
    for n in (256, 1000):
        for line in lines(passkeys / f"passkey-{n}.jsonl"):
            ids = encoder.ids(line, prompt=True)
            assert len(ids) == n == line["meta"]["length"]  # the prompt, generation header included
            key = line["meta"]["key"]
            assert len(key) == 5 and key.isdigit() and line["answer"] == f"The pass key is {key}."
            key_ids = encoder.tokenizer(key, add_special_tokens=False)["input_ids"]
            found = haystack.subsequence_starts(ids, key_ids)
            assert len(found) == 2 and found[0] == line["meta"]["needle_token"], (found, line["meta"])
            text = line["messages"][0]["content"]
            assert text.count(key) == 2  # the needle's two mentions, no other in the haystack
            # Where the line says: the needle's first token at its depth of the haystack's tokens (the
            # header, the instructions and the question around it left out), within half a line of
            # code: the needle goes between lines.
            bare = make_passkey.passkey_record("", key=key, depth=0.0, answer=False)
            bare_ids = encoder.ids(bare, prompt=True)
            head = haystack.subsequence_starts(bare_ids, key_ids)[0]  # the tokens before the haystack
            depth = (found[0] - head) / (n - len(bare_ids))
            if line["meta"]["depth"] in (0.0, 1.0):
                assert depth == line["meta"]["depth"], (depth, line["meta"])
            if n == 1000:
                assert abs(depth - line["meta"]["depth"]) < 0.06, (depth, line["meta"])
            keys.append(key)
    assert len(set(keys)) == len(keys)  # no key twice in the files


def test_training_lines_are_exact_and_haystacks_of_questions_held_out(passkeys):
    haystack = example("haystack")
    encoder = haystack.Encoder("tiny_vl", base=passkeys)
    train = lines(passkeys / "train.jsonl")
    assert len(train) == 12 and all(len(encoder.ids(t, prompt=False)) == 384 for t in train)
    assert all(t["messages"][-1]["role"] == "assistant" for t in train)
    for t in train:  # a question's reply says the key it hid; a text line hides named keys and says each again
        said = t["messages"][-1]["content"]
        if t["meta"]["task"] == "passkey":
            key = said.rsplit("The pass key is ", 1)[1].rstrip(".")
            assert len(key) == 5 and key.isdigit() and t["messages"][0]["content"].count(key) == 2, t["meta"]
        else:
            assert len(t["meta"]["keys"]) == 3  # six in 580 tokens and more, fewer in shorter lines
            for name, key in t["meta"]["keys"].items():
                assert said.count(f"{name}'s pass key is {key}.") == 2, (name, key)
    root, parts = haystack.corpus_parts()
    held = {str(f.relative_to(root)) for f in parts["held_out"]}
    trained = {str(f.relative_to(root)) for f in parts["train"]}
    assert held and trained and not held & trained
    for n in (256, 1000):
        for line in lines(passkeys / f"passkey-{n}.jsonl"):
            assert set(line["meta"]["files"]) <= held, line["meta"]["files"]
    for t in train:
        assert set(t["meta"]["files"]) <= trained


def test_the_same_seed_gives_the_same_files(passkeys, tmp_path):
    example("make_passkey").main([str(tmp_path), "--train-samples", "12", "--train-length", "384", "--lengths",
                                  "256,1000", "--depths", "0,0.3,1", "--per-depth", "2", "--seed", "3"])
    for name in ("train.jsonl", "passkey-256.jsonl", "passkey-1000.jsonl"):
        assert (tmp_path / name).read_text() == (passkeys / name).read_text()


def test_the_needle_image_is_after_its_name_and_lengths_count_its_vision_tokens(tmp_path):
    example("make_needle").main([str(tmp_path), "--train-samples", "3", "--train-length", "600",
                                 "--train-min-length", "400", "--log-lengths", "--lengths", "900",
                                 "--depths", "0,0.5,1", "--per-depth", "1", "--distractors", "2", "--seed", "1"])
    haystack = example("haystack")
    encoder = haystack.Encoder("tiny_vl", base=tmp_path)
    from sklearn.datasets import load_digits

    labels = load_digits().target
    for line in lines(tmp_path / "needle-900.jsonl"):
        assert len(encoder.ids(line, prompt=True)) == 900
        text, meta = line["messages"][0]["content"], line["meta"]
        assert text.count("<image>") == len(line["images"]) == 3
        # The asked-about name's image is the one its marker introduces, and its digit is the answer.
        names = [text[:i].rsplit("Image of ", 1)[1].split(":")[0] for i in _indices(text, "<image>")]
        asked = line["images"][names.index(meta["name"])]
        assert asked == f"images/{meta['image']:04d}.png" and meta["digit"] == labels[meta["image"]]
        assert line["answer"] == f"The image of {meta['name']} shows {meta['digit']}."
        assert text.endswith(f"Which digit is in the image of {meta['name']}?")
        make_needle = example("make_needle")
        body = text[len(make_needle.INTRO): -len(make_needle.question(meta["name"]))]
        # The depth is of the text the needle went into: the distractors' markers were in it already.
        at = body.index(make_needle.marker(meta["name"]))
        assert abs(at / (len(body) - len(make_needle.marker(meta["name"]))) - meta["depth"]) < 0.1, (at, meta)
    for t in lines(tmp_path / "train.jsonl"):  # each exactly the length it drew from 400-600 tokens
        assert len(encoder.ids(t, prompt=False)) == t["meta"]["length"] and 400 <= t["meta"]["length"] <= 600


def _indices(text: str, part: str) -> list[int]:
    found, at = [], text.find(part)
    while at >= 0:
        found.append(at)
        at = text.find(part, at + 1)
    return found


def test_heatmap_draws_accuracy_by_depth_and_length(tmp_path):
    rows = [{"id": f"q{i}", "right": i % 3 != 0, "meta": {"depth": d, "length": n}}
            for i, (d, n) in enumerate((d, n) for d in (0.0, 0.5, 1.0) for n in (512, 1024, 2048) for _ in range(3))]
    results = tmp_path / "yarn.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_weft("report", "--heatmap", str(results), "--heatmap", str(results), "--out", str(tmp_path / "h.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "yarn.jsonl: 512 67%, 1K 67%, 2K 67%" in done.stdout
    from weft.core.commands.heatmap import read_cells

    assert read_cells(results)[(0.5, 1024)] == (2, 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"id": "x", "right": True}) + "\n")
    done = run_weft("report", "--heatmap", str(bad))
    assert done.returncode == 2 and f"{bad}:2" in done.stderr and "meta.depth" in done.stderr, done.stderr


def test_forced_without_a_task_is_a_message():
    done = run_weft("eval", str(ROOT / "recipes" / "tiny-vl.toml"), "--forced")
    assert done.returncode == 2 and "--forced goes with --task" in done.stderr, done.stderr


def test_retrieval_stages_write_each_task_its_own_count(tmp_path, monkeypatch):
    """The warm stage's passkey and needle counts differ; each generator gets its own."""
    retrieval = example("retrieval_128k")
    calls = []
    monkeypatch.setattr(retrieval.make_passkey, "main", lambda argv: calls.append(("passkey", argv)))
    monkeypatch.setattr(retrieval.make_needle, "main", lambda argv: calls.append(("needle", argv)))
    args = retrieval.argparse.Namespace(warm_samples="12000,8000", warm_length=512, seed=0, jobs=1,
                                        digits=tmp_path, distractors=0, edge_depths=0.2)
    retrieval.make_warm(tmp_path, args)
    counts = {task: argv[argv.index("--train-samples") + 1] for task, argv in calls}
    lowest = {task: argv[argv.index("--train-min-length") + 1] for task, argv in calls}
    assert counts == {"passkey": "12000", "needle": "8000"} and lowest == {"passkey": "180", "needle": "300"}
    # 300 steps x 131,072 tokens / 55,153 tokens a line (log-uniform 16K-128K) / 2 tasks / 4 passes
    assert retrieval.lines_for(300, tokens=131072, low=16384, high=131072) == 90
    # half of them from the top half (mean 3/4 of 131,072): longer lines, fewer of them
    assert retrieval.lines_for(300, tokens=131072, low=16384, high=131072, long_share=0.5) == 65


def test_retrieval_sets_the_rotary_base_and_nothing_else(tmp_path):
    """--rope-theta replaces the preset's one rotary base; the rest of the preset stays as written,
    and a preset without exactly one such line is a message."""
    import tomllib

    retrieval = example("retrieval_128k")
    preset = retrieval.HERE / "passkey_vl.toml"
    text = retrieval.preset_text(preset, theta=1e6)
    read, own = tomllib.loads(text), tomllib.loads(preset.read_text())
    assert read["text_config"]["rope_parameters"]["rope_theta"] == 1e6
    assert own["text_config"]["rope_parameters"]["rope_theta"] == 10000.0
    read["text_config"]["rope_parameters"]["rope_theta"] = 10000.0
    assert read == own and retrieval.preset_text(preset, theta=None) == preset.read_text()
    bare = tmp_path / "bare.toml"
    bare.write_text('model_type = "qwen2_5_vl"\n')
    with pytest.raises(SystemExit, match="has 0 lines 'rope_theta"):
        retrieval.preset_text(bare, theta=1e6)


def test_training_lines_reach_the_top_lengths_and_the_edge_depths():
    """--long-share puts lines in the top half of the lengths, --edge-depths needles at 0 and 1
    exactly; with neither the draws are as before (the same lines for the same seed)."""
    import random

    haystack = example("haystack")
    rng = random.Random(0)
    lengths = [haystack.draw_length(rng, low=180, high=16384, log=True, long_share=0.5) for _ in range(4000)]
    top = sum(n >= 8192 for n in lengths) / len(lengths)
    assert 0.5 < top < 0.62 and min(lengths) >= 180 and max(lengths) <= 16384  # 0.5 + 0.5 x ln 2 / ln 91
    plain = [haystack.draw_length(random.Random(1), low=180, high=16384, log=True) for _ in range(3)]
    assert plain == [haystack.draw_length(random.Random(1), low=180, high=16384, log=True, long_share=0.0)
                     for _ in range(3)]
    depths = [haystack.draw_depth(rng, edges=0.2) for _ in range(4000)]
    assert 0.08 < depths.count(0.0) / 4000 < 0.12 and 0.08 < depths.count(1.0) / 4000 < 0.12
    assert all(0.0 <= d <= 1.0 for d in depths)
