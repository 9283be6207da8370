"""The recipe's samples as the built-in batching reads them: source, bad-sample
accounting, the shared preprocessing cache, and truncation of over-long samples."""

from __future__ import annotations

from typing import Any

from weft.core.errors import WeftError


def sample_source(recipe, family) -> tuple[Any, Any]:
    """(tokenizer, iterator of Sample | BadSample) for the recipe's data, as a run reads it."""
    from weft.strategies.data import datasets
    from weft.strategies.data.conversation import load_processor, load_video_sizing

    config, processor = family.config(recipe)
    if recipe.data.source == "synthetic" and recipe.data.tokens:
        return long_synthetic(recipe, config=config, processor=processor)
    if recipe.data.source == "text":
        return text_corpus(recipe, config=config, processor=processor)
    _need_processor(recipe, processor)
    tokenizer, image_processor = load_processor(processor)
    if recipe.data.source == "synthetic":
        return tokenizer, datasets.synthetic_samples(
            seed=recipe.train.seed, num_samples=recipe.data.num_samples, min_side=recipe.data.min_side,
            max_side=recipe.data.max_side, tokenizer=tokenizer, image_processor=image_processor,
            videos=tuple(tuple(size) for size in recipe.data.videos), system=recipe.data.system,
            video_sizing=load_video_sizing(processor),
        )
    files = jsonl_files(recipe)
    return tokenizer, (sample for _, path in files for sample in _file_samples(recipe, path, processor))


def _file_samples(recipe, path, processor):
    """One JSONL (or JSON array) file's samples, preprocessed as the recipe says (no store)."""
    from weft.strategies.data import datasets

    return datasets.jsonl_samples(path, processor=processor, workers=_workers(recipe),
                                  cache_dir=_cache_of(path) if recipe.data.cache else None,
                                  skip_pixels=recipe.data.skip_pixels, system=recipe.data.system,
                                  videos=video_limits(recipe, processor), pixels=recipe.data.pixels,
                                  split=recipe.data.split, allow_outside=recipe.data.allow_outside)


def _need_processor(recipe, processor) -> None:
    if processor is None:
        raise WeftError("this model has no processor (tokenizer and image processor) to read data with; "
                        "set model.processor to a processor folder", where=f"{recipe.source} (model.processor)")


def jsonl_files(recipe) -> list:
    """(the key naming it, the file) of each data file of a JSONL recipe, each checked to exist."""
    files = recipe.data_files()
    for key, path in files:
        if not path.exists():
            raise WeftError(f"{key} {str(path)!r} does not exist", where=f"{recipe.source} ({key})")
    return files


def _workers(recipe) -> int:
    from weft.strategies.data.preprocess import default_workers

    return default_workers() if recipe.data.workers == -1 else recipe.data.workers


def _cache_of(path):
    """The cache folder beside a data file."""
    return path.with_name(path.name + ".weft-cache")


def long_synthetic(recipe, *, config, processor) -> tuple[Any, Any]:
    """(tokenizer or None, samples) of ``data.tokens`` tokens for any model shape: ids from the
    model's vocabulary, images through its image processor, or, when it has none (a preset
    of a real size), pixel values made in the processor's layout from the vision config."""
    from weft.strategies.data.synthetic_long import long_samples, special_ids

    data = recipe.data
    vision = getattr(config, "vision_config", None)
    for key in ("images", "videos"):
        if getattr(data, key) and vision is None:
            raise WeftError(f"data.{key}: model_type {config.model_type!r} has no vision tower",
                            where=f"{recipe.source} (data.{key})")
    tokenizer = image_processor = None
    if processor is not None and (data.images or data.videos):
        from weft.strategies.data.conversation import load_processor

        tokenizer, image_processor = load_processor(processor)
    elif processor is not None:  # text only: a text model's directory has no image processor to read
        tokenizer = _tokenizer_if_any(processor)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    samples = long_samples(
        seed=recipe.train.seed, num_samples=data.num_samples,
        tokens=(data.tokens, data.tokens_max) if data.tokens_max else data.tokens,
        vocab_size=text.vocab_size, special=special_ids(config), images=[tuple(size) for size in data.images],
        image_processor=image_processor if data.images or data.videos else None,
        videos=[tuple(size) for size in data.videos], video_fps=video_limits(recipe, processor).fps,
        patch_size=getattr(vision, "patch_size", 14), merge_size=getattr(vision, "spatial_merge_size", 2),
        temporal_patch_size=getattr(vision, "temporal_patch_size", 2), in_channels=getattr(vision, "in_channels", 3),
        pair_response=data.pair_response_tokens,
    )
    return tokenizer, samples


