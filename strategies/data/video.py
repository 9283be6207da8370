"""Videos for Qwen2-VL-style models: frames decoded with PyAV, sampled to a frame rate, and
cut into the vision tower's temporal patches.

A video is a file (decoded with PyAV, ``av`` on PyPI: FFmpeg's decoders in a wheel, what
transformers' own video utilities use) or a list of frame images. Frames are sampled
uniformly to ``fps`` frames per second, at most ``max_frames``, and the count is made a
multiple of the temporal patch size (2 for Qwen2.5-VL): rounded down, or, for fewer
frames than one patch, padded by repeating the last frame, as transformers' video
processor pads.

Each frame goes through the model's own image processor (the same resize and
normalisation as images, at the size of the first frame), and consecutive frames are
paired into temporal patches here: the image processor fills a patch's temporal slots
with copies of one frame, so slot 0 of each frame's rows, stacked, is the video's patch.
transformers' Qwen2-VL video processor does the same pairing but imports torchvision,
which weft does not depend on.
"""

from __future__ import annotations

import pathlib
from typing import Any

import attrs
import torch
from PIL import Image

from weft.strategies.data.images import load_image, media_path

#: Frame rate and frame limit when neither the sample nor the recipe gives one (Qwen2.5-VL's defaults).
DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 768


@attrs.frozen(kw_only=True)
class VideoLimits:
    """How videos are sampled: ``fps`` frames per second, at most ``max_frames``, in groups
    of ``temporal`` frames (the model's temporal patch). A video part's own ``fps`` and
    ``max_frames`` keys take precedence."""

    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES
    temporal: int = 2

    def for_part(self, part: dict) -> VideoLimits:
        fps, most = part.get("fps", self.fps), part.get("max_frames", self.max_frames)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
            raise ValueError(f"a video's 'fps' must be a positive number, got {fps!r}")
        if isinstance(most, bool) or not isinstance(most, int) or most < self.temporal:
            raise ValueError(f"a video's 'max_frames' must be an integer of at least {self.temporal}, got {most!r}")
        return attrs.evolve(self, fps=float(fps), max_frames=most)


