"""Models as users hold them (core/model_source.py): a Hub id found in the local Hugging Face
cache, offline, with no network call; a missing id or revision named with where weft looked.
In-process (`weft.core.commands.main.main`), one rank, a tiny Llama written by transformers."""

from __future__ import annotations

import json
import pathlib
import socket
import textwrap

import pytest
import torch

REPO = "tiny-org/tiny-llama"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> pathlib.Path:
    """A Hugging Face hub cache as `hf download` leaves it: models--org--name/refs/<branch>
    holding a commit, snapshots/<commit>/ the files; two revisions whose weights differ."""
    import transformers

    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    for seed, (ref, commit) in enumerate(COMMITS.items()):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return cache


def _recipe(folder: pathlib.Path, path: str, **model) -> pathlib.Path:
    recipe = folder / "from-id.toml"
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in model.items())
    recipe.write_text(f'[model]\npath = "{path}"\n{extra}' + textwrap.dedent('''
        [data]
        source = "synthetic"
        tokens = 32
        num_samples = 8
        [train]
        max_steps = 2
        micro_batch_tokens = 32
        lr = 1e-3
        warmup_steps = 0
        [parallel]
        nproc = 1
    '''))
    return recipe


@pytest.fixture
def offline(monkeypatch, hub_cache):
    """HF_HUB_OFFLINE set, the cache where HF_HUB_CACHE says, and a guard that fails any
    connection or name lookup beyond this host: the proof that nothing is fetched."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    attempts = []
    local = ("127.0.0.1", "::1", "localhost", "0.0.0.0", "")
    real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in local:
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    def lookup(host, *args, **kwargs):
        if host not in local and host != socket.gethostname():
            attempts.append(host)
            raise OSError(f"test: no network ({host})")
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    return attempts


def _loaded(run_dir: pathlib.Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if "weights.loaded" in line]
    return rows[0]["path"]


def test_a_hub_id_trains_from_the_local_cache(offline, hub_cache, tmp_path, capsys):
    """`model.path = "org/name"`: the snapshot refs/main names, read offline with no connection
    tried; `model.revision` picks another. The first step's loss differs between the two
    revisions (their weights do), so the revision is not only a name in the log."""
    from weft.core.commands.main import main

    losses = {}
    for revision in ("main", "v1"):
        run_dir = tmp_path / revision
        extra = {} if revision == "main" else {"revision": revision}
        code = main(["run", str(_recipe(tmp_path, REPO, **extra)), "--run-dir", str(run_dir)])
        assert code == 0, capsys.readouterr().err[-3000:]
        assert _loaded(run_dir) == str(hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMITS[revision])
        losses[revision] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert losses["main"] != losses["v1"]
    assert offline == []


@pytest.mark.quick
def test_a_hub_id_not_in_the_cache_names_where_it_looked(offline, hub_cache, tmp_path, capsys):
    from weft.core.commands.main import main

    recipe = _recipe(tmp_path, "tiny-org/absent")
    assert main(["plan", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"{recipe} (model.path): 'tiny-org/absent' is neither a folder" in err, err
    assert str(hub_cache / "models--tiny-org--absent") in err and "never downloads" in err and "HF_HUB_CACHE" in err
    assert "Traceback" not in err and offline == []


@pytest.mark.quick
def test_a_revision_not_in_the_cache_lists_those_that_are(offline, tmp_path, capsys):
    from weft.core.commands.main import main

    assert main(["plan", str(_recipe(tmp_path, REPO, revision="v9"))]) == 2
    err = capsys.readouterr().err
    assert "not at revision 'v9'" in err and "main" in err and "v1" in err and COMMITS["v1"] in err, err
    assert "Traceback" not in err and offline == []


@pytest.mark.quick
def test_a_revision_with_a_local_folder_is_refused(tmp_path, capsys):
    from weft.core.commands.main import main

    (tmp_path / "local-model").mkdir()
    assert main(["plan", str(_recipe(tmp_path, "local-model", revision="main"))]) == 2
    assert "model.revision 'main' is for a Hub id" in capsys.readouterr().err


def test_a_gguf_file_converts_once_and_trains(monkeypatch, tmp_path, capsys):
    """`model.path = "tiny.gguf"`: converted by transformers' GGUF reader into weft's cache, the
    weights exactly those transformers reads from the file (tied head included), then trained;
    a second run reads the converted folder (a marker left in it survives) instead of
    converting again."""
    import transformers

    from gguf_fixture import write_tiny_gguf
    from weft.core.commands.main import main
    from weft.core.gguf_convert import CONVERTED

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    recipe = _recipe(tmp_path, "tiny.gguf")
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "first")]) == 0, capsys.readouterr().err[-3000:]
    (folder,) = (tmp_path / "cache" / "weft" / "gguf").glob("tiny-*")
    assert _loaded(tmp_path / "first") == str(folder)
    assert json.loads((folder / CONVERTED).read_text())["gguf"] == str(gguf.resolve())
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    got = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert got.config.tie_word_embeddings and got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(w, got.state_dict()[k]) for k, w in want.state_dict().items())
    assert transformers.AutoTokenizer.from_pretrained(folder)("hello world")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)("hello world")["input_ids"]

    (folder / "still-here").write_text("a second conversion would replace the folder")
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "second")]) == 0, capsys.readouterr().err[-3000:]
    assert (folder / "still-here").is_file() and _loaded(tmp_path / "second") == str(folder)


@pytest.mark.quick
def test_a_truncated_gguf_file_is_exit_2_naming_it(monkeypatch, tmp_path, capsys):
    from gguf_fixture import write_tiny_gguf
    from weft.core.commands.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "cut.gguf")
    gguf.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    assert main(["plan", str(_recipe(tmp_path, "cut.gguf"))]) == 2
    err = capsys.readouterr().err
    assert f"{gguf.resolve()} is not a GGUF model transformers can read" in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache" / "weft" / "gguf").glob("cut-*"))  # nothing half-converted left as done


def test_a_text_only_model_generates_and_evaluates_from_its_gguf(tmp_path):
    """`weft generate --model-dir FILE.gguf` and `weft eval --model-dir` for a text-only model:
    no image processor asked for (at 0149418: exit 2, "has no preprocessor_config.json"), the
    prompt through the file's own chat template, the greedy tokens transformers' generate gives
    on the same prompt; a chat dataset's loss under eval."""
    import os

    import transformers

    from gguf_fixture import write_tiny_gguf
    from weft_cli import run_weft

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "chat.gguf", seed=1)
    done = run_weft("generate", "--model-dir", str(gguf), "--prompt", "hello world", "--max-new-tokens", "6",
                    "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)["tokens"]
    (folder,) = (tmp_path / "cache" / "weft" / "gguf").glob("chat-*")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    want = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=tokenizer.pad_token_id)[0, prompt.shape[1]:].tolist()
    assert got == want[:len(got)] and len(got) >= 1, (got, want)

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                       "content": a}]}) + "\n"
                            for q, a in (("hello", "world"), ("hi", "hello world"))))
    done = run_weft("eval", "--model-dir", str(gguf), "--data", str(data), "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    # transformers' forward of the same directory, the reply (through its closing token) labelled.
    loss_sum, count = 0.0, 0
    for line in data.read_text().splitlines():
        messages = json.loads(line)["messages"]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        start = len(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True))
        end = len(text.rstrip())
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor([encoded["input_ids"]])
        labelled = torch.tensor([a < end and b > start for a, b in encoded["offset_mapping"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:], reduction="none")
        loss_sum += float(losses[labelled[1:]].sum())
        count += int(labelled[1:].sum())
    assert result["label_tokens"] == count
    assert result["loss"] == pytest.approx(loss_sum / count, rel=1e-5)
