"""Dataset records -> chat messages: transformers' chat format and the sharegpt-style variant.

- chat (transformers / Qwen2.5-VL): ``{"messages": [{"role": ..., "content": [{"type": "text", "text": ...},
  {"type": "image", "image": "rel/path.png"}]}]}``; string contents are plain text.
- sharegpt-style (LLaMA-Factory, ms-swift): ``{"messages": [{"role": "user", "content": "<image>What is it?"}, ...],
  "images": ["rel/path.png"]}``: each ``<image>`` placeholder takes the next image of the list, in order.
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}`` is read too.

Image paths are relative to the dataset file. Every problem raises ``ValueError`` or
``OSError`` with a reason; the caller skips and counts the sample.
"""

from __future__ import annotations

import pathlib
from typing import Any

from PIL import Image

ROLES = ("system", "user", "assistant")
PLACEHOLDER = "<image>"
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def record_to_messages(record: Any, *, base: pathlib.Path, max_pixels: int = 0) -> list[dict]:
    """A JSONL record as chat messages with their images opened (each at most ``max_pixels``
    pixels when > 0; always within PIL's limit). A bad record or image is a ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"a line must hold a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "conversations" in record:
        messages = [
            {"role": _SHAREGPT_ROLES.get(turn.get("from"), turn.get("from")), "content": turn.get("value")}
            for turn in _turns(record["conversations"])
        ]
    else:
        raise ValueError("no 'messages' (or sharegpt 'conversations') key")
    messages = _turns(messages)
    images = record.get("images")
    if images is not None:
        return _sharegpt(messages, images, base=base, max_pixels=max_pixels)
    return [_chat_message(m, base=base, max_pixels=max_pixels) for m in messages]


def _turns(value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError("empty conversation: 'messages' must be a non-empty list")
    return value


def _role(message: Any) -> str:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else message
        raise ValueError(f"unknown role {role!r}; accepted: {', '.join(ROLES)}")
    return message["role"]


def _chat_message(message: Any, *, base: pathlib.Path, max_pixels: int = 0) -> dict:
    role = _role(message)
    content = message.get("content")
    if isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": content}]}
    if not isinstance(content, list):
        raise ValueError(f"'content' must be a string or a list of parts, got {type(content).__name__}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image":
            image = load_image(part.get("image", part.get("path")), base=base, max_pixels=max_pixels)
            parts.append({"type": "image", "image": image})
        else:
            raise ValueError(f"unsupported content part {kind!r} (text and image are supported)")
    return {"role": role, "content": parts}


def _sharegpt(messages: list, images: Any, *, base: pathlib.Path, max_pixels: int = 0) -> list[dict]:
    if not isinstance(images, list):
        raise ValueError("'images' must be a list of paths")
    placeholders = sum(str(m.get("content", "")).count(PLACEHOLDER) for m in messages if isinstance(m, dict))
    if placeholders != len(images):
        raise ValueError(f"{placeholders} {PLACEHOLDER} placeholders but {len(images)} images")
    queue = iter(images)
    out = []
    for message in messages:
        role = _role(message)
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError("sharegpt-style messages hold string contents with <image> placeholders")
        pieces = content.split(PLACEHOLDER)
        parts: list[dict] = []
        for i, piece in enumerate(pieces):
            if piece:
                parts.append({"type": "text", "text": piece})
            if i < len(pieces) - 1:
                parts.append({"type": "image", "image": load_image(next(queue), base=base, max_pixels=max_pixels)})
        out.append({"role": role, "content": parts})
    return out


def load_image(source: Any, *, base: pathlib.Path, max_pixels: int = 0) -> Image.Image:
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
        if max_pixels and width * height > max_pixels:  # from the header: never decoded
            raise ValueError(f"image {source!r} is {width}x{height} = {width * height:,} pixels, over "
                             f"data.max_pixels = {max_pixels:,}")
        if width * height > (Image.MAX_IMAGE_PIXELS or float("inf")):
            # Checked before decoding: one such image must not take the host's memory.
            raise ValueError(f"image {source!r} is {width}x{height} = {width * height:,} pixels, over the "
                             f"{Image.MAX_IMAGE_PIXELS:,}-pixel limit (PIL's Image.MAX_IMAGE_PIXELS)")
        image.load()  # decode now: a truncated or corrupt file fails here, not mid-step
        if min(image.size) < 1:
            raise ValueError(f"image {source!r} has no pixels")
        return image.copy()
