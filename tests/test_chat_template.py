"""Conversations in the model's own chat format: for the real Qwen2-VL, Qwen2.5-VL and Qwen3-VL
templates (tests/data/chat_templates.json), weft's token ids equal transformers'
``apply_chat_template(..., tokenize=True)`` with each image and video pad widened to its feature
count, as the model's processor widens it; labels sit on assistant replies and their closing
``<|im_end|>`` only; ``data.system`` and a sample's own system message; the generation prompt
of ``weft generate``; weft's built-in layout is Qwen2.5-VL's template. CPU, a few seconds."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from PIL import Image

from weft.core.recipe.data import DataSection
from weft.strategies.data.chat_format import builtin_layout, template_messages
from weft.strategies.data.conversation import (
    IGNORE_INDEX,
    IMAGE_TYPE,
    VIDEO_TYPE,
    encode_conversation,
    encode_prompt,
    load_processor,
    processor_dir,
)

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

TEMPLATES = json.loads((pathlib.Path(__file__).parent / "data" / "chat_templates.json").read_text(encoding="utf-8"))
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _image(colour, size=(84, 56)):
    return Image.new("RGB", size, colour)


def _video(frames=4):
    return [Image.new("RGB", (56, 56), (40 * i, 100, 200)) for i in range(frames)]


CONVERSATIONS = {
    "text": [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi! How can I help?"}],
    "image": [
        {"role": "user", "content": [{"type": "image", "image": _image("red")},
                                     {"type": "text", "text": "What colour is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
    ],
    "multi_turn": [
        {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image", "image": _image("blue")},
                                     {"type": "text", "text": " and second:"},
                                     {"type": "image", "image": _image("green", (56, 112))}]},
        {"role": "assistant", "content": "Blue, then green."},
        {"role": "user", "content": "And the first one again?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue.\n"}]},
    ],
    "video": [
        {"role": "user", "content": [{"type": "video", "video": _video(), "fps": 2.0},
                                     {"type": "image", "image": _image("white")},
                                     {"type": "text", "text": "What moves?"}]},
        {"role": "assistant", "content": "The colour changes."},
    ],
    "system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": [{"type": "image", "image": _image("black")}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "Black."},
    ],
}


def _folder(tmp_path_factory, family: str | None) -> pathlib.Path:
    """tiny_vl with the family's template as the Hub ships it (chat_template.json), or none."""
    folder = tmp_path_factory.mktemp(family or "no_template")
    for path in processor_dir("tiny_vl").iterdir():
        if path.suffix == ".json":
            shutil.copy(path, folder / path.name)
    if family is not None:
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATES[family]["chat_template"]}),
                                                   encoding="utf-8")
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    tokenizer, image_processor = load_processor(_folder(tmp_path_factory, request.param))
    return request.param, tokenizer, image_processor


