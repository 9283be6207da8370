"""Dataset records -> chat messages: transformers' chat format and the sharegpt-style variant.

- chat (transformers / Qwen2.5-VL): ``{"messages": [{"role": ..., "content": [{"type": "text", "text": ...},
  {"type": "image", "image": "rel/path.png"}]}]}``; string contents are plain text.
- sharegpt-style (LLaMA-Factory, ms-swift): ``{"messages": [{"role": "user", "content": "<image>What is it?"}, ...],
  "images": ["rel/path.png"]}``: each ``<image>`` placeholder takes the next image of the list, in order.
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}`` is read too.
- LLaVA (its instruction data, ``llava_v1_5_mix665k.json`` and those built like it): sharegpt-style
  ``conversations`` with a singular ``"image"`` (or ``"video"``) key, a path or a list of paths,
  the same as ``"images"`` (``"videos"``); a record with both spellings is an error.
- Alpaca (``{"instruction", "input", "output"}``, optional ``system`` and ``history``): the
  instruction and its input as the user turn, the output as the reply; ``images`` / ``image``
  with ``<image>`` placeholders as in the sharegpt style.
- An ``<image>`` or ``<video>`` placeholder in a record with no file for it, or a file with no
  placeholder, is an error: never left in the prompt as literal text.
- videos mirror images: a ``{"type": "video", "video": "clip.mp4"}`` part (or a list of frame
  files, ``"video": ["f0.png", "f1.png"]``; optional ``fps`` and ``max_frames`` keys), or
  ``<video>`` placeholders taking the paths of a ``"videos"`` list (strategies/data/video.py).

Image paths are relative to the dataset file; with ``allow_outside`` false (``data.allow_outside``)
a path that leaves its folder is refused (strategies/data/images.py, ``media_path``). Every problem
raises ``ValueError`` or ``OSError`` with a reason; the caller skips and counts the sample.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import attrs

from weft.strategies.data.images import load_image
from weft.strategies.data.video import VideoLimits, load_video

ROLES = ("system", "user", "assistant")
PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@attrs.frozen(kw_only=True)
class _Media:
    """How a record's files are read: relative to ``base``, images of at most ``skip_pixels``,
    videos sampled by ``videos``, kept inside ``base`` unless ``allow_outside``."""

    base: pathlib.Path
    skip_pixels: int = 0
    videos: VideoLimits = VideoLimits()
    allow_outside: bool = True

    def image(self, source: Any) -> dict:
        return {"type": "image", "image": load_image(source, base=self.base, skip_pixels=self.skip_pixels,
                                                     allow_outside=self.allow_outside)}

    def video(self, source: Any, *, limits: VideoLimits) -> dict:
        frames, fps = load_video(source, base=self.base, limits=limits, allow_outside=self.allow_outside)
        return {"type": "video", "video": frames, "fps": fps}


def record_to_messages(record: Any, *, base: pathlib.Path, skip_pixels: int = 0,
                       videos: VideoLimits = VideoLimits(), allow_outside: bool = True) -> list[dict]:
    """A JSONL record as chat messages with their images opened (each at most ``skip_pixels``
    pixels when > 0; always within PIL's limit) and their videos decoded and sampled
    (``videos``); with ``allow_outside`` false, only files inside ``base``. A bad record, image
    or video is a ValueError."""
    media = _Media(base=base, skip_pixels=skip_pixels, videos=videos, allow_outside=allow_outside)
    if not isinstance(record, dict):
        raise ValueError(f"a line must hold a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "conversations" in record:
        messages = [
            {"role": _SHAREGPT_ROLES.get(turn.get("from"), turn.get("from")), "content": turn.get("value")}
            for turn in _turns(record["conversations"])
        ]
    elif "instruction" in record and "output" in record:
        messages = alpaca_messages(record)
    else:
        raise ValueError("no 'messages' (or sharegpt 'conversations', or Alpaca 'instruction' and 'output') key")
    messages = _turns(messages)
    images, clips = media_lists(record)
    if images is not None or clips is not None or _has_placeholder(messages):
        # A placeholder with no list is checked here too: 2 <image> placeholders but 0 images.
        return _sharegpt(messages, images or [], clips or [], media=media)
    return [_chat_message(m, media=media) for m in messages]


def alpaca_messages(record: dict) -> list[dict]:
    """Alpaca's ``instruction`` (+ ``input``, after a blank line, when not empty) as the user
    turn and ``output`` as the reply; an optional ``system`` string and ``history`` of
    [instruction, output] pairs before it (LLaMA-Factory's Alpaca columns)."""
    fields = {key: record.get(key) for key in ("instruction", "input", "output", "system")}
    for key, value in fields.items():
        if value is not None and not isinstance(value, str):
            raise ValueError(f"Alpaca '{key}' must be a string, got {type(value).__name__}")
    messages = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair) for pair in history):
        raise ValueError("Alpaca 'history' must be a list of [instruction, output] string pairs")
    for asked, answered in history:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    prompt = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
    return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]


def media_lists(record: dict) -> tuple[Any, Any]:
    """(images, videos) of a record as lists of paths, or None where it names none: the
    ``images`` / ``videos`` keys, or LLaVA's singular ``image`` / ``video`` (a path or a list)."""
    out = []
    for plural, singular in (("images", "image"), ("videos", "video")):
        if plural in record and singular in record:
            raise ValueError(f"both {plural!r} and {singular!r} keys: give the record's files once")
        value = record.get(plural, record.get(singular))
        out.append([value] if singular in record and isinstance(value, str) else value)
    return out[0], out[1]


def _has_placeholder(messages: list) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), str)
               and (PLACEHOLDER in m["content"] or VIDEO_PLACEHOLDER in m["content"]) for m in messages)


def _turns(value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError("empty conversation: 'messages' must be a non-empty list")
    return value


def _role(message: Any) -> str:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else message
        raise ValueError(f"unknown role {role!r}; accepted: {', '.join(ROLES)}")
    return message["role"]


def _chat_message(message: Any, *, media: _Media) -> dict:
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
            parts.append(media.image(part.get("image", part.get("path"))))
        elif kind == "video":
            parts.append(media.video(part.get("video", part.get("path")), limits=media.videos.for_part(part)))
        else:
            raise ValueError(f"unsupported content part {kind!r} (text, image and video are supported)")
    return {"role": role, "content": parts}


def _sharegpt(messages: list, images: Any, clips: Any, *, media: _Media) -> list[dict]:
    for key, value, placeholder in (("images", images, PLACEHOLDER), ("videos", clips, VIDEO_PLACEHOLDER)):
        if not isinstance(value, list):
            raise ValueError(f"'{key}' must be a list of paths")
        count = sum(str(m.get("content", "")).count(placeholder) for m in messages if isinstance(m, dict))
        if count != len(value):
            raise ValueError(f"{count} {placeholder} placeholders but {len(value)} {key}")
    queue, clip_queue = iter(images), iter(clips)
    out = []
    for message in messages:
        role = _role(message)
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError("sharegpt-style messages hold string contents with <image> / <video> placeholders")
        parts: list[dict] = []
        for piece in re.split(f"({re.escape(PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", content):
            if piece == PLACEHOLDER:
                parts.append(media.image(next(queue)))
            elif piece == VIDEO_PLACEHOLDER:
                parts.append(media.video(next(clip_queue), limits=media.videos))
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": role, "content": parts})
    return out
