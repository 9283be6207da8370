"""Model directories as the Hub ships them: sharded safetensors with their index, the
tokenizer and image processor files, generation_config.json, a chat template. They train
and export with every file along; one that lacks a file the data or the prompt reads is
exit 2 before any rank starts, naming it. In-process (`weft.core.commands.main.main`), one rank."""

from __future__ import annotations

import json
import pathlib
import shutil
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: What a downloaded Qwen2.5-VL directory carries beside its weights (the tiny tokenizer and
#: image processor standing in for the real ones).
CARRIED = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja",
           "chat_template.json")
#: config.json in the layout Qwen2.5-VL's Hub repositories ship (written by transformers 4.x: the
#: text keys at the top, mRoPE as rope_scaling), for the tiny preset's shape: transformers 5
#: reads it as its own nested layout.
HUB_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2", "attention_dropout": 0.0, "bos_token_id": 306, "eos_token_id": 308,
    "vision_start_token_id": 315, "vision_end_token_id": 316, "vision_token_id": 317, "image_token_id": 318,
    "video_token_id": 319, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 4096, "max_window_layers": 80, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": 320, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {"depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                      "in_chans": 3, "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
}
# The directory ships Qwen2.5-VL's own chat template, as the Hub repository does (training renders with it).
TEMPLATE = json.loads((pathlib.Path(__file__).parent / "data" / "chat_templates.json").read_text())["qwen2_5_vl"][
    "chat_template"]


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> pathlib.Path:
    import transformers

    from model_helpers import build_model
    from weft.core.recipe import Recipe

    folder = tmp_path_factory.mktemp("hub") / "Qwen2.5-VL-tiny"
    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}}), seed=3)
    model.generation_config = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8,
                                                            repetition_penalty=1.05, eos_token_id=308)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="150KB")  # bf16, as Qwen's are published
    (folder / "config.json").write_text(json.dumps(HUB_CONFIG, indent=2))
    for name in CARRIED[:3]:
        shutil.copy(ROOT / "recipes" / "tiny_vl" / name, folder / name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def _recipe(tmp_path: pathlib.Path, model_dir: pathlib.Path, **train) -> pathlib.Path:
    path = tmp_path / "from-hub.toml"
    keys = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {"max_steps": 1, "micro_batch_tokens": 512, **train}.items())
    path.write_text(textwrap.dedent(f'''
        [model]
        path = "{model_dir}"
        [data]
        source = "synthetic"
        num_samples = 8
        min_side = 28
        max_side = 56
        [parallel]
        nproc = 1
        [train]
    ''') + keys + "\n")
    return path


