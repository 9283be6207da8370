"""Tiny processor, presets, synthetic data and Qwen2.5-VL preprocessing (CPU, fast)."""

from __future__ import annotations

import importlib.resources
import runpy

import pytest
import torch
import transformers
from PIL import Image

from weft.core.recipe.presets import build_config, load_preset, preset_names
from weft.strategies.data.conversation import (
    IGNORE_INDEX,
    Sample,
    _to_rgb,
    collate,
    encode_conversation,
    load_processor,
)
from weft.strategies.data.synthetic_vl import SHAPE_COLOURS, synthetic_conversations

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)


@pytest.fixture(scope="module")
def processor():
    return load_processor("tiny_vl")  # (tokenizer, image_processor)


@pytest.fixture(scope="module")
def conversations():
    return synthetic_conversations(seed=0, num_samples=12)


@pytest.fixture(scope="module")
def samples(processor, conversations):
    tokenizer, image_processor = processor
    return [encode_conversation(c, tokenizer=tokenizer, image_processor=image_processor) for c in conversations]


@pytest.fixture(scope="module")
def tiny_config():
    model_type, kwargs, processor_name = load_preset("qwen2_5_vl_tiny")
    assert processor_name == "tiny_vl"
    return build_config(model_type, kwargs)


def _fingerprint(conversation):
    """Text and exact pixels of a conversation, for equality checks."""
    out = []
    for message in conversation.messages:
        for part in message["content"]:
            if part["type"] == "text":
                out.append(("text", message["role"], part["text"]))
            else:
                im = part["image"]
                out.append(("image", im.mode, im.size, im.tobytes()))
    return out


