"""Passkey retrieval in real text: a 5-digit key at a chosen depth of a standard-library haystack,
the question at the end (the YaRN paper's test, after Mohtashami and Jaggi's landmark attention).

    python examples/long/make_passkey.py OUT_DIR [--processor tiny_vl] [--train-length 512]
        [--train-samples 3000] [--text-fraction 0.25] [--lengths 512,1024,2048,4096]
        [--depths 0,0.25,0.5,0.75,1] [--per-depth 8] [--seed 0]

writes OUT_DIR/train.jsonl (``--train-samples`` conversations of exactly ``--train-length``
tokens: passkey questions at random depths answered with the key, and a ``--text-fraction`` of
plain text to continue, from the corpus's training files) and OUT_DIR/passkey-N.jsonl for each
N of ``--lengths``: ``weft eval --task`` questions whose prompt is exactly N tokens, ``--per-depth``
at each depth of ``--depths``, their haystacks from the held-out files only. A question's line:

    {"messages": [{"role": "user", "content": "There is a pass key hidden ... What is the pass key?"}],
     "answer": "71432", "id": "passkey-2048-d0.50-3",
     "meta": {"task": "passkey", "length": 2048, "depth": 0.5, "needle_token": 1031, "files": [...]}}

``meta.needle_token`` is the index of the key's first token in the prompt; the key occurs in the
prompt twice (the needle says it twice) and nowhere else, and no other line of the file has it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
from collections.abc import Sequence

from weft.core.whole_files import written_whole

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from haystack import (  # noqa: E402
    Corpus,
    Encoder,
    add_line_arguments,
    draw_depth,
    draw_length,
    fit,
    insert_at,
    line_makers,
    subsequence_starts,
)

INTRO = "Find the pass key hidden in this text.\n"  # the landmark prompt, short: a small model reads it in every line
QUESTION = "\nWhat is the pass key?"
TEXT_PROMPT = "Continue the text."


def needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key.\n"


def reply(key: str) -> str:
    """The answer: the key in a sentence, as a chat model says it. Its opening words are the
    needle's, so the key follows the same words as in the needle: a small model from random
    initialisation finds it by looking back for them (an induction head) within a thousand
    steps, where a bare key after the reply's header stayed at chance."""
    return f"The pass key is {key}."


def passkey_record(haystack: str, *, key: str, depth: float, answer: bool) -> dict:
    """The question with the needle at ``depth`` of ``haystack`` (and the key as the reply: ``answer``)."""
    text, _ = insert_at(haystack, needle(key), depth=depth)
    messages = [{"role": "user", "content": INTRO + text + QUESTION}]
    if answer:
        messages.append({"role": "assistant", "content": reply(key)})
    return {"messages": messages}


def draw_key(rng: random.Random, *, avoid: str) -> str:
    """A 5-digit key (no leading zero) that ``avoid`` does not contain."""
    while True:
        key = str(rng.randrange(10_000, 100_000))
        if key not in avoid:
            return key


def passkey_line(corpus: Corpus, encoder: Encoder, *, length: int, depth: float, rng: random.Random,
                 answer: bool, used: set[str]) -> dict:
    """One passkey line of exactly ``length`` tokens (the prompt's, or with ``answer`` the whole
    conversation's), its key new to ``used``."""
    for _ in range(20):
        pool, files = corpus.slice(4 * length + 4096, rng=rng)  # more characters than any fit takes
        key = draw_key(rng, avoid=pool)
        if key in used:
            continue
        try:
            record = fit(lambda n: passkey_record(pool[:n], key=key, depth=depth, answer=answer),
                         count=lambda r: len(encoder.ids(r, prompt=not answer)), length=length, start=length,
                         limit=len(pool))
        except ValueError:
            continue
        ids = encoder.ids(record, prompt=True)
        key_ids = encoder.tokenizer(key, add_special_tokens=False)["input_ids"]
        found = subsequence_starts(ids, key_ids)
        if len(found) != 2:  # the haystack's edge merged with the key: draw again
            continue
        used.add(key)
        line = dict(record, answer=reply(key))
        line["meta"] = {"task": "passkey", "key": key, "length": length, "depth": depth, "needle_token": found[0],
                        "files": files}
        return line
    raise RuntimeError(f"could not build a passkey line of {length} tokens at depth {depth}")


#: The names of a text line's keys (a question's single key has none).
NAMES = ("Quill", "Marlow", "Tansy", "Brio", "Oskar", "Wren", "Juniper", "Cato", "Fennel", "Ines", "Yarrow", "Bede")


