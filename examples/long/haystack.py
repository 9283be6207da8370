"""The haystack of examples/long: real text from the standard library, cut to an exact length in
the model's tokens, a needle put at a chosen depth.

Text: the ``.py`` files of the running Python's standard library (every machine has ~30 MB of
them; installed packages left out), their digits left out, split by file into a training part and a held-out part by a
hash of the file's name, so a question's haystack never comes from a file the model was trained
on (:func:`corpus_parts`). Lengths are counted by weft's own encoding of the conversation (the
recipe's tokenizer and chat template, images widened to their vision tokens): what the model
reads is exactly ``length`` tokens (:func:`fit`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import multiprocessing
import os
import pathlib
import random
import zlib
from collections.abc import Callable, Iterator, Sequence

from weft.strategies.data.conversation import encode_conversation, encode_prompt, load_processor
from weft.strategies.data.formats import record_to_messages
from weft.strategies.data.text_corpus import corpus_files

CORPUS = "<stdlib>/**/*.py"
#: One file in HELD_OUT_EVERY is held out (by the CRC-32 of its path below the library's folder).
HELD_OUT_EVERY = 10
_NO_DIGITS = str.maketrans("", "", "0123456789")
#: Text the tokenizer or the data reader would take for markup, never left in a haystack.
_MARKUP = ("<|", "|>", "<image>", "<video>")


def corpus_parts(pattern: str = CORPUS) -> tuple[pathlib.Path, dict[str, list[pathlib.Path]]]:
    """(the folder every corpus file lies under, its files by part: ``"train"`` and ``"held_out"``,
    sorted, disjoint, together every file), from one walk of the corpus."""
    files = corpus_files(pattern, base=pathlib.Path.cwd())
    if not files:
        raise ValueError(f"no file matches {pattern!r}")
    root = pathlib.Path(os.path.commonpath([str(f.parent) for f in files]))

    def held(path: pathlib.Path) -> bool:  # by the name below the corpus's folder: the same on every machine
        return zlib.crc32(str(path.relative_to(root)).encode()) % HELD_OUT_EVERY == 0

    return root, {"train": [f for f in files if not held(f)], "held_out": [f for f in files if held(f)]}


class Corpus:
    """One part's text, read once; :meth:`slice` draws a stretch of it from a seeded Random."""

    @classmethod
    def of(cls, part: str) -> Corpus:
        """The training (``"train"``) or the held-out (``"held_out"``) part of the standard library's text."""
        root, parts = corpus_parts()
        return cls(parts[part], root=root)

    def __init__(self, files: Sequence[pathlib.Path], *, root: pathlib.Path) -> None:
        texts = []
        for f in files:
            text = f.read_text(encoding="utf-8", errors="replace")
            for mark in _MARKUP:
                text = text.replace(mark, " ")
            # No digit: the key is the only number in a question, as in the original test, whose
            # haystack ("The grass is green. The sky is blue. ...") has none, and a key can never
            # occur in the haystack by chance.
            text = text.translate(_NO_DIGITS)
            texts.append(text)
        self.names = [str(f.relative_to(root)) for f in files]
        self.text = "\n".join(texts)
        self.starts = [0]
        for t in texts[:-1]:
            self.starts.append(self.starts[-1] + len(t) + 1)

    def slice(self, chars: int, *, rng: random.Random) -> tuple[str, list[str]]:
        """(``chars`` characters from a random line start, the files they come from, below the root)."""
        if chars >= len(self.text):
            raise ValueError(f"the corpus holds {len(self.text)} characters, {chars} asked")
        start = self.text.rfind("\n", 0, rng.randrange(len(self.text) - chars)) + 1
        end = start + chars
        names = [self.names[i] for i, s in enumerate(self.starts)
                 if s < end and (i + 1 == len(self.starts) or self.starts[i + 1] > start)]
        return self.text[start:end], names


def insert_at(haystack: str, needle: str, *, depth: float) -> tuple[str, int]:
    """``haystack`` with ``needle`` put at the line boundary nearest ``depth`` (0: first, 1: last) of
    its characters; (the text, where the needle starts)."""
    at = round(depth * len(haystack))
    before = haystack.rfind("\n", 0, at) + 1 if at < len(haystack) else len(haystack)
    after = haystack.find("\n", at)
    after = len(haystack) if after < 0 else after + 1
    cut = before if at - before <= after - at else after
    return haystack[:cut] + needle + haystack[cut:], cut


class Encoder:
    """Token counts of records as weft reads them (one processor folder, images relative to ``base``)."""

    def __init__(self, processor: str, *, base: pathlib.Path) -> None:
        self.tokenizer, self.image_processor = load_processor(processor)
        self.base = base

    def ids(self, record: dict, *, prompt: bool) -> list[int]:
        """The record's token ids: the question with the generation prompt (``prompt``: as a task
        question is read) or the whole conversation (as a training sample is read)."""
        messages = record_to_messages(record, base=self.base)
        if prompt:
            messages = [m for m in messages if m["role"] != "assistant"]
            sample = encode_prompt(messages, tokenizer=self.tokenizer, image_processor=self.image_processor)
        else:
            sample = encode_conversation(messages, tokenizer=self.tokenizer, image_processor=self.image_processor)
        return sample.input_ids.tolist()


