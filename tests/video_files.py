"""Tiny mp4 files for the video tests, written with PyAV."""

from __future__ import annotations

import pathlib

import numpy as np


def write_mp4(path: pathlib.Path, *, frames: int = 8, size: tuple[int, int] = (56, 56), fps: int = 4) -> pathlib.Path:
    """``frames`` frames (W, H = ``size``) of a bright bar moving right on a dark ground, at ``fps``."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for index in range(frames):
            pixels = np.full((size[1], size[0], 3), 30, dtype=np.uint8)  # (H, W, C)
            pixels[:, index * 4 : index * 4 + 10] = 220
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():  # flush the encoder
            out.mux(packet)
    return path