def _rendered(conversation, grids, merge):
    """The chat layout as one string, image pads expanded; the conversation has no system
    message, so Qwen2.5-VL's template (which tiny_vl carries) opens with its default one."""
    pads = iter(int(g.prod()) // merge**2 for g in grids)
    text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    for message in conversation.messages:
        text += f"<|im_start|>{message['role']}\n"
        for part in message["content"]:
            if part["type"] == "text":
                text += part["text"]
            else:
                text += "<|vision_start|>" + "<|image_pad|>" * next(pads) + "<|vision_end|>"
        text += "<|im_end|>\n"
    return text


# ---- synthetic data -------------------------------------------------------------


def test_synthetic_is_deterministic(conversations):
    again = synthetic_conversations(seed=0, num_samples=12)
    assert [_fingerprint(c) for c in again] == [_fingerprint(c) for c in conversations]
    other = synthetic_conversations(seed=1, num_samples=12)
    assert [_fingerprint(c) for c in other] != [_fingerprint(c) for c in conversations]


def test_synthetic_images_are_varied_real_pngs(conversations):
    images = [im for c in conversations for im in c.images]
    assert all(im.format == "PNG" for im in images)
    assert {im.mode for im in images} == {"RGB", "RGBA"}
    assert len({im.size[0] for im in images}) > 3 and len({im.size[1] for im in images}) > 3
    assert any(im.size[0] != im.size[1] for im in images)
    assert all(28 <= side <= 112 for im in images for side in im.size)
    assert any(len(c.images) == 2 for c in conversations)


def test_synthetic_answer_names_the_drawn_colour():
    # A single-image colour question: the named colour must be the shape's pixels.
    checked = 0
    for c in synthetic_conversations(seed=3, num_samples=40):
        question = c.messages[0]["content"][-1]["text"]
        answer = c.messages[1]["content"][0]["text"]
        if not question.startswith("What colour is the ") or "background" in question:
            continue
        colour = answer.rstrip(".").split()[-1]
        rgb = _to_rgb(c.images[0]).getcolors(maxcolors=1 << 16)
        assert any(pixel == SHAPE_COLOURS[colour] for _, pixel in rgb), (question, answer)
        checked += 1
    assert checked > 0


# ---- tokenizer and image processor ----------------------------------------------


def test_tokenizer_is_small_and_round_trips(processor):
    tokenizer, _ = processor
    assert len(tokenizer) < 400
    text = "Héllo wörld, 3 squares 🙂\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.pad_token == "<|endoftext|>"


def test_special_ids_match_tiny_preset(processor, tiny_config):
    tokenizer, _ = processor
    ids = tokenizer.convert_tokens_to_ids
    assert ids("<|image_pad|>") == tiny_config.image_token_id
    assert ids("<|video_pad|>") == tiny_config.video_token_id
    assert ids("<|vision_start|>") == tiny_config.vision_start_token_id
    assert ids("<|vision_end|>") == tiny_config.vision_end_token_id
    text = tiny_config.text_config
    assert text.pad_token_id == tokenizer.pad_token_id == ids("<|endoftext|>")
    assert text.eos_token_id == ids("<|im_end|>")
    assert text.vocab_size % 64 == 0 and text.vocab_size >= len(tokenizer)
    _, text_kwargs, _ = load_preset("qwen2_text_tiny")
    assert text_kwargs["vocab_size"] == text.vocab_size
    assert text_kwargs["pad_token_id"] == tokenizer.pad_token_id


def test_shipped_assets_match_build_script():
    folder = importlib.resources.files("weft.recipes") / "tiny_vl"
    # run_path compiles without writing a __pycache__ into the package data folder.
    with importlib.resources.as_file(folder / "build_assets.py") as script:
        build = runpy.run_path(str(script), run_name="tiny_vl_build_assets")
    for name, text in build["render_assets"]().items():
        assert (folder / name).read_text(encoding="utf-8") == text, f"{name} is stale: rerun build_assets.py"


def test_load_processor_from_path():
    with importlib.resources.as_file(importlib.resources.files("weft.recipes") / "tiny_vl") as folder:
        tokenizer, image_processor = load_processor(folder)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 318
    assert image_processor.merge_size == 2
    with pytest.raises(FileNotFoundError):
        load_processor("no_such_processor")


def test_image_processor_gives_small_grids(processor):
    _, image_processor = processor
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"
    out = image_processor(images=[Image.new("RGB", (28, 28)), Image.new("RGB", (112, 100))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    assert out["pixel_values"].shape == (16 + 64, 3 * 2 * 14 * 14)


# ---- encode_conversation / collate ----------------------------------------------


def test_image_pads_match_grids(processor, samples, tiny_config):
    _, image_processor = processor
    merge = image_processor.merge_size
    for s in samples:
        ids = s.input_ids
        starts = (ids == tiny_config.vision_start_token_id).nonzero().flatten().tolist()
        ends = (ids == tiny_config.vision_end_token_id).nonzero().flatten().tolist()
        per_image = [e - b - 1 for b, e in zip(starts, ends)]
        assert per_image == [int(g.prod()) // merge**2 for g in s.image_grid_thw]
        is_pad = ids == tiny_config.image_token_id
        assert int(is_pad.sum()) == sum(per_image)  # no pads outside vision blocks
        assert torch.equal(s.mm_token_type_ids, is_pad.long())
        assert s.pixel_values.shape == (int(s.image_grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
        assert s.pixel_values.dtype == torch.float32 and s.image_grid_thw.dtype == torch.long


def test_input_ids_equal_tokenized_rendered_chat(processor, conversations, samples):
    tokenizer, image_processor = processor
    for c, s in zip(conversations, samples):
        text = _rendered(c, s.image_grid_thw, image_processor.merge_size)
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert s.input_ids.tolist() == expected


def test_labels_only_on_assistant_reply(processor, conversations, samples):
    tokenizer, _ = processor
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for c, s in zip(conversations, samples):
        keep = s.labels != IGNORE_INDEX
        assert torch.equal(s.labels[keep], s.input_ids[keep])
        reply = c.messages[1]["content"][0]["text"]
        assert tokenizer.decode(s.labels[keep]) == reply + "<|im_end|>"
        # Everything up to and including "<|im_start|>assistant\n" is unlabelled,
        # and so is the final "\n".
        assistant_start = (s.input_ids == im_start).nonzero().flatten()[-1].item()
        assert not keep[: assistant_start + 3].any()
        assert not keep[-1]
        assert s.num_label_tokens == int(keep.sum())


def test_rgba_and_other_modes_become_rgb():
    transparent = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    assert _to_rgb(transparent).getpixel((0, 0)) == (255, 255, 255)
    opaque = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    assert _to_rgb(opaque).getpixel((0, 0)) == (255, 0, 0)
    for mode in ("L", "P", "CMYK", "LA"):
        assert _to_rgb(Image.new(mode, (4, 4))).mode == "RGB"


def test_collate_pads_right(processor, samples):
    tokenizer, _ = processor
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = samples[:4]
    out = collate(batch, pad_id=tokenizer.pad_token_id, pad_to_multiple_of=8)
    seq = out["input_ids"].shape[1]
    assert seq % 8 == 0 and seq >= max(s.num_tokens for s in batch)
    for row, s in enumerate(batch):
        n = s.num_tokens
        assert torch.equal(out["input_ids"][row, :n], s.input_ids)
        assert (out["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert out["attention_mask"][row].tolist() == [1] * n + [0] * (seq - n)
        assert (out["labels"][row, n:] == IGNORE_INDEX).all()
    assert out["pixel_values"].shape[0] == sum(s.pixel_values.shape[0] for s in batch)
    assert torch.equal(out["image_grid_thw"], torch.cat([s.image_grid_thw for s in batch]))
    assert torch.equal(out["mm_token_type_ids"], (out["input_ids"] == image_pad).long())

    text_only = Sample(input_ids=torch.tensor([5, 6, 7]), labels=torch.tensor([IGNORE_INDEX, 6, 7]))
    out = collate([text_only], pad_id=0)
    assert set(out) == {"input_ids", "attention_mask", "labels"}


# ---- presets and models ---------------------------------------------------------


def test_all_presets_build_configs():
    for name in preset_names():
        model_type, kwargs, _ = load_preset(name)
        before = repr(kwargs)
        build_config(model_type, kwargs)
        assert repr(kwargs) == before  # build_config must not mutate its input


def test_bad_mrope_section_rejected_at_config_time():
    model_type, kwargs, _ = load_preset("qwen2_5_vl_tiny")
    kwargs["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ValueError, match="mrope_section"):
        build_config(model_type, kwargs)


def test_tiny_model_is_small(tiny_config):
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_config)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_tiny_forward_backward(processor, samples, tiny_config):
    tokenizer, _ = processor
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_config)
    assert isinstance(model, transformers.Qwen2_5_VLForConditionalGeneration)
    assert model.dtype == torch.float32
    batch = collate(samples[:4], pad_id=tokenizer.pad_token_id)
    out = model(**batch)
    assert out.logits.shape == (*batch["input_ids"].shape, tiny_config.text_config.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # The loss must reach the vision tower through the image-pad scatter.
    assert grads["model.visual.patch_embed.proj.weight"].abs().sum() > 0
    # mm_token_type_ids is what switches on 3D (mRoPE) positions for image tokens.
    with torch.no_grad():
        flat = model(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"})
    assert not torch.allclose(flat.logits, out.logits)


@pytest.mark.parametrize(
    ("name", "heads", "kv_heads", "layers", "hidden", "tied"),
    [
        ("qwen2_5_vl_3b", 16, 2, 36, 2048, True),
        ("qwen2_5_vl_7b", 28, 4, 28, 3584, False),
        ("qwen2_5_vl_72b", 64, 8, 80, 8192, False),
    ],
)
def test_real_presets_build_on_meta(name, heads, kv_heads, layers, hidden, tied):
    model_type, kwargs, processor_name = load_preset(name)
    assert processor_name is None
    config = build_config(model_type, kwargs)
    text = config.text_config
    assert (text.num_attention_heads, text.num_key_value_heads, text.num_hidden_layers) == (heads, kv_heads, layers)
    assert text.hidden_size // text.num_attention_heads == 128
    assert config.vision_config.out_hidden_size == hidden
    assert config.image_token_id == 151655 and config.vision_start_token_id == 151652
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    assert all(p.is_meta for p in model.parameters())
    attn = model.model.language_model.layers[0].self_attn
    assert attn.k_proj.out_features == kv_heads * 128
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == tied


def test_qwen2_5_7b_text_preset_builds_on_meta():
    """Qwen2.5-7B's shapes (the text model of Qwen2.5-VL-7B): 7.6B parameters, GQA 28/4."""
    model_type, kwargs, processor_name = load_preset("qwen2_5_7b")
    config = build_config(model_type, kwargs)
    assert model_type == "qwen2" and processor_name is None
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512
    assert model.model.layers[0].self_attn.k_proj.out_features == 4 * 128
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_text_only_preset_runs(processor):
    tokenizer, _ = processor
    model_type, kwargs, processor_name = load_preset("qwen2_text_tiny")
    assert processor_name == "tiny_vl"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(build_config(model_type, kwargs))
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nWhat colour is the square?<|im_end|>\n")])  # (1, S)
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], kwargs["vocab_size"])
    assert torch.isfinite(out.loss)
