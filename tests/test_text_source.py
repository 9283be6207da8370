"""`data.source = "text"`: plain text files packed into samples of data.tokens tokens, by the
model's tokenizer or a BPE trained on the corpus; on real text (the Python standard
library's sources) a tiny model's loss falls, which random tokens never show."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from weft.strategies.data.text_corpus import corpus_files, corpus_tokenizer, text_samples

TEXT = ('[model]\npreset = "qwen2_text_tiny"\n[data]\nsource = "text"\npath = "<stdlib>/json/*.py"\ntokens = 256\n'
        'num_samples = 64\n[train]\nmicro_batch_tokens = 1024\nmax_steps = 30\nlr = 3e-3\nwarmup_steps = 0\n'
        'precision = "fp32"\ncheckpoint_every = -1\n[parallel]\nnproc = 1\n')


@pytest.mark.quick
def test_files_become_one_stream_cut_into_samples_of_one_length(tmp_path):
    (tmp_path / "a.txt").write_text("abcde")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("fghij")
    files = corpus_files("**/*.txt", base=tmp_path)
    assert [f.name for f in files] == ["a.txt", "b.txt"]  # sorted, ** recursive
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    samples = list(text_samples(files, encode=encode, end=0, tokens=4, num_samples=10))
    stream = [ord(c) for c in "abcde"] + [0] + [ord(c) for c in "fghij"] + [0]
    assert [s.input_ids.tolist() for s in samples] == [stream[0:4], stream[4:8], stream[8:12]]
    assert all(torch.equal(s.labels, s.input_ids) for s in samples)  # the loss on every token
    assert len(list(text_samples(files, encode=encode, end=0, tokens=4, num_samples=2))) == 2
    held_out = list(text_samples(files, encode=encode, end=0, tokens=4, num_samples=10, skip=1))
    assert [s.input_ids.tolist() for s in held_out] == [stream[4:8], stream[8:12]]  # the first left out
    with pytest.raises(ValueError, match="skip = 3 leaves no sample: the files hold 3 samples of 4 tokens"):
        list(text_samples(files, encode=encode, end=0, tokens=4, num_samples=10, skip=3))
    assert corpus_files("<stdlib>/json/__init__.py", base=tmp_path)[0].name == "__init__.py"
    # The standard library's folder holds the installed packages too: not the library's text.
    stdlib = corpus_files("<stdlib>/**/__init__.py", base=tmp_path)
    assert stdlib and not any("site-packages" in p.parts or "dist-packages" in p.parts for p in stdlib)


@pytest.mark.quick
def test_a_corpus_trains_its_own_tokenizer_once(tmp_path):
    files = corpus_files("<stdlib>/json/*.py", base=tmp_path)
    encode, end = corpus_tokenizer(files, vocab_size=600, cache_dir=tmp_path / "cache")
    [saved] = list((tmp_path / "cache").iterdir())
    ids = encode("def decode(self, s):")
    assert ids and max(ids) < 600 and end == 0
    before = saved.stat().st_mtime_ns
    again, _ = corpus_tokenizer(files, vocab_size=600, cache_dir=tmp_path / "cache")
    assert again("def decode(self, s):") == ids and saved.stat().st_mtime_ns == before  # read, not retrained
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 50)  # not UTF-8: replaced, read
    encode, _ = corpus_tokenizer([*files, tmp_path / "latin1.txt"], vocab_size=600, cache_dir=tmp_path / "cache")
    assert encode("au lait")


def test_a_tiny_model_learns_real_text(weft, tmp_path):
    """The training loss falls, and so does the loss on samples it never trained on
    (``data.skip_samples``: what benchmarks/learning/loss_curves.py compares precisions by)."""
    (tmp_path / "t.toml").write_text(TEXT.replace("checkpoint_every = -1", "checkpoint_every = 0"))
    done = weft("run", "t.toml", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)  # ln(320) = 5.77 at the start; real text falls well below
    held_out = ("--set", "data.skip_samples=64", "--set", "data.num_samples=8", "--json")
    trained = weft("eval", "t.toml", "--run-dir", "run", *held_out, cwd=tmp_path)
    initial = weft("eval", "t.toml", *held_out, cwd=tmp_path)
    assert trained.returncode == 0 and initial.returncode == 0, trained.stderr[-2000:] + initial.stderr[-2000:]
    trained, initial = json.loads(trained.stdout), json.loads(initial.stdout)
    assert trained["label_tokens"] == initial["label_tokens"] > 7 * 250  # 8 samples of 256, held out
    assert trained["loss"] < 0.8 * initial["loss"], (trained["loss"], initial["loss"])
    # Held out past the corpus's end (a smaller standard library than the run's): the key's message.
    past = weft("eval", "t.toml", "--set", "data.skip_samples=100000", cwd=tmp_path)
    assert past.returncode == 2, past.stderr[-2000:]
    assert "data.skip_samples = 100000" in past.stderr and "leaves no sample: the files hold" in past.stderr


@pytest.mark.parametrize(("change", "message"), [
    (("tokens = 256\n", ""), "packs the files of data.path"),
    (('"<stdlib>/json/*.py"', '"nowhere/*.txt"'), "names no file"),
    (('source = "text"\npath = "<stdlib>/json/*.py"\ntokens = 256\n', "skip_samples = 4\n"), "holds out the first"),
])
def test_mistakes_are_messages(weft, tmp_path, change, message):
    (tmp_path / "t.toml").write_text(TEXT.replace(*change))
    done = weft("plan", "t.toml", "--positions", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in " ".join(done.stderr.split())
    assert "t.toml" in done.stderr and pathlib.Path(tmp_path / "t.toml").is_file()
