"""A task's question (`weft eval --task`, core/train/task_file.py) as the model sees it: the
conversation rendered as training renders one, with the template's generation prompt; each
choice as the assistant's reply to it, labelled on the choice's own tokens alone (not the
header before it, not the closing ``<|im_end|>``), so that a sample's summed label
log-likelihood is the choice's. A plain-text question (a ``context``, for text-only models) is
its tokens as ``data.source = "text"`` reads text, each choice its continuation."""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Sequence

import attrs
import torch

from weft.strategies.data.conversation import IGNORE_INDEX, Sample, encode_conversation, encode_prompt
from weft.strategies.data.formats import record_to_messages


def question(record: dict, *, base: pathlib.Path, tokenizer: Any, image_processor: Any, system: str | None = None,
             **read: Any) -> tuple[list[dict], Sample]:
    """(the question's messages, its prompt: the conversation and the generation prompt, no labels).
    ``read``: ``record_to_messages``' limits (skip_pixels, videos, allow_outside)."""
    messages = record_to_messages(record, base=base, **read)
    return messages, encode_prompt(messages, tokenizer=tokenizer, image_processor=image_processor, system=system)


def choice_samples(choices: Sequence[str], messages: list[dict], prompt: Sample, *, tokenizer: Any,
                   image_processor: Any, system: str | None = None, reply_end: bool = False) -> list[Sample]:
    """One sample per choice: the question, then the choice as the reply, labels on the choice's
    tokens only (``reply_end``: and the token that closes the reply, for a teacher-forced greedy
    reply that must stop there). ValueError when the template renders the question differently
    once a reply follows (its prompt is then no prefix of the scored sequence)."""
    found = []
    prefix = prompt.num_tokens
    for choice in choices:
        full = encode_conversation([*messages, {"role": "assistant", "content": choice}], tokenizer=tokenizer,
                                   image_processor=image_processor, system=system)
        if full.num_tokens <= prefix or not torch.equal(full.input_ids[:prefix], prompt.input_ids):
            raise ValueError(f"the chat template renders the question differently once the reply {choice!r} follows, "
                             "so the choice's tokens cannot be told apart")
        labels = full.labels.clone()
        labels[:prefix] = IGNORE_INDEX  # earlier replies (a few-shot prompt) are context, not the choice
        scored = (labels != IGNORE_INDEX).nonzero().flatten()
        if scored.numel() < 2:
            raise ValueError(f"the choice {choice!r} gives no token of its own before the end of the turn")
        if not reply_end:
            labels[scored[-1]] = IGNORE_INDEX  # the closing token: "c, then stop" would favour short choices
        found.append(attrs.evolve(full, labels=labels))
    return found


def text_question(context: str, *, encode: Callable[[str], list[int]]) -> Sample:
    """A plain-text question: the context's tokens, no template, no labels."""
    ids = torch.tensor(encode(context), dtype=torch.long)  # (S,)
    if ids.numel() == 0:
        raise ValueError("the context gives no token")
    return Sample(input_ids=ids, labels=torch.full_like(ids, IGNORE_INDEX))


def continuation_samples(choices: Sequence[str], prompt: Sample, *, encode: Callable[[str], list[int]]) -> list[Sample]:
    """One sample per choice: the context's tokens, then the choice's own, labelled on the
    choice's alone. Each is encoded by itself (lm-evaluation-harness encodes the continuation
    apart too), so a choice's tokens are the same whatever context it follows."""
    found = []
    for choice in choices:
        ids = torch.tensor(encode(choice), dtype=torch.long)  # (C,)
        if ids.numel() == 0:
            raise ValueError(f"the choice {choice!r} gives no token")
        found.append(Sample(input_ids=torch.cat([prompt.input_ids, ids]),
                            labels=torch.cat([torch.full_like(prompt.input_ids, IGNORE_INDEX), ids])))
    return found
