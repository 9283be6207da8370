"""Over-long samples: truncation never cuts inside an image span."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from weft.strategies.data.conversation import encode_conversation, load_processor, truncate_sample

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)


@pytest.fixture(scope="module")
def processor():
    return load_processor("tiny_vl")


def two_image_sample(processor):
    tokenizer, image_processor = processor
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "First:"},
                                     {"type": "image", "image": Image.new("RGB", (56, 56), "red")},
                                     {"type": "text", "text": "second:"},
                                     {"type": "image", "image": Image.new("RGB", (84, 56), "blue")}]},
        {"role": "assistant", "content": "Red, then blue."},
    ]
    return encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)


def test_cut_inside_an_image_moves_before_its_span(processor):
    tokenizer, _ = processor
    sample = two_image_sample(processor)
    starts = (sample.input_ids == tokenizer.convert_tokens_to_ids("<|vision_start|>")).nonzero().flatten().tolist()
    with pytest.raises(ValueError, match="no assistant reply"):
        truncate_sample(sample, starts[1] + 3, tokenizer=tokenizer)  # the reply comes after both images


def test_truncation_keeps_whole_images_and_their_patches(processor):
    tokenizer, image_processor = processor
    # Put the reply before the images, so a cut in the second image still leaves something to learn.
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (56, 56), "red")},
        {"type": "image", "image": Image.new("RGB", (84, 56), "blue")}]}]

    sample = encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    starts = (sample.input_ids == start).nonzero().flatten().tolist()
    cut = truncate_sample(sample, starts[1] + 2, tokenizer=tokenizer)
    assert cut.num_tokens == starts[1]  # cut moved to just before the second image's span
    assert cut.image_grid_thw.shape[0] == 1
    assert cut.pixel_values.shape[0] == int(sample.image_grid_thw[0].prod())
    assert torch.equal(cut.input_ids, sample.input_ids[: starts[1]])
    assert truncate_sample(sample, sample.num_tokens, tokenizer=tokenizer) is sample
