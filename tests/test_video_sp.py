"""Sequence parallelism with video samples: `weft check` on 4 gloo ranks is exact (float32)
for ulysses 2 x ring 2, for dp 2 x ring 2 (rounds whose ranks call the vision tower a
different number of times), and with the vision tower frozen by rule."""

from __future__ import annotations

import json
import pathlib

import pytest

from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny-vl-video.toml")
FROZEN = ('\n[[rules]]\nname = "vision tower frozen"\nwhen = { path = "*.visual.blocks.*" }\n'
          'shard = { strategy = "fsdp2", trainable = false }\n')


def check(*sets: str, recipe: str = RECIPE, cwd: pathlib.Path) -> dict:
    args = [a for s in sets for a in ("--set", s)]
    done = run_weft("check", recipe, "--world-size", "4", *args, "--json", cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
    return result


def test_check_is_exact_with_videos_under_ulysses2_x_ring2(tmp_path):
    result = check("parallel.ring=2", "parallel.ulysses=2", cwd=tmp_path)
    assert result["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "ring": 2, "ulysses": 2}


def test_check_is_exact_with_videos_under_dp2_x_ring2(tmp_path):
    # Small micro-batches: some rounds put a video-only sample beside an image-only one, so a
    # rank runs a blank tower call for the modality it lacks.
    result = check("parallel.ring=2", "parallel.dp_shard=2", "train.micro_batch_tokens=128", cwd=tmp_path)
    assert result["mesh"]["dp_shard"] == 2 and result["mesh"]["ring"] == 2


def test_check_is_exact_with_videos_and_the_vision_tower_frozen(tmp_path):
    (tmp_path / "frozen.toml").write_text(pathlib.Path(RECIPE).read_text() + FROZEN)
    result = check("parallel.ring=2", "parallel.dp_shard=2", recipe="frozen.toml", cwd=tmp_path)
    assert result["frozen_units"] == ["model.visual.blocks.0", "model.visual.blocks.1"]
    assert result["grad_params"]["plan"] == result["grad_params"]["reference"]


def test_check_is_exact_on_long_synthetic_samples_with_a_video(tmp_path):
    """The long synthetic source (data.tokens, what the GPU benchmarks use) with an image and
    a 48-patch video per sample, under Ulysses 2: the video is over tiny-vl-sp's rule
    (vision_ulysses, min_patches = 24), so both SP ranks share its tower call instead of
    one rank encoding it whole."""
    sets = ["parallel.ring=1", "parallel.ulysses=2", "data.tokens=512", "data.images=[[56, 56]]",
            "data.videos=[[4, 56, 84]]"]
    done = run_weft("check", "tiny-vl-sp", "--world-size", "2", *[a for s in sets for a in ("--set", s)], "--json",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result


@pytest.mark.quick
def test_a_rank_without_videos_calls_the_tower_as_often_as_one_with():
    """The data-parallel keep-alive's marks: one blank tower call for each modality that some
    rank of the round encodes and this one does not (Qwen2.5-VL calls the tower once for the
    images and once for the videos)."""
    import torch

    from weft.core.models import VISION_FLAG
    from weft.core.train.step import _keep_alive

    images_only, both = {"pixel_values": torch.zeros(4, 8)}, {"pixel_values": 0, "pixel_values_videos": 0}
    assert _keep_alive(images_only, [2.0, 1.0])[VISION_FLAG].numel() == 1  # another rank has videos
    assert VISION_FLAG not in _keep_alive(images_only, [2.0, 0.0])  # nobody has videos
    assert _keep_alive({}, [1.0, 1.0])[VISION_FLAG].numel() == 2  # a text-only rank: both calls blank
    assert VISION_FLAG not in _keep_alive(both, [2.0, 2.0])
