"""YaRN from the recipe, the position watch, and the factor a run's data needs.

transformers computes YaRN (and applies it to 3-D mRoPE); weft writes the parameters,
so the checks are: the built model's rotary tables are transformers' YaRN tables for
the same numbers, they survive an export, sequence parallelism stays exact with them,
and the largest position id is read from what the decoder really gets (mRoPE keeps it
below the token count).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from model_helpers import ListLog, build_model, family_of
from weft.core.recipe import Recipe
from weft.plugins.models.build import model_config, rope_summary, trained_context, widen_context
from weft.strategies.model.yarn import needed_factor, yarn_parameters

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _text_rotary(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for n, m in model.named_modules() if n.endswith("rotary_emb") and "visual" not in n)


def _recipe(preset: str, **model) -> Recipe:
    return Recipe.from_dict({"model": {"preset": preset, **model}})


@pytest.mark.quick
def test_needed_factor():
    assert needed_factor(4095, trained=4096) == 1.0  # positions 0..4095 fit exactly
    assert needed_factor(4096, trained=4096) == 1.1  # one past: rounded up to a tenth
    assert needed_factor(131071, trained=32768) == 4.0
    assert needed_factor(131072, trained=32768) == 4.1


@pytest.mark.quick
def test_yarn_parameters_keep_theta_and_mrope_sections():
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    out = yarn_parameters(rope, factor=4.0, original=32768)
    assert out == {"rope_type": "yarn", "rope_theta": 1e6, "mrope_section": [16, 24, 24], "factor": 4.0,
                   "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="above 1"):
        yarn_parameters(rope, factor=1.0, original=32768)


@pytest.mark.quick
def test_an_export_announces_the_positions_an_unscaled_run_trained_on(tmp_path):
    """A run trained unscaled past its preset's context exports that context, so a later YaRN
    factor counts from the trained length; a scaled config and a shorter run keep theirs."""
    from weft.core.commands.export import _positions_reached

    config, _ = model_config(_recipe("qwen2_5_vl_tiny"))
    declared = trained_context(config)[0]
    widen_context(config, positions=declared - 7)
    assert trained_context(config) == (declared, declared)
    widen_context(config, positions=4 * declared)
    assert trained_context(config) == (4 * declared, 4 * declared)
    yarn, _ = model_config(_recipe("qwen2_5_vl_tiny", rope_scaling="yarn", rope_factor=2.0, rope_original_max=512))
    widen_context(yarn, positions=8192)
    assert trained_context(yarn) == (1024, 512)

    step = tmp_path / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2}))  # saved before weft kept the positions
    assert _positions_reached(tmp_path, step) == 0  # no summary: nothing claimed
    (tmp_path / "summary.json").write_text(json.dumps({"largest_position": 16383}))
    assert _positions_reached(tmp_path, step) == 16384
    (tmp_path / "summary.json").write_text(json.dumps({"largest_position": None}))
    assert _positions_reached(tmp_path, step) == 0
    # the checkpoint's own count first: a run resumed (or exported at an earlier step) is not its last summary
    (step / "meta.json").write_text(json.dumps({"step": 2, "largest_position": 4095}))
    (tmp_path / "summary.json").write_text(json.dumps({"largest_position": 16383}))
    assert _positions_reached(tmp_path, step) == 4096


@pytest.mark.quick
@pytest.mark.parametrize("preset", ["qwen2_5_vl_tiny", "qwen2_text_tiny"])
def test_the_model_gets_transformers_yarn_tables(preset):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    recipe = _recipe(preset, rope_scaling="yarn", rope_factor=4.0, rope_original_max=512)
    config, _ = model_config(recipe)
    text = getattr(config, "text_config", None) or config
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](text)
    rotary = _text_rotary(build_model(recipe, device="cpu", seed=0))
    plain = _text_rotary(build_model(_recipe(preset), device="cpu", seed=0))
    torch.testing.assert_close(rotary.inv_freq, want_freq, rtol=0, atol=0)
    assert (rotary.attention_scaling == pytest.approx(want_scale)
            and want_scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1))
    assert (rotary.inv_freq - plain.inv_freq).abs().max() > 1e-3  # YaRN really changed the tables
    assert trained_context(config) == (2048, 512)
    assert rope_summary(config, recipe=recipe) == {"scaling": "yarn", "factor": 4.0, "trained_positions": 512,
                                                   "context": 2048}


@pytest.mark.quick
def test_an_exported_config_keeps_yarn(tmp_path):
    import transformers

    recipe = _recipe("qwen2_5_vl_tiny", rope_scaling="yarn", rope_factor=2.5, rope_original_max=1024)
    config, _ = model_config(recipe)
    config.save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    again = transformers.AutoModelForImageTextToText.from_config(loaded)
    torch.testing.assert_close(_text_rotary(again).inv_freq,
                               _text_rotary(build_model(recipe, device="cpu", seed=0)).inv_freq, rtol=0, atol=0)


def _vl_batch():
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    tokenizer, image_processor = load_processor("tiny_vl")
    conversations = synthetic_conversations(seed=5, num_samples=2, min_side=84, max_side=112)
    samples = [encode_conversation(c.messages, tokenizer=tokenizer, image_processor=image_processor)
               for c in conversations]
    return collate(samples, pad_id=tokenizer.pad_token_id)


@pytest.mark.quick
def test_the_watch_reads_mrope_positions_and_names_the_factor():
    from weft.plugins.models.positions import PositionWatch

    model = build_model(_recipe("qwen2_5_vl_tiny"), device="cpu", seed=0)
    batch = _vl_batch()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    vl = next(m for m in model.modules() if hasattr(m, "get_rope_index"))
    ids, _ = vl.get_rope_index(input_ids=inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                               mm_token_type_ids=inputs["mm_token_type_ids"], attention_mask=inputs["attention_mask"])
    largest = int(ids[:, inputs["attention_mask"].bool()].max())  # (3, B, S): padding excluded
    tokens = int(inputs["attention_mask"].sum(1).max())
    assert largest < tokens - 1, "mRoPE: images advance positions by their side, not their token count"

    log = ListLog()
    context = largest  # one short: the batch reaches position `largest`, the context holds 0..largest-1
    watch = PositionWatch(decoder=family_of(_recipe("qwen2_5_vl_tiny")).text_decoder(model), context=context,
                          original=context // 2, scaling="none", log=log)
    with torch.no_grad():
        model(**inputs, use_cache=False)
        watch.poll()
        model(**inputs, use_cache=False)
        watch.poll()
    assert watch.largest >= largest  # padded rows may carry larger ids, never smaller
    warned = [fields for event, fields in log.events if event == "positions.beyond_trained"]
    assert len(warned) == 1  # once per run
    assert warned[0]["largest_position"] == watch.largest
    assert warned[0]["needed_factor"] == needed_factor(watch.largest, trained=context // 2) > 2.0

    quiet = ListLog()
    quiet_watch = PositionWatch(decoder=family_of(_recipe("qwen2_5_vl_tiny")).text_decoder(model),
                                context=watch.largest + 1, original=watch.largest + 1, scaling="none", log=quiet)
    with torch.no_grad():
        model(**inputs, use_cache=False)
    quiet_watch.poll()
    assert not [e for e, _ in quiet.events if e == "positions.beyond_trained"]


def test_sequence_parallel_stays_exact_with_yarn(weft, tmp_path):
    done = weft("check", str(ROOT / "recipes" / "tiny-vl.toml"), "--world-size", "2", "--json",
                "--set", "parallel.ring=2", "--set", "model.rope_scaling=yarn", "--set", "model.rope_factor=4",
                "--set", "model.rope_original_max=64", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.lstrip().startswith("{"), done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["mesh"]["ring"] == 2, result


@pytest.mark.quick
def test_plan_positions_reads_the_data_like_the_model(capsys):
    """`weft plan --positions`: the largest position id over the recipe's samples equals
    what the model's own forward computes for them, one sample at a time."""
    from weft.core.commands.main import main
    from weft.plugins.batching.samples import sample_source
    from weft.plugins.models.positions import PositionWatch
    from weft.strategies.data.conversation import collate

    tiny = str(ROOT / "recipes" / "tiny-vl.toml")
    sets = ["--set", "data.num_samples=12", "--set", "model.rope_original_max=48"]
    assert main(["plan", tiny, "--positions", "--json", *sets]) == 0
    found = json.loads(capsys.readouterr().out)["positions"]

    recipe = Recipe.from_toml(tiny, overrides=tuple(s for s in sets if s != "--set"))
    tokenizer, source = sample_source(recipe, family_of(recipe))
    model = build_model(recipe, device="cpu", seed=0)
    watch = PositionWatch(decoder=family_of(_recipe("qwen2_5_vl_tiny")).text_decoder(model), context=48, original=48,
                          scaling="none", log=ListLog())
    tokens = []
    with torch.no_grad():
        for sample in source:
            batch = collate([sample], pad_id=tokenizer.pad_token_id)
            model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
            tokens.append(sample.num_tokens)
    assert found["samples"] == len(tokens) == 12 and found["max_tokens"] == max(tokens)
    assert found["largest_position"] == watch.largest < max(tokens) - 1  # mRoPE: fewer positions than tokens
    assert found["context"] == 48 and found["beyond_context"] > 0
    assert found["needed_factor"] == needed_factor(watch.largest, trained=48) > 1.0