def text_corpus(recipe, *, config, processor) -> tuple[Any, Any]:
    """(tokenizer or None, samples) of the text files ``data.path`` names, tokenized by the
    model's tokenizer, or by a byte-level BPE trained on them when the model has none."""
    import pathlib

    from weft.strategies.data.text_corpus import corpus_files, corpus_tokenizer, text_samples, tokenizer_encode

    files = corpus_files(recipe.data.path, base=recipe.relative("."))  # relative to the recipe, as data paths are
    where = f"{recipe.source} (data.path)"
    if not files:
        raise WeftError(f"data.path {recipe.data.path!r} names no file (a glob of plain text files; "
                        "\"<stdlib>/**/*.py\" takes the Python standard library's sources)", where=where)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tokenizer = _tokenizer_if_any(processor) if processor is not None else None
    if tokenizer is not None:
        end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        end = end if isinstance(end, int) and end != tokenizer.unk_token_id else tokenizer.eos_token_id
        encode = tokenizer_encode(tokenizer)
    else:  # a preset of a real size: a tokenizer of the corpus itself, within the model's vocabulary
        cache = pathlib.Path.home() / ".cache" / "weft" / "text-tokenizers"
        encode, end = corpus_tokenizer(files, vocab_size=min(text.vocab_size, 32768), cache_dir=cache)
    samples = text_samples(files, encode=encode, end=end, tokens=recipe.data.tokens,
                           num_samples=recipe.data.num_samples, skip=recipe.data.skip_samples)
    return tokenizer, _skip_named(samples, recipe=recipe)


def _skip_named(samples, *, recipe):
    """The samples; a data.skip_samples past the corpus's end as the key's message, not a traceback."""
    from weft.strategies.data.text_corpus import SkippedPastEnd

    try:
        yield from samples
    except SkippedPastEnd as error:  # only that: a tokenizer's own ValueError is not this key's mistake
        raise WeftError(f"data.skip_samples = {recipe.data.skip_samples} with data.path {recipe.data.path!r}: "
                        f"{error}; hold out fewer (at most the samples the files hold, less one)",
                        where=f"{recipe.source} (data.skip_samples)") from None


def video_limits(recipe, processor):
    """How the recipe's videos are sampled (strategies.video.VideoLimits): ``data.video_fps``,
    else the processor folder's video_preprocessor_config.json frame rate, else 2 fps."""
    from weft.strategies.data.conversation import load_video_sizing
    from weft.strategies.data.video import DEFAULT_FPS, VideoLimits

    fps = recipe.data.video_fps
    if fps is None:
        sizing = load_video_sizing(processor) if processor is not None else None
        fps = sizing.fps if sizing is not None and sizing.fps else DEFAULT_FPS
    return VideoLimits(fps=fps, max_frames=recipe.data.max_frames)


def _tokenizer_if_any(processor: str) -> Any:
    """The folder's tokenizer, or None when it has none (ids come from the vocabulary anyway)."""
    import transformers

    from weft.core.run.model_files import TOKENIZER_FILES
    from weft.strategies.data.conversation import processor_dir

    folder = processor_dir(processor)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def pad_id_of(tokenizer, config) -> int:
    """Padding id: the tokenizer's, else the config's, else 0 (pads are masked and unlabelled)."""
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "pad_token_id", None) or 0


def bad_sample_handler(recipe, ctx):
    """Skip and count a bad sample, or stop the run when ``data.strict`` says so."""

    def on_bad(bad):
        if recipe.data.strict:
            raise WeftError(f"bad sample ({bad.reason}); data.strict = true stops the run", where=bad.where)
        ctx.count("skipped_samples")
        ctx.log.warning("data.skipped", where=bad.where, reason=bad.reason)

    return on_bad


