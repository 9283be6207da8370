"""An image file as a sample's part: checked from its header before it is decoded.

Its own file because both conversation records (strategies/data/formats.py) and videos
given as lists of frames (strategies/data/video.py) read images, and each of those imports the
other's neighbour otherwise: one place, no import cycle.
"""

from __future__ import annotations

import pathlib
from typing import Any

from PIL import Image


def load_image(source: Any, *, base: pathlib.Path, skip_pixels: int = 0) -> Image.Image:
    if not isinstance(source, str) or not source:
        raise ValueError(f"an image part needs a file path, got {source!r}")
    path = base / source
    if not path.is_file():
        raise ValueError(f"image file {source!r} not found")
    try:
        opened = Image.open(path)  # reads the header only
    except Image.DecompressionBombError as error:  # over twice PIL's pixel limit: never decoded
        raise ValueError(f"image {source!r}: {error}") from None
    with opened as image:
        width, height = image.size
        if skip_pixels and width * height > skip_pixels:  # from the header: never decoded
            raise ValueError(f"image {source!r} is {width}x{height} = {width * height:,} pixels, over "
                             f"data.skip_pixels = {skip_pixels:,}")
        if width * height > (Image.MAX_IMAGE_PIXELS or float("inf")):
            # Checked before decoding: one such image must not take the host's memory.
            raise ValueError(f"image {source!r} is {width}x{height} = {width * height:,} pixels, over the "
                             f"{Image.MAX_IMAGE_PIXELS:,}-pixel limit (PIL's Image.MAX_IMAGE_PIXELS)")
        image.load()  # decode now: a truncated or corrupt file fails here, not mid-step
        if min(image.size) < 1:
            raise ValueError(f"image {source!r} has no pixels")
        return image.copy()
