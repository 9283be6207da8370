"""Video frames sized by the model folder's video_preprocessor_config.json (its pixel bounds and
frame rate), as transformers' Qwen2-VL and Qwen3-VL video processors size them for serving;
without the file, by the image processor's bounds as before. CPU, a few seconds."""

from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from weft.core.recipe import Recipe
from weft.strategies.data.conversation import encode_conversation, load_processor, load_video_sizing, processor_dir
from weft.strategies.data.video_size import VideoSizing

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

QWEN2 = VideoSizing(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, factor=28, temporal=2, whole_video=False)
QWEN3 = VideoSizing(min_pixels=4096, max_pixels=25165824, factor=32, temporal=2, whole_video=True)
SIZES = [(h, w) for h in (20, 56, 100, 333, 720, 1080, 2160) for w in (28, 90, 480, 1280, 3840)]


def test_per_frame_bounds_equal_transformers_qwen2_vl():
    # Qwen2-VL's video processor resizes each frame with the image processor's rule ("Copied from").
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for h, w in SIZES:
        if max(h, w) > 200 * min(h, w):
            continue
        for sizing in (QWEN2, VideoSizing(min_pixels=56 * 56, max_pixels=140 * 140, factor=28, temporal=2,
                                          whole_video=False)):
            want = smart_resize(h, w, factor=sizing.factor, min_pixels=sizing.min_pixels, max_pixels=sizing.max_pixels)
            assert sizing.frame_size(frames=8, height=h, width=w) == want, (h, w)


def test_whole_video_bounds_equal_transformers_qwen3_vl():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    small = VideoSizing(min_pixels=64 * 64 * 4, max_pixels=256 * 256 * 8, factor=32, temporal=2, whole_video=True)
    for frames in (2, 4, 9, 64, 768):
        for h, w in SIZES:
            if max(h, w) > 200 * min(h, w):
                continue
            for sizing in (QWEN3, small):
                want = smart_resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=sizing.min_pixels,
                                    max_pixels=sizing.max_pixels)
                assert sizing.frame_size(frames=frames, height=h, width=w) == want, (frames, h, w)


def _folder(tmp_path, config: dict | None):
    folder = tmp_path / "processor"
    shutil.copytree(processor_dir("tiny_vl"), folder)
    if config is not None:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


VIDEO_CONFIG = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 112 * 112, "longest_edge": 224 * 224}, "fps": 1.0}


def _video_sample(folder):
    tokenizer, image_processor = load_processor(folder)
    frames = [Image.new("RGB", (56, 56), (60 * i, 80, 120)) for i in range(4)]
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0},
                                             {"type": "image", "image": Image.new("RGB", (56, 56), "red")},
                                             {"type": "text", "text": "What moves?"}]},
                {"role": "assistant", "content": "A colour."}]
    return encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor,
                               video_sizing=load_video_sizing(folder))


def test_frames_take_the_video_processors_bounds(tmp_path):
    # 56x56 frames: the image processor keeps them (4x4 patches); the video bounds, at least
    # 112x112 a frame, bring them up to 8x8 patches. The image keeps the image processor's size.
    plain = _video_sample(_folder(tmp_path / "a", None))
    assert plain.video_grid_thw.tolist() == [[2, 4, 4]] and plain.image_grid_thw.tolist() == [[1, 4, 4]]
    sized = _video_sample(_folder(tmp_path / "b", VIDEO_CONFIG))
    assert sized.video_grid_thw.tolist() == [[2, 8, 8]] and sized.image_grid_thw.tolist() == [[1, 4, 4]]
    assert sized.pixel_values_videos.shape == (2 * 8 * 8, 3 * 2 * 14 * 14)
    assert int((sized.input_ids == 319).sum()) == 2 * 8 * 8 // 4


def test_the_folders_frame_rate_unless_the_recipe_sets_one(tmp_path):
    from weft.plugins.batching.samples import video_limits

    folder = str(_folder(tmp_path, VIDEO_CONFIG))
    unset = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}})
    assert unset.data.video_fps is None
    assert video_limits(unset, folder).fps == 1.0  # the folder's
    assert video_limits(unset, "tiny_vl").fps == 2.0  # no video config: Qwen2.5-VL's default
    assert video_limits(Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "data": {"video_fps": 4}}),
                        folder).fps == 4.0


def test_a_broken_video_config_is_a_reason(tmp_path):
    folder = _folder(tmp_path, {"size": {"shortest_edge": "many"}})
    with pytest.raises(ValueError, match="video_preprocessor_config.json: cannot read its pixel bounds"):
        load_video_sizing(folder)


def test_jsonl_samples_are_sized_by_the_folder_too(tmp_path):
    from weft.strategies.data.datasets import jsonl_samples

    folder = _folder(tmp_path, VIDEO_CONFIG)
    for i in range(4):
        Image.new("RGB", (56, 56), (60 * i, 80, 120)).save(tmp_path / f"f{i}.png")
    record = {"messages": [{"role": "user", "content": [{"type": "video", "video": [f"f{i}.png" for i in range(4)]},
                                                        {"type": "text", "text": "What moves?"}]},
                           {"role": "assistant", "content": "A colour."}]}
    (tmp_path / "clips.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    sample = next(jsonl_samples(tmp_path / "clips.jsonl", processor=str(folder)))
    assert sample.video_grid_thw.tolist() == [[2, 8, 8]]
