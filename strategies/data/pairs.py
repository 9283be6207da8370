"""Preference pairs: a prompt with a chosen and a rejected response, as one sample of two
conversations, and the micro-batch a preference objective reads.

A record is a pair when it has ``chosen`` and ``rejected``, in the field names of TRL and
LLaMA-Factory:

- TRL, standard: ``{"prompt": "...", "chosen": "...", "rejected": "..."}`` (strings);
- TRL, conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` lists of
  assistant messages; or no ``prompt`` and ``chosen`` / ``rejected`` whole conversations that
  share their first turns (TRL's implicit prompt: the turns before the last);
- LLaMA-Factory: sharegpt ``conversations`` (the prompt's turns) with ``chosen`` / ``rejected``
  one ``{"from": "gpt", "value": ...}`` turn each; Alpaca ``instruction`` (+ ``input``) with
  ``chosen`` / ``rejected`` strings.

Images and videos (``images``, ``videos``, as docs/data.md) belong to the prompt, so both
conversations hold them. TRL's precomputed reference columns ``ref_chosen_logps`` and
``ref_rejected_logps`` (the reference model's summed log-probabilities of each response) ride
along. The two conversations are encoded apart and joined into one :class:`Sample`
(``pair_split``: the chosen one's tokens), so a pair is batched, counted and stored as one
sample and never split across micro-batches; :func:`collate_pairs` makes each pair two
documents (packed) or two rows, in the order chosen, rejected.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from weft.strategies.data.conversation import Sample

REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
_PAIR_KEYS = ("prompt", "chosen", "rejected", *REFERENCE_KEYS)


def is_pair(record: Any) -> bool:
    return isinstance(record, dict) and "chosen" in record and "rejected" in record


def pair_records(record: dict) -> tuple[dict, dict, tuple[float, float] | None]:
    """(the chosen conversation's record, the rejected one's, the reference log-probabilities or
    None), each record in a format ``formats.record_to_messages`` reads. ValueError when the
    fields do not make a pair."""
    rest = {k: v for k, v in record.items() if k not in _PAIR_KEYS}
    chosen, rejected = record["chosen"], record["rejected"]
    if "conversations" in record:  # LLaMA-Factory sharegpt: one reply turn each
        turns = [_one_turn(chosen, "chosen"), _one_turn(rejected, "rejected")]
        made = [dict(rest, conversations=[*record["conversations"], turn]) for turn in turns]
    elif "instruction" in record:  # LLaMA-Factory Alpaca
        made = [dict(rest, output=_text(reply, key)) for reply, key in ((chosen, "chosen"), (rejected, "rejected"))]
    elif "prompt" in record:
        prompt = record["prompt"]
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, "prompt")
        made = [dict(rest, messages=[*turns, *_replies(reply, key)])
                for reply, key in ((chosen, "chosen"), (rejected, "rejected"))]
    else:  # TRL's implicit prompt: two whole conversations, the same but for their last turn
        whole = [_messages(chosen, "chosen"), _messages(rejected, "rejected")]
        if whole[0][:-1] != whole[1][:-1] or whole[0][-1].get("role") != "assistant":
            raise ValueError("'chosen' and 'rejected' without a 'prompt' must be conversations that differ only in "
                             "their last (assistant) turn")
        made = [dict(rest, messages=conversation) for conversation in whole]
    present = [key in record for key in REFERENCE_KEYS]
    if any(present) and not all(present):
        raise ValueError(f"give both {REFERENCE_KEYS[0]!r} and {REFERENCE_KEYS[1]!r}, or neither")
    reference = None
    if all(present):
        values = [record[key] for key in REFERENCE_KEYS]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in values):
            raise ValueError(f"{REFERENCE_KEYS[0]!r} and {REFERENCE_KEYS[1]!r} must be numbers <= 0 (summed "
                             f"log-probabilities), got {values}")
        reference = (float(values[0]), float(values[1]))
    return made[0], made[1], reference


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string here, got {type(value).__name__}")
    return value


def _messages(value: Any, key: str) -> list[dict]:
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise ValueError(f"{key!r} must be a string or a non-empty list of messages")
    return value


def _replies(value: Any, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    replies = _messages(value, key)
    if any(m.get("role") != "assistant" for m in replies):
        raise ValueError(f"{key!r} beside a 'prompt' holds the reply only: assistant messages")
    return replies


def _one_turn(value: Any, key: str) -> dict:
    if isinstance(value, dict) and isinstance(value.get("value"), str):
        return value
    raise ValueError(f"{key!r} beside sharegpt 'conversations' must be one turn, {{\"from\": \"gpt\", \"value\": ...}}")


def join_pair(chosen: Sample, rejected: Sample, *, reference: tuple[float, float] | None) -> Sample:
    """One sample of both conversations, chosen first; the vision inputs of each, in order."""
    def cat(a, b):
        return None if a is None else torch.cat([a, b])

    for field in ("pixel_values", "pixel_values_videos"):
        if (getattr(chosen, field) is None) != (getattr(rejected, field) is None):
            raise ValueError("the chosen and the rejected conversation must hold the same images and videos")
    return Sample(
        input_ids=torch.cat([chosen.input_ids, rejected.input_ids]), labels=torch.cat([chosen.labels, rejected.labels]),
        mm_token_type_ids=torch.cat([chosen.mm_token_type_ids, rejected.mm_token_type_ids]),
        **{f: cat(getattr(chosen, f), getattr(rejected, f)) for f in (
            "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")},
        pair_split=torch.tensor([chosen.num_tokens]),
        reference_logps=None if reference is None else torch.tensor(reference, dtype=torch.float64))


def split_pair(sample: Sample) -> tuple[Sample, Sample]:
    """The pair's two conversations as samples of their own (chosen, rejected)."""
    if sample.pair_split is None:
        raise ValueError("not a preference pair (no 'chosen' and 'rejected' in its record)")
    cut = int(sample.pair_split[0])
    halves = []
    for part in (slice(0, cut), slice(cut, None)):
        halves.append({"input_ids": sample.input_ids[part], "labels": sample.labels[part],
                       "mm_token_type_ids": sample.mm_token_type_ids[part]})
    # Each conversation holds the same images and videos: the first half of each list is the chosen one's.
    for pixels, grid, extra in (("pixel_values", "image_grid_thw", None),
                                ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")):
        grids = getattr(sample, grid)
        if grids is None:
            continue
        n = grids.shape[0] // 2
        rows = int(grids[:n].prod(-1).sum())
        values = getattr(sample, pixels)
        for half, (g, v) in zip(halves, ((grids[:n], values[:rows]), (grids[n:], values[rows:]))):
            half[grid], half[pixels] = g, v
        if extra is not None:
            seconds = getattr(sample, extra)
            halves[0][extra], halves[1][extra] = seconds[:n], seconds[n:]
    return Sample(**halves[0]), Sample(**halves[1])


def collate_pairs(samples: Sequence[Sample], *, collate: Callable[[list[Sample]], dict],
                  packed: bool) -> dict[str, torch.Tensor]:
    """A micro-batch of pairs: ``collate`` (packed: one row of documents; else rows) of the
    conversations chosen 0, rejected 0, chosen 1, ..., and the keys plugins/objective.py
    reads: ``weft_sequence`` (each token's conversation, 2p + 0 / 1), ``weft_pairs`` and,
    where every pair has it, ``weft_reference`` (2P,)."""
    conversations = [half for sample in samples for half in split_pair(sample)]
    out = collate(conversations)
    if packed:
        out["weft_sequence"] = out["weft_doc_ids"].clone()  # (1, S): document d is conversation d
    else:
        out["weft_sequence"] = torch.arange(len(conversations))[:, None].expand_as(out["input_ids"]).clone()
    out["weft_pairs"] = torch.tensor(len(samples))
    if all(s.reference_logps is not None for s in samples):
        out["weft_reference"] = torch.cat([s.reference_logps for s in samples])  # (2P,)
    return out

