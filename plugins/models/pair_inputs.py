"""`weft eval --reference`'s inputs: each preference record of the recipe's data encoded exactly
as training encodes it (strategies/data/preprocess.py, the same processor, system message,
pixel budget and video sampling), its chosen and rejected conversations as one micro-batch
each (B = 1, labelled on the response), in the file's order, with the record's line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def pair_inputs(*, recipe: Any, processor: str | None, config: Any) -> Iterator[tuple[str, str, Any]]:
    """(where, the record as a JSON line, (chosen batch, rejected batch) or the reason the
    record is a bad sample) for every record of every data file of ``recipe``."""
    from weft.core.errors import WeftError
    from weft.plugins.batching.samples import jsonl_files, pad_id_of, video_limits
    from weft.strategies.data import record_files
    from weft.strategies.data.conversation import collate, load_processor, processor_dir
    from weft.strategies.data.datasets import jsonl_lines
    from weft.strategies.data.pairs import split_pair
    from weft.strategies.data.preprocess import encode_lines

    if processor is None:
        raise WeftError("this recipe's model has no processor folder (model.processor) to read the pairs with",
                        where="model.processor")
    pad = pad_id_of(load_processor(processor)[0], config)
    for _, path in jsonl_files(recipe):
        lines: dict[str, Any] = {}  # where -> line, until its encoding comes back (in order)

        def feed(path=path, lines=lines):
            for where, line in jsonl_lines(path, split=recipe.data.split):
                lines[where] = line
                yield where, line

        for where, out in encode_lines(feed(), processor=processor, processor_folder=processor_dir(processor),
                                       base=record_files.base_of(path), workers=1, cache_dir=None,
                                       skip_pixels=recipe.data.skip_pixels, videos=video_limits(recipe, processor),
                                       system=recipe.data.system, pixels=recipe.data.pixels,
                                       allow_outside=recipe.data.allow_outside):
            line = lines.pop(where)
            if isinstance(out, str):
                yield where, line, out
            elif out.pair_split is None:
                yield where, line, "not a preference pair (a record with 'chosen' and 'rejected': docs/preference.md)"
            else:
                yield where, line, tuple(collate([half], pad_id=pad) for half in split_pair(out))