@pytest.mark.quick
def test_the_fixture_is_sharded_as_downloaded(hub_dir):
    """Several shards and their index, the tensors under the checkpoints' legacy names
    (``model.layers.*``, ``visual.*``), the config in the 4.x layout."""
    index = json.loads((hub_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and not (hub_dir / "model.safetensors").exists()
    assert "model.layers.0.self_attn.q_proj.weight" in index and "visual.blocks.0.attn.qkv.weight" in index
    assert "text_config" not in json.loads((hub_dir / "config.json").read_text())


@pytest.mark.quick
def test_a_directory_without_preprocessor_config_is_exit_2_naming_it(hub_dir, tmp_path, capsys):
    """Synthetic conversations make images through the image processor: without its file the
    run stops before any rank starts, one paragraph, nothing written; `weft generate` too."""
    from weft.core.commands.main import main

    stripped = tmp_path / "stripped"
    shutil.copytree(hub_dir, stripped)
    (stripped / "preprocessor_config.json").unlink()
    recipe = _recipe(tmp_path, stripped)
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"(model.path): {stripped} has no preprocessor_config.json" in err and "data.source = 'synthetic'" in err
    assert "Traceback" not in err and err.count("weft: error:") == 1
    assert not (tmp_path / "run").exists()

    assert main(["generate", "--model-dir", str(stripped), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert f"{stripped} has no preprocessor_config.json" in err and "weft generate --prompt" in err

    (stripped / "tokenizer.json").unlink()
    shutil.copy(hub_dir / "preprocessor_config.json", stripped)
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{stripped} has no tokenizer (tokenizer.json or vocab.json or tokenizer.model)" in capsys.readouterr().err


@pytest.mark.quick
def test_long_synthetic_text_reads_no_image_processor(hub_dir, tmp_path):
    """data.tokens without images: nothing of the image processor is needed, so its file may
    be missing (a text model's directory has none)."""
    from weft.core.recipe import Recipe
    from weft.core.run.model_files import check_processor_files, data_needs

    recipe = Recipe.from_toml(str(_recipe(tmp_path, tmp_path)), overrides=("data.tokens=64",))
    assert data_needs(recipe) == {}
    check_processor_files(recipe, str(tmp_path), needs=data_needs(recipe))  # an empty folder: nothing to read
    with_images = Recipe.from_toml(str(_recipe(tmp_path, tmp_path)), overrides=("data.tokens=64",
                                                                                 "data.images=[[56, 56]]"))
    assert sorted(data_needs(with_images)) == ["image processor", "tokenizer"]


def test_a_hub_directory_trains_and_exports_with_its_files(hub_dir, tmp_path, capsys):
    """One step at lr 0 from the sharded bf16 directory, then `weft export`: the exported weights
    are the downloaded ones exactly (every shard was read, bf16 into float32 losslessly), and the tokenizer, the image
    processor, both chat templates and the generation settings came along; transformers
    loads the export, its processor too."""
    import transformers

    from weft.core.commands.main import main

    run_dir = tmp_path / "run"
    assert main(["run", str(_recipe(tmp_path, hub_dir, lr=0.0)), "--run-dir", str(run_dir)]) == 0, \
        capsys.readouterr().err[-3000:]
    loaded = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
              if '"weights.loaded"' in line]
    index = json.loads((hub_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert loaded and loaded[0]["tensors"] == len(index)  # from every shard
    out = tmp_path / "export"
    assert main(["export", str(run_dir), str(out)]) == 0, capsys.readouterr().err[-3000:]
    for name in CARRIED:
        assert (out / name).read_bytes() == (hub_dir / name).read_bytes(), name
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"], generation["repetition_penalty"]) == (0.7, 0.8, 1.05)

    auto = transformers.AutoModelForImageTextToText
    want, got = auto.from_pretrained(hub_dir).state_dict(), auto.from_pretrained(out).state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k].float(), got[k].float()) for k in want)
    assert transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|im_end|>") == 308
    assert transformers.AutoImageProcessor.from_pretrained(out).to_dict()["patch_size"] == \
        json.loads((hub_dir / "preprocessor_config.json").read_text())["patch_size"]


@pytest.mark.quick
def test_a_shard_missing_from_the_index_is_exit_2_naming_it(hub_dir, tmp_path, capsys):
    """An interrupted download: the index lists a shard the directory lacks; named before any
    rank starts (weft run and weft eval), not found by each rank as it reads."""
    from weft.core.commands.main import main

    partial = tmp_path / "partial"
    shutil.copytree(hub_dir, partial)
    shard = sorted(partial.glob("model-*.safetensors"))[-1]
    shard.unlink()
    recipe = _recipe(tmp_path, partial)
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"(model.path): {partial} lacks 1 of the " in err and shard.name in err and "Traceback" not in err
    assert main(["eval", "--model-dir", str(partial)]) == 2
    assert shard.name in capsys.readouterr().err

    (partial / "model.safetensors.index.json").unlink()
    for other in partial.glob("*.safetensors"):
        other.unlink()
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{partial} has no model.safetensors" in capsys.readouterr().err


def test_a_directory_s_own_code_never_runs(hub_dir, tmp_path, capsys):
    """A downloaded directory may carry code (an ``auto_map`` in its configs naming its own .py
    files) and pickles (a ``pytorch_model.bin``): weft builds transformers' own classes from
    the JSON and reads the safetensors only, so a run trains and nothing of it runs; a model
    type only its own code defines is exit 2, never a prompt to run it (docs/faults.md)."""
    import pickle

    from fault_runs import Planted
    from weft.core.commands.main import main

    marker = tmp_path / "code-ran"
    carrying = tmp_path / "carrying"
    shutil.copytree(hub_dir, carrying)
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil", "image_processing_evil"):
        (carrying / f"{module}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    config = dict(HUB_CONFIG, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                        "AutoModelForImageTextToText": "modeling_evil.EvilModel"})
    (carrying / "config.json").write_text(json.dumps(config))
    for name, key, value in (("tokenizer_config.json", "AutoTokenizer", ["tokenization_evil.EvilTokenizer", None]),
                             ("preprocessor_config.json", "AutoImageProcessor",
                              "image_processing_evil.EvilImageProcessor")):
        entry = json.loads((carrying / name).read_text())
        (carrying / name).write_text(json.dumps(dict(entry, auto_map={key: value})))
    (carrying / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(marker)))
    assert main(["run", str(_recipe(tmp_path, carrying)), "--run-dir", str(tmp_path / "run")]) == 0, \
        capsys.readouterr().err[-3000:]
    assert not marker.exists()

    (carrying / "config.json").write_text(json.dumps(dict(config, model_type="evil_remote")))
    assert main(["run", str(_recipe(tmp_path, carrying)), "--run-dir", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err
    assert "'evil_remote'" in err and "Traceback" not in err and err.count("weft: error:") == 1
    assert not marker.exists()


@pytest.mark.quick
def test_a_file_only_its_own_code_reads_is_exit_2_naming_it(hub_dir, tmp_path, capsys):
    """A processor folder whose preprocessor_config.json names the directory's own image processor
    (an auto_map) and no class transformers ships: one exit-2 paragraph naming the file and its
    auto_map before any rank starts, nothing of it imported (it was exit 1 and transformers'
    traceback asking to pass trust_remote_code=True); tokenizer_config.json and config.json alike."""
    from weft.core.commands.main import main

    marker = tmp_path / "code-ran"
    folder = tmp_path / "processor"
    folder.mkdir()
    for name in CARRIED[:3]:
        shutil.copy(hub_dir / name, folder / name)
    for module in ("tokenization_evil", "image_processing_evil", "configuration_evil"):
        (folder / f"{module}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    for name, key, value in (("preprocessor_config.json", "image_processor_type", "EvilImageProcessor"),
                             ("tokenizer_config.json", "tokenizer_class", "EvilTokenizer")):
        entry = json.loads((folder / name).read_text())
        auto = {"AutoImageProcessor": "image_processing_evil.EvilImageProcessor"} if key == "image_processor_type" \
            else {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        (folder / name).write_text(json.dumps(dict(entry, auto_map=auto, **{key: value})))
    recipe = tmp_path / "own-processor.toml"
    recipe.write_text(f'[model]\npreset = "qwen2_5_vl_tiny"\nprocessor = "{folder}"\n[data]\nnum_samples = 8\n'
                      "[train]\nmax_steps = 1\n[parallel]\nnproc = 1\n")

    def refused(name: str, named: str, native: str) -> None:
        assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert (f"weft: error: {recipe} (model.processor): {folder / name}: auto_map names the directory's own code "
                f"({named}) and {native} is not one of transformers' classes, so only that code could read it; weft "
                "never runs a model directory's code (trust_remote_code is never true). Accepted: a directory whose "
                "config, tokenizer and image processor transformers ships") in err, err[-2000:]
        assert "Traceback" not in err and err.count("weft: error:") == 1
        assert not marker.exists() and not (tmp_path / "run").exists()

    refused("tokenizer_config.json", "AutoTokenizer: ['tokenization_evil.EvilTokenizer', None]",
            "tokenizer_class 'EvilTokenizer'")
    shutil.copy(hub_dir / "tokenizer_config.json", folder)  # transformers' own tokenizer: the image processor next
    refused("preprocessor_config.json", "AutoImageProcessor: image_processing_evil.EvilImageProcessor",
            "image_processor_type 'EvilImageProcessor'")

    # config.json: a model type no installed family handles is refused by name first (test above); one a
    # plugin's family would take but only the directory's code defines is read here, where the message is weft's.
    from weft.core.errors import WeftError
    from weft.core.recipe import Recipe
    from weft.plugins.models.build import model_config

    model = tmp_path / "own-config"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(HUB_CONFIG, model_type="evil_remote",
                                                       auto_map={"AutoConfig": "configuration_evil.EvilConfig"})))
    shutil.copy(folder / "configuration_evil.py", model)
    with pytest.raises(WeftError) as refusal:
        model_config(Recipe.from_toml(_recipe(tmp_path, model)))
    assert str(refusal.value).startswith(
        f"{tmp_path / 'from-hub.toml'} (model.path): {model / 'config.json'}: auto_map names the directory's own code "
        "(AutoConfig: configuration_evil.EvilConfig) and model_type 'evil_remote' is not one of transformers' classes")
    assert refusal.value.exit_code == 2 and not marker.exists()


@pytest.mark.quick
def test_model_dir_errors_name_the_folder_given(hub_dir, tmp_path, capsys, monkeypatch):
    """`weft eval --model-dir DIR` and `weft generate --model-dir DIR`: a mistake found while the
    recipe --model-dir stands for is in use is said of `--model-dir DIR` as typed, never of the
    temporary model-dir.toml weft wrote for it."""
    from weft.core.commands.main import main

    partial = tmp_path / "partial"
    shutil.copytree(hub_dir, partial)
    sorted(partial.glob("model-*.safetensors"))[-1].unlink()
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--model-dir", "partial"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weft: error: --model-dir partial: {partial} lacks 1 of the "), err
    assert "model-dir.toml" not in err

    assert main(["generate", "--model-dir", "partial", "--prompt", "hello", "--set", "train.seed=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weft: error: --model-dir partial (--set train.seed=-1): seed = -1 is out of range"), err
    assert "model-dir.toml" not in err
