"""LLaVA's records (a singular ``image`` / ``video`` key, ``<image>`` in the human turn) read as
the ``images`` lines they mean; a placeholder without its file, or a file without its
placeholder, is a bad sample named by its line, never literal text in the prompt."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image

from weft.strategies.data.datasets import BadSample, jsonl_samples


def llava(image, question="<image>\nWhat colour is it?", answer="Red.", key="image"):
    record = {"id": "000000033471",
              "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
    if image is not None:
        record[key] = image
    return record


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "coco").mkdir()
    Image.new("RGB", (84, 56), (200, 30, 30)).save(tmp_path / "coco" / "red.png")
    Image.new("RGB", (56, 56), (30, 30, 200)).save(tmp_path / "coco" / "blue.png")
    return tmp_path


def read(folder, records, cache=False):
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return list(jsonl_samples(path, processor="tiny_vl", cache_dir=folder / "cache" if cache else None)), path


def test_llava_image_key_gives_the_images_line_s_tokens_and_pixels(folder):
    two = "<image>\nand <image>\nWhich is red?"
    samples, _ = read(folder, [
        llava("coco/red.png"), llava(["coco/red.png"]), llava(["coco/red.png"], key="images"),
        llava(["coco/red.png", "coco/blue.png"], question=two), llava(["coco/red.png", "coco/blue.png"], question=two,
                                                                       key="images"),
    ])
    assert not any(isinstance(s, BadSample) for s in samples)
    one, listed, plural, both, both_plural = samples
    for sample in (listed, plural):
        assert torch.equal(sample.input_ids, one.input_ids) and torch.equal(sample.labels, one.labels)
        assert torch.equal(sample.pixel_values, one.pixel_values)
        assert torch.equal(sample.image_grid_thw, one.image_grid_thw)
    assert one.image_grid_thw.shape[0] == 1 and both.image_grid_thw.shape[0] == 2
    assert torch.equal(both.input_ids, both_plural.input_ids)
    assert torch.equal(both.pixel_values, both_plural.pixel_values)
    # The placeholder became the image's pads, not text: no "<image>" is left in the prompt.
    from weft.strategies.data.conversation import load_processor

    tokenizer, _ = load_processor("tiny_vl")
    assert "<image>" not in tokenizer.decode(one.input_ids)


@pytest.mark.parametrize("record, reason", [
    (llava(None), "1 <image> placeholders but 0 images"),  # the silent failure this guards against
    ({"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}]},
     "1 <image> placeholders but 0 images"),
    (llava("coco/red.png", question="What colour is it?"), "0 <image> placeholders but 1 images"),
    (llava(["coco/blue.png"] * 2, question="What moves?", key="video"), "0 <video> placeholders but 2 videos"),
    ({**llava("coco/red.png"), "images": ["coco/red.png"]}, "both 'images' and 'image' keys"),
    (llava("coco/nowhere.png"), "not found"),
])
def test_placeholder_file_mismatch_is_a_bad_sample_named_by_its_line(folder, record, reason):
    samples, path = read(folder, [llava("coco/red.png"), record])
    assert not isinstance(samples[0], BadSample)
    assert isinstance(samples[1], BadSample) and samples[1].where == f"{path}:2"
    assert reason in samples[1].reason, samples[1].reason


def test_cache_sees_a_changed_llava_image(folder):
    """The singular key's file is part of the cache key: a changed image is encoded again."""
    first, _ = read(folder, [llava("coco/red.png")], cache=True)
    Image.new("RGB", (56, 112), (30, 200, 30)).save(folder / "coco" / "red.png")
    stat = (folder / "coco" / "red.png").stat()
    os.utime(folder / "coco" / "red.png", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second, _ = read(folder, [llava("coco/red.png")], cache=True)
    assert not torch.equal(first[0].image_grid_thw, second[0].image_grid_thw)
