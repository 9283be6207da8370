"""An image file as a sample's part: its path kept inside the data folder when the recipe says so,
its format one a dataset can mean, checked from its header before it is decoded.

Its own file because both conversation records (strategies/data/formats.py) and videos
given as lists of frames (strategies/data/video.py) read images, and each of those imports the
other's neighbour otherwise: one place, no import cycle.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from PIL import Image

#: The image formats a dataset can mean, by Pillow's names. Any other file (an EPS named .png,
#: whose Pillow plugin runs Ghostscript; the rarely used decoders of some forty other formats)
#: is a bad sample, and Pillow is never asked to open it as that format.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_ALLOWED_NAMES = "PNG, JPEG, WebP, GIF, BMP or TIFF"


def media_path(source: str, *, base: pathlib.Path, allow_outside: bool = True, kind: str = "image") -> pathlib.Path:
    """The file a record's ``source`` path names, relative to ``base`` (the data file's folder).

    With ``allow_outside`` false, a path that leaves ``base`` — absolute, through ``..``, or
    through a symlink whose target is outside — is a ValueError. The path's text is checked
    first, touching no file; then its symlinks are resolved, and the file is read by its
    resolved path. The reason is the same whether or not the target exists, and names only the
    record's own path (never a symlink's target)."""
    path = base / source
    if allow_outside:
        return path
    leaves = ValueError(f"{kind} {source!r}: the path leaves the data folder (data.allow_outside = false)")
    folder = os.path.abspath(base)
    if not _inside(os.path.normpath(os.path.join(folder, source)), folder):  # absolute, or '..' past the folder
        raise leaves
    real_folder = os.path.realpath(folder)
    resolved = os.path.realpath(os.path.join(folder, source))  # symlinks, then '..', as the kernel reads them
    if not _inside(resolved, real_folder):
        raise leaves
    return pathlib.Path(resolved)


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def load_image(source: Any, *, base: pathlib.Path, skip_pixels: int = 0, allow_outside: bool = True) -> Image.Image:
    """The decoded image a record names; a ValueError naming the record's path and the reason
    when it cannot be a sample's image (the caller skips and counts the sample)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"an image part needs a file path, got {source!r}")
    path = media_path(source, base=base, allow_outside=allow_outside)
    if not path.is_file():
        raise ValueError(f"image file {source!r} not found")
    try:
        opened = Image.open(path, formats=ALLOWED_FORMATS)  # reads the header only
    except Image.DecompressionBombError as error:  # over twice PIL's pixel limit: never decoded
        raise ValueError(f"image {source!r}: {error}") from None
    except Image.UnidentifiedImageError:
        claimed = _claimed_by(path)
        raise ValueError(f"image {source!r}: a damaged {claimed} file" if claimed else
                         f"image {source!r}: not an allowed image format ({_ALLOWED_NAMES})") from None
    except Exception as error:  # a plugin's own error on a damaged header
        raise ValueError(f"image {source!r} cannot be read: {_said(error, path, source)}") from None
    with opened as image:
        width, height = image.size
        if skip_pixels and width * height > skip_pixels:  # from the header: never decoded
            raise ValueError(f"image {source!r} is {width}x{height} = {width * height:,} pixels, over "
                             f"data.skip_pixels = {skip_pixels:,}")
        if width * height > (Image.MAX_IMAGE_PIXELS or float("inf")):
            # Checked before decoding: one such image must not take the host's memory.
            raise ValueError(f"image {source!r} is {width}x{height} = {width * height:,} pixels, over the "
                             f"{Image.MAX_IMAGE_PIXELS:,}-pixel limit (PIL's Image.MAX_IMAGE_PIXELS)")
        try:
            image.load()  # decode now: a truncated or corrupt file fails here, not mid-step
        except Exception as error:  # Pillow's are many: OSError, SyntaxError ("broken PNG file"), EOFError...
            raise ValueError(f"image {source!r} cannot be decoded: {_said(error, path, source)}") from None
        if min(image.size) < 1:
            raise ValueError(f"image {source!r} has no pixels")
        return image.copy()


def open_allowed(source: Any) -> Image.Image:
    """``Image.open`` limited to the allowed formats, for images given outside a data file
    (`weft generate --image`, bytes); an OSError (UnidentifiedImageError) for any other."""
    return Image.open(source, formats=ALLOWED_FORMATS)


def _claimed_by(path: pathlib.Path) -> str | None:
    """The allowed format whose signature the file's first bytes carry (a damaged file of that
    format), or None (a file of another format, or no image at all); only the formats' own
    signature checks run, no decoder."""
    Image.init()
    with path.open("rb") as handle:
        prefix = handle.read(16)
    for name in ALLOWED_FORMATS:
        accept = Image.OPEN[name][1]
        claimed = accept(prefix) if accept is not None else False
        if claimed and not isinstance(claimed, str):  # a str is Pillow's warning, not a match
            return name
    return None


def _said(error: Exception, path: pathlib.Path, source: str) -> str:
    """An error's type and message, the file named as the record names it (never the path it
    resolved to)."""
    return f"{type(error).__name__}: {error}".replace(str(path), source)