def fit(build: Callable[[int], dict], *, count: Callable[[dict], int], length: int, start: int, limit: int) -> dict:
    """The record ``build(n)`` of exactly ``length`` tokens by ``count``, ``n`` the haystack's
    characters: secant steps on n (the count grows about linearly with n, by a token or none a
    character, now and then by two where a merge breaks), kept inside the bracket the counts so
    far give and bisecting it where a step would repeat itself, then the n's around the
    boundary. A few counts a record where bisection alone took a dozen (each count tokenizes
    the whole record: most of a long task's making). ValueError when no n gives exactly
    ``length`` (the caller draws another haystack), or when ``limit`` characters are too few."""
    counts: dict[int, int] = {}
    low, high = -1, limit + 1  # count(low) < length <= count(high); the ends not counted yet
    n = max(1, min(start, limit))
    while high - low > 1:
        record = build(n)
        got = counts[n] = count(record)
        if got == length:
            return record
        if got < length:
            if n >= limit:
                raise ValueError(f"{limit} characters give fewer than {length} tokens")
            low = n
        else:
            high = n
        guess = n + (length - got) * n // max(got, 1)  # characters a token, as this count gives them
        n = min(max(guess, low + 1), high - 1, limit)
        if n in counts:  # the secant repeats a count: halve the bracket instead
            n = min((low + high) // 2, limit)
            if n in counts:
                break
    for n in (high, high - 1, high + 1, high - 2, high + 2, high + 3):  # the first with the count is here
        if 0 <= n <= limit and counts.get(n, length) == length:
            record = build(n)
            if count(record) == length:
                return record
    raise ValueError(f"no haystack of exactly {length} tokens near {high} characters")


def draw_length(rng: random.Random, *, low: int, high: int, log: bool, long_share: float = 0.0) -> int:
    """A training line's length from ``low`` to ``high`` tokens: uniform, or (``log``) uniform in
    its logarithm, so that a curriculum reaching thousands of tokens still holds as many lines
    of hundreds as of thousands (the short ones are where a model from random initialisation
    first learns where to look). ``long_share`` of the lines instead uniform in the top half,
    ``high / 2`` to ``high``: log-uniform alone leaves few lines near ``high``, and fewer keys
    as far from their question as the longest questions put them (BENCHMARKS.md, "Retrieval to
    128K on one H100")."""
    if low >= high:
        return high
    if long_share and rng.random() < long_share:
        return rng.randint(max(low, high // 2), high)
    if not log:
        return rng.randint(low, high)
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))


def draw_depth(rng: random.Random, *, edges: float) -> float:
    """A training line's needle depth: uniform in [0, 1), but ``edges`` of the lines at exactly 0
    (right after the instruction) or 1 (right before the question), half each. The questions
    ask at 0 and 1 (two of the five depths) and a uniform draw almost never puts a needle
    there: a model trained so missed both edges at every length."""
    if rng.random() < edges:
        return float(rng.random() < 0.5)
    return rng.random()


def subsequence_starts(ids: Sequence[int], key_ids: Sequence[int]) -> list[int]:
    """Every index where ``key_ids`` starts in ``ids``."""
    k = len(key_ids)
    return [i for i in range(len(ids) - k + 1) if list(ids[i : i + k]) == list(key_ids)]


@contextlib.contextmanager
def line_makers(processes: int, *, initializer: Callable, initargs: tuple) -> Iterator[Callable]:
    """``map`` over jobs in ``processes`` processes (each set up by ``initializer``), in order; this
    process is set up too (one process: it makes every line)."""
    initializer(*initargs)
    if processes <= 1:
        yield map
        return
    with multiprocessing.get_context("spawn").Pool(processes, initializer=initializer, initargs=initargs) as pool:
        yield functools.partial(pool.imap, chunksize=8)


def add_line_arguments(parser: argparse.ArgumentParser, *, train_length: int, train_samples: int, lengths: str,
                       needle: str) -> None:
    """The arguments both generators take: where, the tokenizer, the training lines' count,
    lengths and depths, the questions' lengths and depths, the seed and the processes;
    ``needle`` names what each line hides ("keys", "needles")."""
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--processor", default="tiny_vl", help="the recipe's processor folder (or bundled name)")
    parser.add_argument("--train-length", type=int, default=train_length)
    parser.add_argument("--train-samples", type=int, default=train_samples)
    parser.add_argument("--train-min-length", type=int, default=0,
                        help="training lines of a random length from this to --train-length (0: all of "
                             "--train-length): short haystacks first teach where to look")
    parser.add_argument("--log-lengths", action="store_true",
                        help="draw those lengths uniformly in their logarithm (as many of hundreds as of thousands)")
    parser.add_argument("--long-share", type=float, default=0.0,
                        help="this share of the training lines uniform from half of --train-length to all of it")
    parser.add_argument("--edge-depths", type=float, default=0.0,
                        help=f"this share of the training {needle} at depth 0 or 1 exactly (the others uniform)")
    parser.add_argument("--lengths", default=lengths)
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--per-depth", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="processes writing lines (the files do not depend on it)")
