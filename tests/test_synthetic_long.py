"""Long synthetic samples: exact lengths, no special id in the text, image tokens that the
model's vision tower agrees with (tiny Qwen2.5-VL forward), pixels as the processor makes
them, and a 7B-shaped 32K sample in well under a second."""

from __future__ import annotations

import time

import pytest
import torch

from weft.core.recipe.presets import build_config, load_preset
from weft.strategies.data.conversation import IGNORE_INDEX, IMAGE_TYPE, collate, load_processor
from weft.strategies.data.synthetic_long import long_samples, special_ids

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

TINY = build_config(*load_preset("qwen2_5_vl_tiny")[:2])
VISION = dict(patch_size=14, merge_size=2, temporal_patch_size=2)


@pytest.fixture(scope="module")
def processor():
    return load_processor("tiny_vl")[1]


def tiny(**kwargs) -> list:
    args = dict(seed=0, num_samples=1, tokens=96, vocab_size=320, special=special_ids(TINY), images=[(28, 56)],
                image_processor=None, **VISION)
    return list(long_samples(**(args | kwargs)))


def image_span(sample, vision_end: int = TINY.vision_end_token_id) -> int:
    """Tokens before the text: vision_start, pads and vision_end of every image."""
    return int(sample.input_ids.eq(vision_end).nonzero().max()) + 1


def test_special_ids_of_the_presets():
    assert special_ids(TINY) == {"image": 318, "video": 319, "vision_start": 315, "vision_end": 316, "bos": 306,
                                 "eos": 308, "pad": 306}
    seven = special_ids(build_config(*load_preset("qwen2_5_vl_7b")[:2]))
    assert seven == {"image": 151655, "video": 151656, "vision_start": 151652, "vision_end": 151653, "bos": 151643,
                     "eos": 151645}


def test_lengths_are_exact():
    assert [s.num_tokens for s in tiny(num_samples=3, tokens=200)] == [200, 200, 200]
    lengths = [s.num_tokens for s in tiny(num_samples=30, tokens=(40, 60))]
    assert min(lengths) >= 40 and max(lengths) <= 60 and len(set(lengths)) > 5
    assert tiny(tokens=(50, 50), images=None)[0].num_tokens == 50


