"""Plain text files packed into samples of one length: real text, for loss curves that move.

Random tokens through a random-init model leave the loss near ln(vocabulary) whatever the
precision, so they cannot show what a precision costs. Text can: the files a glob names
(sorted, read as UTF-8), each tokenized and closed by the end-of-text id, joined into one
stream and cut into consecutive samples of exactly ``tokens`` ids, the loss on every one.
``<stdlib>/`` at the start of a pattern is the running Python's standard library folder:
every machine has a few dozen MB of real text there, so the recipes ship with no data.

Without a tokenizer (a preset of a real size has no processor folder), a byte-level BPE is
trained on the corpus itself with the ``tokenizers`` library, its vocabulary within the
model's, and cached by the corpus's files, sizes and modification times.
"""

from __future__ import annotations

import glob
import hashlib
import json
import pathlib
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from weft.strategies.data.conversation import Sample

STDLIB = "<stdlib>"
_INSTALLED = {"site-packages", "dist-packages"}
END_OF_TEXT = "<|endoftext|>"


def corpus_files(pattern: str, *, base: pathlib.Path) -> list[pathlib.Path]:
    """The regular files ``pattern`` names (``**`` recursive), sorted; a relative pattern is
    taken from ``base``, one opening with ``<stdlib>/`` from the standard library's folder."""
    stdlib = pattern == STDLIB or pattern.startswith(STDLIB + "/")
    if stdlib:
        pattern = sysconfig.get_paths()["stdlib"] + pattern[len(STDLIB):]
    elif not pathlib.Path(pattern).is_absolute():
        pattern = str(base / pattern)
    found = (pathlib.Path(p) for p in glob.glob(pattern, recursive=True))
    # The standard library's folder also holds the installed packages: not the library's own text.
    return sorted(p for p in found if p.is_file() and not (stdlib and _INSTALLED & set(p.parts)))


class SkippedPastEnd(ValueError):
    """``skip`` reaches past the corpus's last sample: nothing is left to yield."""


def tokenizer_encode(tokenizer: Any) -> Callable[[str], list[int]]:
    """A model tokenizer's ids of plain text, as text samples and plain-text questions take
    them: no special tokens added."""
    return lambda text: tokenizer(text, add_special_tokens=False, verbose=False).input_ids


def text_samples(files: Sequence[pathlib.Path], *, encode: Callable[[str], list[int]], end: int | None,
                 tokens: int, num_samples: int, skip: int = 0) -> Iterator[Sample]:
    """Up to ``num_samples`` Samples of exactly ``tokens`` ids from the files in order (the
    stream's tail shorter than ``tokens`` is dropped), after the stream's first ``skip``
    samples (held out: a run's ``num_samples`` as ``skip`` gives samples it never trained on).
    Sample i is the same whatever ``num_samples``."""
    if tokens < 2:
        raise ValueError(f"text samples need at least 2 tokens, got {tokens}")
    stream: list[int] = []
    cut = made = 0
    for file in files:
        stream.extend(encode(file.read_text(encoding="utf-8", errors="replace")))
        if end is not None:
            stream.append(end)
        while len(stream) >= tokens:
            ids = torch.tensor(stream[:tokens], dtype=torch.long)  # (S,)
            del stream[:tokens]
            if cut < skip:
                cut += 1
                continue
            yield Sample(input_ids=ids, labels=ids.clone())
            made += 1
            if made == num_samples:
                return
    if skip and not made:  # a held-out evaluation past the corpus's end: say how far it reaches
        raise SkippedPastEnd(f"skip = {skip} leaves no sample: the files hold {cut} samples of {tokens} tokens")


def corpus_tokenizer(files: Sequence[pathlib.Path], *, vocab_size: int, cache_dir: pathlib.Path) -> tuple[
        Callable[[str], list[int]], int]:
    """(encode, end-of-text id) of a byte-level BPE of at most ``vocab_size`` ids trained on
    ``files``, read from ``cache_dir`` when the same corpus trained one before."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    key = hashlib.sha256(json.dumps([vocab_size, *((str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                                   for f in files)]).encode()).hexdigest()[:16]
    path = cache_dir / f"bpe-{key}.json"
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        # The files as text_samples reads them (undecodable bytes replaced), not as raw bytes.
        texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
        tokenizer.train_from_iterator(texts, trainer, length=len(files))
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        tokenizer.save(str(partial))
        partial.replace(path)  # whole or absent: a second run never reads half a file
    return (lambda text: tokenizer.encode(text).ids), tokenizer.token_to_id(END_OF_TEXT)