def _widened(ids: list[int], sample, tokenizer) -> list[int]:
    """The template's ids with each placeholder pad repeated grid_t * grid_h * grid_w / 4 times."""
    pad = {tokenizer.convert_tokens_to_ids("<|image_pad|>"): sample.image_grid_thw,
           tokenizer.convert_tokens_to_ids("<|video_pad|>"): sample.video_grid_thw}
    counts = {token: iter([] if grids is None else (grids.prod(-1) // 4).tolist()) for token, grids in pad.items()}
    out = []
    for token in ids:
        out += [token] * next(counts[token]) if token in counts else [token]
    assert all(next(rest, None) is None for rest in counts.values())  # every image and video had a placeholder
    return out


def _template_ids(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"]


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_ids_equal_the_templates_tokenization(family, name):
    kind, tokenizer, image_processor = family
    messages = CONVERSATIONS[name]
    sample = encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)
    assert sample.input_ids.tolist() == _widened(_template_ids(tokenizer, messages), sample, tokenizer)
    n_images = sum(part["type"] == "image" for m in messages if not isinstance(m["content"], str)
                   for part in m["content"])
    if n_images:
        grids = image_processor(images=[p["image"] for m in messages if not isinstance(m["content"], str)
                                        for p in m["content"] if p["type"] == "image"],
                                return_tensors="pt")["image_grid_thw"]
        assert torch.equal(sample.image_grid_thw, grids)
        assert int((sample.mm_token_type_ids == IMAGE_TYPE).sum()) == int(grids.prod(-1).sum()) // 4
    if name == "video":
        assert int((sample.mm_token_type_ids == VIDEO_TYPE).sum()) == int(sample.video_grid_thw.prod(-1).sum()) // 4
    opening = tokenizer.decode(sample.input_ids[:60])
    if name == "system":
        assert opening.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>")
    elif kind == "qwen3_vl":  # Qwen3-VL's template has no default system prompt
        assert opening.startswith("<|im_start|>user\n")
    else:
        assert opening.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_labels_only_on_replies_and_their_closing_token(family, name):
    _, tokenizer, image_processor = family
    messages = CONVERSATIONS[name]
    sample = encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)
    keep = sample.labels != IGNORE_INDEX
    assert torch.equal(sample.labels[keep], sample.input_ids[keep])
    replies = [m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
               for m in messages if m["role"] == "assistant"]
    # Each run of labelled tokens is one reply and its <|im_end|>, right after the assistant's header.
    edges = torch.diff(torch.cat([keep.new_zeros(1), keep, keep.new_zeros(1)]).long()).tolist()
    starts = [i for i, d in enumerate(edges) if d == 1]
    ends = [i for i, d in enumerate(edges) if d == -1]
    runs = [tokenizer.decode(sample.input_ids[a:b]) for a, b in zip(starts, ends)]
    assert runs == [reply + "<|im_end|>" for reply in replies]
    assert all(tokenizer.decode(sample.input_ids[:a]).endswith("<|im_start|>assistant\n") for a in starts)


def test_data_system_replaces_the_default_but_not_a_samples_own(family):
    _, tokenizer, image_processor = family
    for name in ("text", "image", "system"):
        messages = CONVERSATIONS[name]
        sample = encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor,
                                     system="Be brief.")
        own = messages[0]["role"] == "system"
        expected = messages if own else [{"role": "system", "content": "Be brief."}, *messages]
        assert sample.input_ids.tolist() == _widened(_template_ids(tokenizer, expected), sample, tokenizer)
        opening = "You answer in one word." if own else "Be brief."
        assert tokenizer.decode(sample.input_ids[:60]).startswith(f"<|im_start|>system\n{opening}<|im_end|>")


def test_the_generation_prompt_is_the_templates(family):
    _, tokenizer, image_processor = family
    messages = CONVERSATIONS["image"][:1]
    for system in (None, "Be brief."):
        prompt = encode_prompt(messages, tokenizer=tokenizer, image_processor=image_processor, system=system)
        chat = messages if system is None else [{"role": "system", "content": system}, *messages]
        assert prompt.input_ids.tolist() == _widened(_template_ids(tokenizer, chat, add_generation_prompt=True),
                                                     prompt, tokenizer)
        assert tokenizer.decode(prompt.input_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert prompt.num_label_tokens == 0


def test_weft_generate_prompts_like_the_template(tmp_path_factory):
    from weft.plugins.models.prompt import prompt_inputs

    folder = _folder(tmp_path_factory, "qwen3_vl")
    tokenizer, _ = load_processor(folder)
    picture = tmp_path_factory.mktemp("picture") / "red.png"
    _image("red").save(picture)
    got = prompt_inputs(processor=str(folder), text="What colour?", images=[str(picture)], system="Be brief.")
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    want = _template_ids(tokenizer, chat, add_generation_prompt=True)
    pads = int(got["image_grid_thw"].prod()) // 4
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    want = [t for token in want for t in ([token] * pads if token == pad else [token])]
    assert got["input_ids"][0].tolist() == want
    assert got["attention_mask"].all() and int((got["mm_token_type_ids"] == IMAGE_TYPE).sum()) == pads


def test_the_builtin_layout_is_qwen2_5_vls_template(tmp_path_factory):
    """A processor without a chat template renders what Qwen2.5-VL's renders, default system prompt included."""
    bare_tokenizer, image_processor = load_processor(_folder(tmp_path_factory, None))
    assert not bare_tokenizer.chat_template
    qwen_tokenizer, _ = load_processor(_folder(tmp_path_factory, "qwen2_5_vl"))
    template = TEMPLATES["qwen2_5_vl"]["chat_template"]
    for messages in CONVERSATIONS.values():
        chat = template_messages(messages, system=None)
        for prompt in (False, True):
            assert builtin_layout(chat, prompt) == qwen_tokenizer.apply_chat_template(
                chat, chat_template=template, tokenize=False, add_generation_prompt=prompt)
        ours = encode_conversation(messages, tokenizer=bare_tokenizer, image_processor=image_processor)
        theirs = encode_conversation(messages, tokenizer=qwen_tokenizer, image_processor=image_processor)
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.labels, theirs.labels)


def test_the_bundled_processor_carries_qwen2_5_vls_template():
    tokenizer, _ = load_processor("tiny_vl")
    assert tokenizer.chat_template == TEMPLATES["qwen2_5_vl"]["chat_template"]
    assert TEMPLATES["qwen2_vl"]["chat_template"] == TEMPLATES["qwen2_5_vl"]["chat_template"]


def test_an_image_the_template_leaves_out_is_refused(tmp_path_factory):
    """Qwen3-VL's template renders only the text of assistant turns: an image there has no place."""
    tokenizer, image_processor = load_processor(_folder(tmp_path_factory, "qwen3_vl"))
    messages = [{"role": "user", "content": "Draw it."},
                {"role": "assistant", "content": [{"type": "image", "image": _image("red")},
                                                  {"type": "text", "text": "Here."}]}]
    with pytest.raises(ValueError, match="image-token count: the chat text holds 0 image placeholders for 1 image"):
        encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)