def frame_count(*, available: int, native_fps: float | None, fps: float, max_frames: int, temporal: int) -> int:
    """Frames to keep: ``available`` frames at ``native_fps`` resampled to ``fps``, at most
    ``max_frames``, a multiple of ``temporal`` (at least one temporal patch)."""
    wanted = available if not native_fps else round(available / native_fps * fps)
    wanted = min(wanted, available, max_frames)
    return max(temporal, wanted // temporal * temporal)


def sample_indices(available: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over ``available`` frames; past the end (a video
    shorter than one temporal patch) the last frame repeats."""
    if count <= available:
        return torch.linspace(0, available - 1, count).round().long().tolist()
    return list(range(available)) + [available - 1] * (count - available)


def load_video(source: Any, *, base: pathlib.Path, limits: VideoLimits,
               allow_outside: bool = True) -> tuple[list[Image.Image], float]:
    """(RGB frames, the sampled frames per second) of a video file or a list of frame files.

    A file's own frame rate is read from its stream; a list of frames is taken to be at
    ``fps`` already. A missing, empty or undecodable video, or (``allow_outside`` false) a path
    that leaves ``base``, is a ValueError."""

    fps, max_frames, temporal = limits.fps, limits.max_frames, limits.temporal
    if isinstance(source, list):
        if not source:
            raise ValueError("a video given as frames needs at least one frame path")
        count = frame_count(available=len(source), native_fps=None, fps=fps, max_frames=max_frames,
                            temporal=temporal)
        picked = sample_indices(len(source), count)
        frames = [load_image(source[i], base=base, allow_outside=allow_outside) for i in picked]
        # Frames dropped to max_frames stretch the time each kept frame stands for.
        return frames, fps * min(count, len(source)) / len(source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"a video part needs a file path or a list of frame paths, got {source!r}")
    path = media_path(source, base=base, allow_outside=allow_outside, kind="video")
    if not path.is_file():
        raise ValueError(f"video file {source!r} not found")
    declared, native = _stream_info(path, name=source)
    if declared:
        # The container says how many frames: only the sampled ones become images (an hour
        # at 30 fps is 108,000 frames; at 2 fps 7,200 are kept), and decoding stops after
        # the last. A container that said more frames than it holds is decoded whole below.
        count = frame_count(available=declared, native_fps=native, fps=fps, max_frames=max_frames, temporal=temporal)
        picked = sample_indices(declared, count)
        kept = _decode(path, name=source, wanted=set(picked))
        if all(i in kept for i in picked):
            return [kept[i] for i in picked], native * min(count, declared) / declared if native else fps
    decoded = _decode(path, name=source, wanted=None)
    frames = [decoded[i] for i in range(len(decoded))]
    count = frame_count(available=len(frames), native_fps=native, fps=fps, max_frames=max_frames, temporal=temporal)
    picked = sample_indices(len(frames), count)
    sampled_fps = native * min(count, len(frames)) / len(frames) if native else fps
    return [frames[i] for i in picked], sampled_fps


def _stream_info(path: pathlib.Path, *, name: str) -> tuple[int, float | None]:
    """(frames the first video stream declares, 0 if it does not say; its frame rate or None)."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"video {name!r} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            return int(stream.frames or 0), float(rate) if rate else None
    except av.FFmpegError as error:  # truncated, corrupt or not a video: skipped and counted by the caller
        raise ValueError(f"video {name!r} cannot be decoded: {str(error).replace(str(path), name)}") from None


def _decode(path: pathlib.Path, *, name: str, wanted: set[int] | None) -> dict[int, Image.Image]:
    """Frame index -> RGB image of the first video stream: the ``wanted`` indices (decoding
    stops after the last), or every frame."""
    import av

    frames: dict[int, Image.Image] = {}
    last = max(wanted) if wanted else None
    try:
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if wanted is None or index in wanted:
                    frames[index] = frame.to_image()
                if last is not None and index >= last:
                    break
    except av.FFmpegError as error:  # truncated, corrupt or not a video: skipped and counted by the caller
        raise ValueError(f"video {name!r} cannot be decoded: {str(error).replace(str(path), name)}") from None
    if not frames:
        raise ValueError(f"video {name!r} has no frames")
    return frames


def video_patches(frames: list[Image.Image], *, image_processor: Any,
                  sizing: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos (N, C*T*P*P), video_grid_thw (1, 3)) of one video's frames
    (a multiple of the temporal patch size T), through the model's image processor; frames
    sized by ``sizing`` (strategies.video_size.VideoSizing: the folder's video processor)
    when given, else by the image processor's own bounds."""
    temporal = int(image_processor.temporal_patch_size)
    if len(frames) % temporal:
        raise ValueError(f"{len(frames)} frames is not a multiple of the temporal patch size {temporal}")
    size, bounds = frames[0].size, {}
    if sizing is not None:
        height, width = sizing.frame_size(frames=len(frames), height=size[1], width=size[0])
        size = (width, height)
        # Bounds of exactly this size: the image processor keeps frames that already have it.
        bounds = {"size": {"shortest_edge": width * height, "longest_edge": width * height}}
    frames = [f if f.size == size else f.resize(size, Image.Resampling.BICUBIC) for f in frames]
    processed = image_processor(images=frames, return_tensors="pt", **bounds)
    pixels = processed["pixel_values"].to(torch.float32)  # (F * R, C*T*P*P), each frame copied into T slots
    grid = processed["image_grid_thw"][0].to(torch.long)  # (3,) = (1, h, w), equal for every frame
    rows = int(grid[1] * grid[2])
    patch = int(image_processor.patch_size)
    channels = pixels.shape[1] // (temporal * patch * patch)
    per_frame = pixels.view(len(frames), rows, channels, temporal, patch, patch)[:, :, :, 0]  # (F, R, C, P, P)
    grouped = per_frame.view(len(frames) // temporal, temporal, rows, channels, patch, patch)  # (G, T, R, C, P, P)
    # Rows keep the image processor's order within a frame; groups of T frames go outermost.
    video = grouped.permute(0, 2, 3, 1, 4, 5).reshape(-1, channels * temporal * patch * patch)  # (G*R, C*T*P*P)
    grid_thw = torch.tensor([[len(frames) // temporal, int(grid[1]), int(grid[2])]], dtype=torch.long)  # (1, 3)
    return video, grid_thw


def seconds_per_patch(*, temporal: int, sampled_fps: float) -> float:
    """Qwen2.5-VL's ``second_per_grid_ts``: the seconds one temporal patch spans."""
    return temporal / sampled_fps if sampled_fps > 0 else float(temporal) / DEFAULT_FPS