def test_text_ids_are_in_the_vocab_and_never_special():
    special = special_ids(TINY)
    for sample in tiny(num_samples=4, tokens=2000, images=[(28, 56), (56, 56)]):
        text = sample.input_ids[image_span(sample):]
        assert text.min() >= 0 and text.max() < 320
        assert not torch.isin(text, torch.tensor(sorted(set(special.values())))).any()
    # A crowded small vocabulary: every other id is drawn, and only those.
    (sample,) = tiny(tokens=3000, vocab_size=10, special={"eos": 0, "pad": [3, 9], "far": 500}, images=None)
    assert sorted(sample.input_ids.unique().tolist()) == [1, 2, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("with_processor", [False, True])
def test_image_tokens_match_the_grids(with_processor, processor):
    images = [(28, 56), (60, 100)]
    (sample,) = tiny(tokens=300, images=images, image_processor=processor if with_processor else None)
    pads = sample.input_ids == TINY.image_token_id
    assert int(pads.sum()) == int(sample.image_grid_thw.prod(-1).sum()) // 2**2
    assert sample.pixel_values.shape == (int(sample.image_grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
    if not with_processor:  # rounded to multiples of 28 px: 28x56 -> 2x4 patches, 60x100 -> 56x112: 4x8
        assert sample.image_grid_thw.tolist() == [[1, 2, 4], [1, 4, 8]]
    assert int((sample.input_ids == TINY.vision_start_token_id).sum()) == len(images)
    span = image_span(sample)
    assert sample.input_ids[0] == TINY.vision_start_token_id and pads[:span].sum() == pads.sum()
    assert torch.equal(sample.mm_token_type_ids == IMAGE_TYPE, pads)
    assert (sample.labels[:span] == IGNORE_INDEX).all()
    assert torch.equal(sample.labels[span:], sample.input_ids[span:])


def test_pixels_equal_the_processors(processor):
    """At a size the processor keeps (within its min/max pixels, in multiples of 28), the
    direct path gives the processor's pixel values for the same random image."""
    direct, processed = (tiny(images=[(56, 84), (84, 56)], image_processor=p)[0] for p in (None, processor))
    assert torch.equal(direct.image_grid_thw, processed.image_grid_thw)
    assert torch.equal(direct.input_ids, processed.input_ids)
    torch.testing.assert_close(direct.pixel_values, processed.pixel_values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_processor", [False, True])
def test_tiny_model_accepts_the_samples(with_processor, processor):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(TINY, dtype=torch.float32)
    samples = tiny(num_samples=2, tokens=(60, 80), image_processor=processor if with_processor else None)
    batch = collate(samples, pad_id=306)
    # A mismatch raises "Image features and image tokens do not match" here.
    loss = model(**batch).loss
    assert torch.isfinite(loss)


def test_videos_in_the_processors_layout_and_the_model_takes_them(processor):
    """Long samples with a video after the image: 5 frames -> 2 temporal patches; the direct
    layout equals the model's image processor paired into temporal patches (weft's video
    path), the tiny model's rope index and vision tower accept them, and the seconds per
    patch follow video_fps."""
    import transformers

    from weft.strategies.data.conversation import VIDEO_TYPE

    clips = [(5, 56, 84)]
    direct, processed = (tiny(tokens=200, images=[(56, 84)], videos=clips, video_fps=4.0, image_processor=p)[0]
                         for p in (None, processor))
    assert direct.video_grid_thw.tolist() == [[2, 4, 6]] and direct.second_per_grid_ts.tolist() == [0.5]
    torch.testing.assert_close(direct.pixel_values_videos, processed.pixel_values_videos, atol=1e-5, rtol=0)
    assert torch.equal(direct.input_ids, processed.input_ids) and direct.num_tokens == 200
    videos = direct.input_ids == TINY.video_token_id
    assert int(videos.sum()) == 2 * 4 * 6 // 4 and torch.equal(direct.mm_token_type_ids == VIDEO_TYPE, videos)
    assert (direct.labels[: image_span(direct)] == IGNORE_INDEX).all()
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(TINY, dtype=torch.float32)
    assert torch.isfinite(model(**collate([direct, processed], pad_id=306)).loss)


def test_deterministic_by_seed_and_index():
    first = tiny(num_samples=3, tokens=(60, 120))
    again = tiny(num_samples=5, tokens=(60, 120))[:3]  # sample i does not depend on num_samples
    other = tiny(num_samples=3, tokens=(60, 120), seed=1)
    for a, b in zip(first, again):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)
    assert not torch.equal(first[0].pixel_values, other[0].pixel_values)
    assert not all(a.num_tokens == b.num_tokens and torch.equal(a.input_ids, b.input_ids)
                   for a, b in zip(first, other))


def test_seven_b_shaped_32k_sample_is_quick():
    config = build_config(*load_preset("qwen2_5_vl_7b")[:2])
    vision = config.vision_config
    start = time.perf_counter()
    (sample,) = long_samples(seed=0, num_samples=1, tokens=32768, vocab_size=config.text_config.vocab_size,
                             special=special_ids(config), images=[(448, 448), (1008, 756)], image_processor=None,
                             patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                             temporal_patch_size=vision.temporal_patch_size, in_channels=vision.in_channels)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, elapsed  # ~0.2 s on a busy core
    assert sample.num_tokens == 32768
    assert int((sample.input_ids == 151655).sum()) == (32 * 32 + 72 * 54) // 4
    text = sample.input_ids[image_span(sample, 151653):]
    assert text.max() < 152064 and not torch.isin(text, torch.arange(151643, 151657)).any()


def test_refusals(processor):
    with pytest.raises(ValueError, match="no room for text"):
        tiny(tokens=4)  # the 28x56 image takes 1 + 2 + 1 tokens
    with pytest.raises(ValueError, match="special ids"):
        tiny(special={"image": 318})
    with pytest.raises(ValueError, match="merge_size"):
        tiny(image_processor=processor, merge_size=1)
    with pytest.raises(ValueError, match="tokens"):
        long_samples(seed=0, num_samples=1, tokens=(10, 5), vocab_size=320, special={}, images=None,
                     image_processor=None, **VISION)


def test_synthetic_pairs_share_their_prompt_and_label_their_responses():
    """pair_response: a preference pair of two conversations of exactly ``tokens`` tokens, the
    same prompt (image included), different responses, labels on the responses only; the pairs'
    collated batch says which conversation each labelled token belongs to; a response that would
    reach into the image, or a data section asking for pairs without synthetic tokens, is refused."""
    from weft.core.recipe import Recipe
    from weft.strategies.data.pairs import collate_pairs, split_pair

    (sample,) = tiny(pair_response=12)
    chosen, rejected = split_pair(sample)
    assert chosen.num_tokens == rejected.num_tokens == 96
    assert torch.equal(chosen.input_ids[:84], rejected.input_ids[:84])
    assert not torch.equal(chosen.input_ids[84:], rejected.input_ids[84:])
    for half in (chosen, rejected):
        assert (half.labels[:84] == IGNORE_INDEX).all() and torch.equal(half.labels[84:], half.input_ids[84:])
        assert torch.equal(half.pixel_values, sample.pixel_values[:len(half.pixel_values)])
    batch = collate_pairs([sample, *tiny(pair_response=12, seed=1)], collate=lambda s: collate(s, pad_id=0),
                          packed=False)
    assert int(batch["weft_pairs"]) == 2 and batch["input_ids"].shape == (4, 96)
    assert batch["weft_sequence"][:, 0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="reaches into the images"):
        tiny(pair_response=95)
    from weft.core.errors import RecipeError

    with pytest.raises(RecipeError, match="pair_response_tokens = 8 makes synthetic pairs"):
        Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "data": {"pair_response_tokens": 8}})
