"""Turn the recipe's data section into encoded samples; bad samples are skipped and counted."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Iterator

from PIL import Image

from weft.strategies.conversation import Sample, encode_conversation


class BadSample(Exception):
    """A sample that cannot be used; carries where it came from."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def synthetic_samples(*, seed: int, num_samples: int, min_side: int, max_side: int, tokenizer: Any, image_processor: Any) -> Iterator[Sample | BadSample]:
    from weft.strategies.synthetic_vl import synthetic_conversations

    for conversation in synthetic_conversations(seed=seed, num_samples=num_samples, min_side=min_side, max_side=max_side):
        yield encode_conversation(conversation.messages, tokenizer=tokenizer, image_processor=image_processor)


def jsonl_samples(path: pathlib.Path, *, tokenizer: Any, image_processor: Any) -> Iterator[Sample | BadSample]:
    """Chat-format JSONL: one ``{"messages": [...]}`` per line; image parts name files relative to the JSONL."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                messages = _load_images(record["messages"], base=path.parent)
                yield encode_conversation(messages, tokenizer=tokenizer, image_processor=image_processor)
            except (ValueError, KeyError, TypeError, OSError) as error:
                yield BadSample(where, f"{type(error).__name__}: {error}")


def _load_images(messages: Any, *, base: pathlib.Path) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part.get("type") == "image" and isinstance(part.get("image"), str):
                with Image.open(base / part["image"]) as image:
                    image.load()
                    part = {"type": "image", "image": image.copy()}
            parts.append(part)
        out.append({"role": message["role"], "content": parts})
    return out


def collect(samples: Iterator[Sample | BadSample], *, on_bad: Callable[[BadSample], None]) -> list[Sample]:
    kept = []
    for sample in samples:
        if isinstance(sample, BadSample):
            on_bad(sample)
        else:
            kept.append(sample)
    return kept
