"""How large a video's frames are, as the model folder's video processor makes them for serving.

A Hugging Face folder may carry ``video_preprocessor_config.json``: the pixel bounds (``size``:
``shortest_edge``/``longest_edge``, or the older ``min_pixels``/``max_pixels``) and frame rate
(``fps``) its video processor uses, which differ from the image processor's (Qwen2-VL's video
bounds are 128 to 768 merged patches a frame; Qwen3-VL's bound a whole video's
frames x height x width). transformers' video processor imports torchvision, which weft does
not depend on, so the sizing rule is applied here and the frames, resized to that size, go
through the image processor (strategies/data/video.py) as before. Without the file, frames are
sized by the image processor's own bounds, as images are.
"""

from __future__ import annotations

import json
import math
import pathlib

import attrs

CONFIG_FILE = "video_preprocessor_config.json"
# Processors whose bounds hold for frames x height x width, not for each frame.
_WHOLE_VIDEO_TYPES = ("Qwen3VLVideoProcessor",)


@attrs.frozen(kw_only=True)
class VideoSizing:
    min_pixels: int
    max_pixels: int
    factor: int  # patch_size * merge_size: both sides a multiple of it
    temporal: int  # temporal_patch_size
    whole_video: bool  # bounds on frames x height x width (Qwen3-VL) rather than per frame (Qwen2-VL)
    fps: float | None = None  # the processor's sampling rate, if it names one

    @classmethod
    def from_folder(cls, folder: pathlib.Path) -> VideoSizing | None:
        """The folder's video sizing, or None without a video_preprocessor_config.json."""
        path = folder / CONFIG_FILE
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
            size = config.get("size") or {}
            low = size.get("shortest_edge", config.get("min_pixels"))
            high = size.get("longest_edge", config.get("max_pixels"))
            sizing = cls(min_pixels=int(low), max_pixels=int(high),
                         factor=int(config.get("patch_size", 14)) * int(config.get("merge_size", 2)),
                         temporal=int(config.get("temporal_patch_size", 2)),
                         whole_video=config.get("video_processor_type") in _WHOLE_VIDEO_TYPES,
                         fps=float(config["fps"]) if config.get("fps") else None)
        except (ValueError, TypeError, AttributeError) as error:
            raise ValueError(f"{path}: cannot read its pixel bounds ({type(error).__name__}: {error})") from error
        if not 0 < sizing.min_pixels <= sizing.max_pixels:
            raise ValueError(f"{path}: pixel bounds {sizing.min_pixels}..{sizing.max_pixels} are not a range")
        return sizing

    def frame_size(self, *, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a ``frames``-frame video of ``height`` x ``width`` is
        resized to: each side rounded to a multiple of ``factor``, then scaled, keeping the
        aspect ratio, into the pixel bounds (of one frame, or of all frames for ``whole_video``)."""
        factor = self.factor
        if max(height, width) > 200 * min(height, width):
            raise ValueError(f"a video of {width}x{height}: the aspect ratio is over 200")
        count = 1
        if self.whole_video:
            count = frames
            if min(height, width) < factor:  # the shorter side is brought up to one factor first
                scale = max(factor / height, factor / width)
                height, width = int(height * scale), int(width * scale)
        rounded = max(self.temporal, round(frames / self.temporal) * self.temporal) if self.whole_video else 1
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if rounded * h * w > self.max_pixels:
            shrink = math.sqrt(count * height * width / self.max_pixels)
            h = max(factor, math.floor(height / shrink / factor) * factor)
            w = max(factor, math.floor(width / shrink / factor) * factor)
        elif rounded * h * w < self.min_pixels:
            grow = math.sqrt(self.min_pixels / (count * height * width))
            h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
        return h, w