def text_line(corpus: Corpus, encoder: Encoder, *, length: int, rng: random.Random) -> dict:
    """Plain text to continue with ``keys`` named keys hidden in it ("Wren's pass key is 40213.")
    and each said again at its end, in another order, the loss on all of it (the whole
    conversation exactly ``length`` tokens): a recall at every key, where a question has one
    at its reply; what is learnt there (what followed the same words before) answers the
    question. Up to six keys, fewer in short lines (each takes ~60 tokens with its recall)."""
    keys = max(1, min(6, (length - 100) // 80))
    for _ in range(20):
        pool, files = corpus.slice(4 * length + 4096, rng=rng)
        names = rng.sample(NAMES, keys)
        said = {name: draw_key(rng, avoid=pool) for name in names}
        depths = sorted(rng.random() for _ in names)
        recalled = rng.sample(names, keys)

        def text(n: int, pool=pool, said=said, depths=depths, recalled=recalled) -> str:
            body = pool[:n]
            for name, depth in zip(reversed(list(said)), reversed(depths)):
                body = insert_at(body, f"{name}'s pass key is {said[name]}.\n", depth=depth)[0]
            return body + "".join(f"\n{name}'s pass key is {said[name]}." for name in recalled)

        try:
            record = fit(lambda n: {"messages": [{"role": "user", "content": TEXT_PROMPT},
                                                 {"role": "assistant", "content": text(n)}]},
                         count=lambda r: len(encoder.ids(r, prompt=False)), length=length, start=length,
                         limit=len(pool))
        except ValueError:
            continue  # no haystack of exactly the length from this stretch: another one
        return dict(record, meta={"task": "text", "keys": said, "length": length, "files": files})
    raise RuntimeError(f"could not build a text line of {length} tokens")


#: Each process's encoder and corpora (a pool's initializer fills it): read once, not per line.
_STATE: dict = {}


def _start(processor: str, base: str) -> None:
    _STATE.update(encoder=Encoder(processor, base=pathlib.Path(base)), train=None, held_out=None)


def make_line(job: tuple) -> dict:
    """One line from its own seed (so any number of processes writes the same files): ``job`` is
    (part, kind, length, depth or None, seed text, keys to avoid)."""
    part, kind, length, depth, seed, avoid = job
    if _STATE[part] is None:
        _STATE[part] = Corpus.of(part)
    rng = random.Random(seed)
    if kind == "text":
        return text_line(_STATE[part], _STATE["encoder"], length=length, rng=rng)
    return passkey_line(_STATE[part], _STATE["encoder"], length=length, depth=rng.random() if depth is None else depth,
                        rng=rng, answer=part == "train", used=set(avoid))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_line_arguments(parser, train_length=512, train_samples=3000, lengths="512,1024,2048,4096", needle="keys")
    parser.add_argument("--text-fraction", type=float, default=0.25)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pick = random.Random(f"{args.seed}:kinds")
    low = args.train_min_length or args.train_length
    train_jobs = []
    for i in range(args.train_samples):
        kind = "text" if pick.random() < args.text_fraction else "passkey"
        length = (args.train_length if kind == "text" else
                  draw_length(pick, low=low, high=args.train_length, log=args.log_lengths, long_share=args.long_share))
        depth = draw_depth(pick, edges=args.edge_depths) if args.edge_depths and kind != "text" else None
        train_jobs.append(("train", kind, length, depth, f"{args.seed}:train:{i}", ()))
    depths = [float(d) for d in args.depths.split(",")]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    task_jobs = {n: [("held_out", "passkey", n, d, f"{args.seed}:task:{n}:{d}:{j}", ()) for d in depths
                     for j in range(args.per_depth)] for n in lengths}
    with line_makers(args.jobs, initializer=_start, initargs=(args.processor, str(args.out))) as each:
        if train_jobs:
            with written_whole(args.out / "train.jsonl") as out:
                for i, line in enumerate(each(make_line, train_jobs)):
                    line.pop("answer", None)  # a training line: the reply is the answer
                    out.write(json.dumps(dict(line, id=f"train-{i}")) + "\n")
        used: set[str] = set()
        for n in lengths:
            found = list(each(make_line, task_jobs[n]))
            for index, line in enumerate(found):
                while line["meta"]["key"] in used:  # no key twice among the questions: that line again
                    part, kind, length, depth, seed, _ = task_jobs[n][index]
                    line = make_line((part, kind, length, depth, seed + "'", tuple(used)))
                used.add(line["meta"]["key"])
                found[index] = line
            with written_whole(args.out / f"passkey-{n}.jsonl") as out:
                for (_, _, _, depth, _, _), line, j in zip(task_jobs[n], found,
                                                          [j for _ in depths for j in range(args.per_depth)]):
                    out.write(json.dumps(dict(line, id=f"passkey-{n}-d{depth:.2f}-{j}")) + "\n")
    print(json.dumps({"out": str(args.out), "train_samples": args.train_samples, "lengths": lengths,
                      "depths": depths, "per_depth": args.per_depth}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
