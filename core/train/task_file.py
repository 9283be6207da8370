"""`weft eval --task FILE.jsonl`'s file: its lines, the answer's normalisation, the interval.

A task line is a conversation in any data format (docs/data.md: images and videos as
training reads them) plus what makes it a question with a right answer:

- ``"choices": [...]`` (two or more distinct strings) and ``"answer"``: the right choice, by
  its text or its index. Each choice is scored by the summed log-likelihood of its tokens as the
  assistant's reply (the lm-evaluation-harness method); the prediction is the best-scoring
  choice, and, length-normalised, the best per UTF-8 byte of the choice (its ``acc_norm``).
- ``"answer": "..."`` alone: the reply is generated greedily and right when it equals the answer
  after :func:`normalize`.

A conversation that ends with an assistant turn has it removed from the prompt: it is the
reference reply, and the answer when the line gives none. So a training file's held-out lines
are a task as they are. ``"id"`` names the line in the results (default ``line-N``); ``"meta"``
(a JSON object: a long-context question's depth and length, say) is copied into its results row,
for `weft report --heatmap` to group by.

For the text-only families, ``"context": "..."`` takes the conversation's place: plain text, no
chat template, as ``data.source = "text"`` trains on it; each choice (or the generated reply) is
its continuation, lm-evaluation-harness's own framing of multiple choice.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import unicodedata
from typing import Any, Iterator

import attrs

from weft.core.errors import WeftError

#: Stripped from both ends of an answer before comparing: "Seven." is "seven".
_EDGE_PUNCTUATION = " \t\n.,;:!?\"'`()[]{}"


@attrs.frozen(kw_only=True)
class TaskItem:
    id: str
    line: int
    record: dict  # the line's conversation keys (its reference reply removed), for formats.record_to_messages
    choices: tuple[str, ...] | None  # None: the reply is generated
    answer: str  # the right choice's text, or the reference answer
    meta: dict | None = None  # the line's "meta", copied into its results row

    @property
    def right(self) -> int | None:
        """The right choice's index (choices only)."""
        return None if self.choices is None else self.choices.index(self.answer)


class TaskLineError(ValueError):
    """A malformed task line: its number and what is wrong."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def read_task(path: pathlib.Path) -> Iterator[TaskItem]:
    """Every line of a task file; a malformed line raises :class:`TaskLineError`."""
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                yield task_item(json.loads(text), line=number)
            except json.JSONDecodeError as error:
                raise TaskLineError(number, f"not JSON ({error.msg})") from None
            except ValueError as error:
                raise TaskLineError(number, str(error)) from None


def task_item(entry: Any, *, line: int) -> TaskItem:
    """One parsed task line; ``ValueError`` saying what is wrong and what is accepted."""
    if not isinstance(entry, dict):
        raise ValueError(f"a task line is a JSON object, got {type(entry).__name__}")
    key = "messages" if "messages" in entry else "conversations" if "conversations" in entry else None
    reference = None
    if key is None and "context" in entry:  # plain text: the choices continue it, no template
        if not isinstance(entry["context"], str) or not entry["context"]:
            raise ValueError(f"'context' must be a non-empty string (the text the choices continue), got "
                             f"{json.dumps(entry['context'])[:80]}")
        turns = None
    elif key is None or not isinstance(entry[key], list) or not entry[key]:
        raise ValueError("no conversation: a task line holds 'messages' (or sharegpt 'conversations') as training "
                         "data does (docs/data.md), or a plain-text 'context', plus 'answer' and optionally "
                         "'choices'")
    else:
        turns = list(entry[key])
        if _role(turns[-1]) == "assistant":
            reference = _text(turns.pop())
        if not turns:
            raise ValueError("the conversation holds only the reference reply: a question must come before it")
    answer, choices = entry.get("answer", reference), entry.get("choices")
    if choices is not None:
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"'choices' must list two or more non-empty strings, got {json.dumps(choices)[:120]}")
        if len(set(choices)) != len(choices):
            raise ValueError("'choices' holds the same text twice: each choice must differ")
        if isinstance(answer, int) and not isinstance(answer, bool):
            if not 0 <= answer < len(choices):
                raise ValueError(f"'answer' {answer} is no index of the {len(choices)} choices (0 to "
                                 f"{len(choices) - 1})")
            answer = choices[answer]
        elif not isinstance(answer, str) or answer not in choices:
            raise ValueError(f"'answer' must be one of the choices (its text or its index), got "
                             f"{json.dumps(answer)[:80]}")
    elif not isinstance(answer, str) or not normalize(answer):
        raise ValueError(f"'answer' must be a non-empty string (with 'choices': the right choice's text or index), "
                         f"got {json.dumps(answer)[:80]}; a line without 'answer' needs the reference reply as "
                         "its last (assistant) turn")
    meta = entry.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"'meta' must be a JSON object (copied into the question's results row), got "
                         f"{json.dumps(meta)[:80]}")
    record = {k: v for k, v in entry.items() if k not in ("answer", "choices", "id", "meta")}
    if turns is not None:
        record[key] = turns
    ident = entry.get("id", f"line-{line}")
    return TaskItem(id=str(ident), line=line, record=record, answer=answer, meta=meta,
                    choices=tuple(choices) if choices is not None else None)


def load_task(path: pathlib.Path) -> list:
    """The task's questions, each malformed line a message naming ``FILE:LINE`` (exit 2)."""
    if not path.is_file():
        raise WeftError(f"no such file: {path}; --task takes a JSONL file of questions (docs/inference.md)",
                        where="--task")
    try:
        items = list(read_task(path))
    except TaskLineError as error:
        raise WeftError(error.reason, where=f"{path}:{error.line}") from None
    except UnicodeDecodeError as error:
        raise WeftError(f"not UTF-8 text ({error.reason})", where=str(path)) from None
    if not items:
        raise WeftError(f"{path} holds no question", where="--task")
    return items


def normalize(text: str) -> str:
    """Exact match's normalisation: Unicode NFKC, case folded, runs of white space as one
    space, punctuation and white space stripped from both ends."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return re.sub(r"\s+", " ", folded).strip(_EDGE_PUNCTUATION)


def wilson(right: int, total: int, *, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of an accuracy of ``right`` out of ``total`` (sound at
    0 and 100%, where the normal approximation collapses to a point)."""
    if total == 0:
        return 0.0, 1.0
    p, n = right / total, total
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At 0 and at every answer right the bound is exactly 0 or 1 (the formula gives it up to rounding).
    return (0.0 if right == 0 else max(0.0, centre - half)), (1.0 if right == total else min(1.0, centre + half))


def _role(turn: Any) -> str | None:
    if not isinstance(turn, dict):
        return None
    return turn.get("role") or {"gpt": "assistant", "assistant": "assistant"}.get(turn.get("from"))


def _text(turn: dict) -> str | None:
    content = turn.get("content", turn.get("value"))
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # transformers' parts: the text parts joined
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return None