def test_a_template_that_is_not_rendered_turn_by_turn_is_refused(tmp_path_factory):
    tokenizer, image_processor = load_processor(_folder(tmp_path_factory, None))
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"  # only the last message: no prefixes to compare
    with pytest.raises(ValueError, match="as a continuation of the turns before it"):
        encode_conversation(CONVERSATIONS["text"], tokenizer=tokenizer, image_processor=image_processor)
    tokenizer.chat_template = "{{ raise_exception('no images here') }}"
    with pytest.raises(ValueError, match="the chat template failed: .*no images here"):
        encode_conversation(CONVERSATIONS["text"], tokenizer=tokenizer, image_processor=image_processor)


def test_the_processors_template_file_comes_before_the_tokenizers(tmp_path_factory):
    folder = _folder(tmp_path_factory, "qwen3_vl")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                                encoding="utf-8")
    assert load_processor(folder)[0].chat_template.startswith("{% for m in messages %}")
    (folder / "chat_template.json").write_text("not json", encoding="utf-8")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="chat_template.json: not a chat template file"):
        load_processor(folder)


def test_data_system_key_and_the_cache(tmp_path):
    from weft.strategies.data.datasets import jsonl_samples

    assert DataSection().system is None and DataSection(system="Be brief.").system == "Be brief."
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS["text"]}) + "\n", encoding="utf-8")
    tokenizer, _ = load_processor("tiny_vl")
    cache = tmp_path / "cache"
    first = next(jsonl_samples(path, processor="tiny_vl", cache_dir=cache))
    again = next(jsonl_samples(path, processor="tiny_vl", cache_dir=cache, system="Be brief."))
    # The system prompt is part of the cache key: the second sample is encoded again, not read back.
    assert tokenizer.decode(first.input_ids).startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert tokenizer.decode(again.input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
