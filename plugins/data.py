"""The recipe's samples as the built-in batching reads them: source, bad-sample
accounting, the shared preprocessing cache, and truncation of over-long samples."""

from __future__ import annotations

from typing import Any

from weft.core.errors import WeftError


def sample_source(recipe, adapter) -> tuple[Any, Any]:
    """(tokenizer, iterator of Sample | BadSample) for the recipe's data, as a run reads it."""
    from weft.strategies import datasets
    from weft.strategies.conversation import load_processor

    _, processor = adapter.config(recipe)
    if processor is None:
        raise WeftError("this model has no processor (tokenizer and image processor) to read data with; "
                        "set model.processor to a processor folder", where=f"{recipe.source} (model.processor)")
    tokenizer, image_processor = load_processor(processor)
    if recipe.data.source == "synthetic":
        return tokenizer, datasets.synthetic_samples(
            seed=recipe.train.seed, num_samples=recipe.data.num_samples, min_side=recipe.data.min_side,
            max_side=recipe.data.max_side, tokenizer=tokenizer, image_processor=image_processor,
        )
    path = recipe.data_file()
    if not path.is_file():
        raise WeftError(f"data.path {str(path)!r} does not exist", where=f"{recipe.source} (data.path)")
    from weft.strategies.preprocess import default_workers

    workers = default_workers() if recipe.data.workers == -1 else recipe.data.workers
    cache = path.with_name(path.name + ".weft-cache") if recipe.data.cache else None
    return tokenizer, datasets.jsonl_samples(path, processor=processor, workers=workers, cache_dir=cache)


def bad_sample_handler(recipe, ctx):
    """Skip and count a bad sample, or stop the run when ``data.strict`` says so."""

    def on_bad(bad):
        if recipe.data.strict:
            raise WeftError(f"bad sample ({bad.reason}); data.strict = true stops the run", where=bad.where)
        ctx.count("skipped_samples")
        ctx.log.warning("data.skipped", where=bad.where, reason=bad.reason)

    return on_bad


def collect_samples(recipe, source, *, on_bad) -> list:
    """Every good sample of ``source``. With a shared cache on several ranks, rank 0
    preprocesses and fills the cache first; the others then read it. Preprocessing a
    large dataset outlasts the run's collective timeout, so they wait on a CPU group of
    their own with a long one."""
    import datetime

    import torch.distributed as dist

    from weft.strategies import datasets

    shared = recipe.data.source == "jsonl" and recipe.data.cache and dist.is_initialized() and dist.get_world_size() > 1
    if shared:
        waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=12))
        if dist.get_rank() != 0:
            dist.barrier(group=waiting)
    samples = datasets.collect(source, on_bad=on_bad)
    if shared and dist.get_rank() == 0:
        dist.barrier(group=waiting)
    return samples


def truncate(samples, *, limit, tokenizer, ctx, on_bad) -> list:
    """Samples longer than ``limit`` keep their head (never cutting an image span)."""
    from weft.strategies.conversation import truncate_sample
    from weft.strategies.datasets import BadSample

    kept = []
    for index, sample in enumerate(samples):
        if sample.num_tokens <= limit:
            kept.append(sample)
            continue
        try:
            kept.append(truncate_sample(sample, limit, tokenizer=tokenizer))
            ctx.count("truncated_samples")
        except ValueError as error:
            on_bad(BadSample(f"sample {index}", str(error)))
    return kept
