"""Video samples: PyAV decoding and frame sampling, temporal patches through the model's
image processor, position ids from transformers' own rope index, mixed batches, subsampling
of over-long videos, and a broken video skipped and counted like a broken image."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from video_files import write_mp4
from weft.strategies.data.conversation import collate, encode_conversation, load_processor, truncate_sample  # noqa: E402
from weft.strategies.data.formats import record_to_messages  # noqa: E402
from weft.strategies.data.video import VideoLimits, frame_count, load_video  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def processor():
    return load_processor("tiny_vl")


@pytest.fixture(scope="module")
def model():
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    recipe = Recipe.from_toml(str(ROOT / "recipes" / "tiny-vl-video.toml"))
    return plugin_manager_from_env().models.for_recipe(recipe).build(recipe, device="cpu", seed=0).eval()


def video_chat(video, *, question="Which way does the bar move?", answer="It moves right.", **keys) -> dict:
    part = {"type": "video", "video": video, **keys}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


def encode(record, processor, base, **kwargs):
    tokenizer, image_processor = processor
    messages = record_to_messages(record, base=base, **kwargs)
    return encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)


@pytest.mark.quick
def test_a_file_is_sampled_to_the_frame_rate_in_whole_temporal_patches(tmp_path):
    write_mp4(tmp_path / "clip.mp4", frames=8, fps=4)  # 2 s
    frames, fps = load_video("clip.mp4", base=tmp_path, limits=VideoLimits(fps=2.0))
    assert len(frames) == 4 and fps == 2.0 and frames[0].size == (56, 56)
    # max_frames takes fewer frames over the same 2 s: each stands for more time.
    frames, fps = load_video("clip.mp4", base=tmp_path, limits=VideoLimits(fps=4.0, max_frames=3))
    assert len(frames) == 2 and fps == 1.0
    assert frame_count(available=1, native_fps=4.0, fps=2.0, max_frames=768, temporal=2) == 2  # one patch at least


@pytest.mark.quick
def test_only_the_sampled_frames_are_decoded_into_images(tmp_path):
    """A file that declares its frame count: only the sampled frames become images, and
    decoding stops after the last one; they equal the same frames of a whole decode."""
    import av

    from weft.strategies.data import video

    write_mp4(tmp_path / "long.mp4", frames=40, fps=8)  # 5 s
    with av.open(str(tmp_path / "long.mp4")) as container:
        assert container.streams.video[0].frames == 40  # the container says: the sampled path is taken
        whole = [f.to_image() for f in container.decode(container.streams.video[0])]
    kept = video._decode(tmp_path / "long.mp4", name="long.mp4", wanted={0, 13, 26})
    assert sorted(kept) == [0, 13, 26]  # no other frame becomes an image
    frames, fps = load_video("long.mp4", base=tmp_path, limits=VideoLimits(fps=2.0))
    picked = video.sample_indices(40, 10)
    assert len(frames) == 10 and fps == 2.0
    assert all(frames[k].tobytes() == whole[i].tobytes() for k, i in enumerate(picked))


@pytest.mark.quick
def test_video_sample_tensors_and_second_per_grid_ts(tmp_path, processor):
    write_mp4(tmp_path / "clip.mp4", frames=8, fps=4)
    sample = encode(video_chat("clip.mp4"), processor, tmp_path)
    assert sample.video_grid_thw.tolist() == [[2, 4, 4]]  # 4 frames in 2 temporal patches of 4x4 patches
    assert sample.pixel_values_videos.shape == (32, 3 * 2 * 14 * 14)
    assert sample.second_per_grid_ts.tolist() == [1.0]  # temporal_patch_size 2 / 2 frames per second
    assert int((sample.mm_token_type_ids == 2).sum()) == 2 * 4 * 4 // 4
    # A part's own fps key wins over the recipe's: 4 fps keeps all 8 frames, half a second per patch.
    fast = encode(video_chat("clip.mp4", fps=4), processor, tmp_path)
    assert fast.video_grid_thw.tolist() == [[4, 4, 4]] and fast.second_per_grid_ts.tolist() == [0.5]


@pytest.mark.quick
def test_temporal_patches_pair_consecutive_frames(tmp_path, processor):
    from PIL import Image

    tokenizer, image_processor = processor
    for i, shade in enumerate((40, 200)):
        Image.new("RGB", (28, 28), (shade, shade, shade)).save(tmp_path / f"f{i}.png")
    sample = encode(video_chat(["f0.png", "f1.png"]), processor, tmp_path)
    frames = [image_processor(images=[Image.open(tmp_path / f"f{i}.png").convert("RGB")], return_tensors="pt")
              ["pixel_values"].view(-1, 3, 2, 14, 14)[:, :, 0] for i in (0, 1)]  # (R, C, P, P) per frame
    expected = torch.stack(frames, dim=2).reshape(-1, 3 * 2 * 14 * 14)  # (R, C*T*P*P): frame 0, frame 1 slots
    torch.testing.assert_close(sample.pixel_values_videos, expected, rtol=0, atol=0)


@pytest.mark.quick
def test_video_position_ids_are_the_models_own_rope_index(tmp_path, processor, model):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from weft.plugins.models.rope_index import document_positions

    write_mp4(tmp_path / "clip.mp4", frames=8, fps=4)
    from PIL import Image

    Image.new("RGB", (56, 28), (200, 30, 30)).save(tmp_path / "red.png")
    record = {"messages": [{"role": "user", "content": "<image>and<video>Which way?"},
                           {"role": "assistant", "content": "Right."}],
              "images": ["red.png"], "videos": ["clip.mp4"]}
    sample = encode(record, processor, tmp_path, videos=VideoLimits(fps=4.0))
    ours = document_positions(model)(sample)  # (3, 1, L)
    assert isinstance(model.model, Qwen2_5_VLModel)
    theirs, _ = Qwen2_5_VLModel.get_rope_index(
        model.model, sample.input_ids[None], mm_token_type_ids=sample.mm_token_type_ids[None],
        image_grid_thw=sample.image_grid_thw, video_grid_thw=sample.video_grid_thw,
        second_per_grid_ts=sample.second_per_grid_ts, attention_mask=torch.ones_like(sample.input_ids)[None])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # Temporal ids step by tokens_per_second x second_per_grid_ts (2 x 0.5) from one patch to the next.
    video = (sample.mm_token_type_ids == 2).nonzero().flatten()
    temporal = ours[0, 0, video].unique().tolist()
    assert len(temporal) == 4 and all(b - a == 1 for a, b in zip(temporal, temporal[1:]))


@pytest.mark.quick
def test_mixed_image_video_text_batch_runs_the_model(tmp_path, processor, model):
    from PIL import Image

    write_mp4(tmp_path / "clip.mp4", frames=6, fps=2)
    Image.new("RGB", (28, 56), (30, 170, 60)).save(tmp_path / "green.png")
    image = {"messages": [{"role": "user", "content": [{"type": "image", "image": "green.png"}, "What?"][:1]},
                          {"role": "assistant", "content": "Green."}]}
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    samples = [encode(r, processor, tmp_path) for r in (video_chat("clip.mp4"), image, text, video_chat("clip.mp4"))]
    batch = collate(samples, pad_id=0)
    assert batch["video_grid_thw"].shape == (2, 3) and batch["second_per_grid_ts"].shape == (2,)
    assert batch["image_grid_thw"].shape == (1, 3)
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    # Each sample alone gives the same per-token losses: the batch's media reach their own rows.
    logits = model(**batch).logits
    for row, sample in enumerate(samples):
        alone = model(**collate([sample], pad_id=0)).logits[0]
        torch.testing.assert_close(logits[row, : sample.num_tokens], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.quick
def test_an_over_long_video_keeps_whole_temporal_patches_and_its_answer(tmp_path, processor):
    write_mp4(tmp_path / "clip.mp4", frames=16, fps=4)
    tokenizer, _ = processor
    sample = encode(video_chat("clip.mp4", fps=4), processor, tmp_path)  # 8 temporal patches of 4 tokens
    assert sample.video_grid_thw.tolist() == [[8, 4, 4]]
    cut = truncate_sample(sample, sample.num_tokens - 10, tokenizer=tokenizer)
    assert cut.video_grid_thw.tolist() == [[4, 4, 4]]  # every 2nd patch: stride 2
    assert cut.second_per_grid_ts.tolist() == [2 * sample.second_per_grid_ts.item()]
    assert cut.num_tokens == sample.num_tokens - 16
    assert torch.equal(cut.labels[-8:], sample.labels[-8:])  # the answer after the video stays
    rows = sample.pixel_values_videos.view(8, 16, -1)
    torch.testing.assert_close(cut.pixel_values_videos, rows[::2].reshape(-1, rows.shape[-1]), rtol=0, atol=0)


def test_a_broken_video_is_skipped_and_counted_like_a_broken_image(weft, tmp_path):
    write_mp4(tmp_path / "clip.mp4", frames=4, fps=2)
    (tmp_path / "broken.mp4").write_bytes((tmp_path / "clip.mp4").read_bytes()[:200])  # truncated
    (tmp_path / "noise.mp4").write_bytes(b"not a video at all" * 10)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    image = {"messages": [{"role": "user", "content": [{"type": "image", "image": "broken.png"}]},
                          {"role": "assistant", "content": "?"}]}
    lines = [video_chat("clip.mp4")] * 6 + [video_chat("broken.mp4"), video_chat("noise.mp4"), image,
                                             video_chat("missing.mp4")]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = weft("run", str(ROOT / "recipes" / "tiny-vl-video.toml"), "--nproc", "1",
                "--set", "data.source='jsonl'", "--set", "data.path='chat.jsonl'", "--set", "data.videos=[]",
                "--set", "train.max_steps=1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_samples"] == 4 and summary["steps"] == 1
    events = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    reasons = {e["where"].rsplit(":", 1)[1]: e["reason"] for e in events if e["event"] == "data.skipped"}
    assert sorted(reasons) == ["10", "7", "8", "9"], reasons
    assert "cannot be decoded" in reasons["7"] and "cannot be decoded" in reasons["8"]
    assert "not found" in reasons["10"]


def test_the_bundled_video_recipe_trains_on_synthetic_videos(weft, tmp_path):
    done = weft("run", "tiny-vl-video", "--set", "train.max_steps=4", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4 and summary["skipped_samples"] == 0