def run_samples(recipe, family, *, ctx, on_bad) -> tuple[Any, Any]:
    """(tokenizer, the good samples) as a run batches them: a JSONL file with ``data.cache``
    preprocessed once into shards on disk that every rank maps (strategies/data/shards.py),
    its bad lines reported from the store; any other source collected in memory; several
    ``[[data.sources]]`` mixed. Samples whose image tokens do not match their grids are
    reported and left out (plugins/batching/sample_checks.py)."""
    from weft.strategies.data import datasets

    try:
        return _run_samples(recipe, family, ctx=ctx, on_bad=on_bad)
    except datasets.DataFileError as error:
        raise WeftError(str(error), where=f"{recipe.source} (data.path)") from None


def _run_samples(recipe, family, *, ctx, on_bad) -> tuple[Any, Any]:
    from weft.plugins.batching.sample_checks import check_vision

    config, processor = family.config(recipe)
    if recipe.data.source != "jsonl":
        tokenizer, source = sample_source(recipe, family)
        return tokenizer, check_vision(collect_samples(recipe, source, on_bad=on_bad), config=config, ctx=ctx,
                                       on_bad=on_bad)
    from weft.strategies.data.conversation import load_processor

    _need_processor(recipe, processor)
    tokenizer, _ = load_processor(processor)
    parts = [check_vision(_file_store(recipe, path, processor, ctx=ctx, on_bad=on_bad), config=config, ctx=ctx,
                          on_bad=on_bad) for _, path in jsonl_files(recipe)]
    return tokenizer, mixed(recipe, parts, ctx=ctx) if recipe.data.sources else parts[0]


def _file_store(recipe, path, processor, *, ctx, on_bad):
    """A data file's samples: with ``data.cache``, its store of shards on disk (made by rank 0
    first), its bad lines reported from the store; else every sample in memory."""
    from weft.strategies.data import datasets

    if not recipe.data.cache:
        return datasets.collect(_file_samples(recipe, path, processor), on_bad=on_bad)
    store = _first_on_rank0(lambda: datasets.jsonl_store(
        path, processor=processor, cache_dir=_cache_of(path), workers=_workers(recipe),
        skip_pixels=recipe.data.skip_pixels, system=recipe.data.system, videos=video_limits(recipe, processor),
        pixels=recipe.data.pixels, split=recipe.data.split, allow_outside=recipe.data.allow_outside, log=ctx.log))
    for where, reason in store.bad:
        on_bad(datasets.BadSample(where, reason))
    ctx.log.info("data.store", samples=len(store), bad=len(store.bad), folder=str(store.folder))
    return store


def mixed(recipe, parts, *, ctx):
    """The ``[[data.sources]]`` mixed (strategies/data/mixture.py), drawn from ``train.seed``."""
    from weft.strategies.data.mixture import Mixture, chosen, quotas

    sources = recipe.data.sources
    sizes = [len(part) for part in parts]
    counts = quotas(sizes, weights=[s.weight for s in sources], samples=[s.samples for s in sources],
                    total=recipe.data.mix_samples)
    for n, (size, count) in enumerate(zip(sizes, counts)):
        if count and not size:
            raise WeftError(f"data.sources[{n}].path {sources[n].path!r} gives no usable sample for its "
                            f"{count} in the mixture", where=f"{recipe.source} (data.sources[{n}])")
    mixture = Mixture(parts, [chosen(size, count, seed=recipe.train.seed, source=n)
                              for n, (size, count) in enumerate(zip(sizes, counts))])
    ctx.log.info("data.mixture", samples=len(mixture), by_source=counts, available=sizes)
    return mixture


def _first_on_rank0(make):
    """``make()`` on rank 0 first, then on the others (which then find its work done): the
    shared preprocessing of several ranks. Preprocessing a large dataset outlasts the run's
    collective timeout, so they wait on a CPU group of their own with a long one."""
    import datetime

    import torch.distributed as dist

    shared = dist.is_initialized() and dist.get_world_size() > 1
    if shared:
        waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=12))
        if dist.get_rank() != 0:
            dist.barrier(group=waiting)
    try:
        return make()
    finally:
        if shared and dist.get_rank() == 0:
            dist.barrier(group=waiting)


def collect_samples(recipe, source, *, on_bad) -> list:
    """Every good sample of ``source``, in memory. With a shared cache on several ranks, rank 0
    preprocesses and fills the cache first; the others then read it."""
    from weft.strategies.data import datasets

    if recipe.data.source == "jsonl" and recipe.data.cache:
        return _first_on_rank0(lambda: datasets.collect(source, on_bad=on_bad))
    return datasets.collect(source, on_bad=on_bad)
