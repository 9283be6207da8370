"""Batching hook: this rank's optimizer steps, filled to the recipe's token budget."""

from __future__ import annotations

import pathlib
from typing import Any, Literal

import attrs

from weft.core.errors import WeftError
from weft.core.hookspecs import hookimpl
from weft.core.registry import Strategy
from weft.core.schema import in_range


@attrs.frozen(kw_only=True)
class TokenBudgetParams:
    bucket_size: int = attrs.field(default=256, validator=in_range(low=1), metadata={"doc": "samples sorted by length within buckets of this size"})
    pack: bool = attrs.field(default=False, metadata={"doc": "pack whole documents into one row per micro-batch; attention stays inside each document"})
    over_long: Literal["drop", "truncate"] = attrs.field(default="drop", metadata={"doc": "a sample longer than the limit: drop it, or keep its head (never cutting an image span)"})
    prefetch: int = attrs.field(default=2, validator=in_range(low=0), metadata={"doc": "steps collated ahead in a background thread; 0 = none"})


@hookimpl
def weft_strategies():
    return [Strategy(point="batching", name="token_budget", params=TokenBudgetParams, summary="micro-batches up to train.micro_batch_tokens, steps up to train.step_tokens, disjoint across DP ranks")]


@hookimpl
def weft_batching(decision, recipe, plan, mesh, model, ctx):
    if decision.strategy != "token_budget":
        return None
    split = install_sequence_split(model=model, plan=plan, mesh=mesh) if plan.mesh.sp > 1 else None
    keep_vision = False
    if plan.mesh.dp > 1 and model is not None:
        from weft.plugins.models.sp_hooks import vision_tower
        from weft.plugins.models.vision_sync import VisionKeepAlive

        if vision_tower(model) is not None:
            VisionKeepAlive(model)
            keep_vision = True
    return _prefetched(_steps(decision.params, recipe, plan, mesh, model, ctx, split, keep_vision), decision.params.prefetch)


def install_sequence_split(*, model, plan, mesh):
    """Hooks that cut the model's text sequence (after the vision merge) to this rank's part."""
    from weft.plugins.attention import sequence_layout, vision_share_threshold
    from weft.plugins.models.sp_hooks import SequenceParallelHooks
    from weft.strategies.sequence_split import TextSplit

    split = TextSplit(
        ring=plan.mesh.ring, ring_rank=mesh["ring"].get_local_rank(),
        ulysses=plan.mesh.ulysses, ulysses_rank=mesh["ulysses"].get_local_rank(),
        layout=sequence_layout(plan),
    )
    SequenceParallelHooks(
        model=model, split=split, sp_group=mesh.sp.get_group(), sp_rank=mesh.sp.get_local_rank(), sp_world=plan.mesh.sp,
        share_threshold=vision_share_threshold(plan),
    )
    return split


def shard_batch(batch: dict, split) -> dict:
    """Labels shifted on the whole sequence, then split like the decoder's inputs."""
    from weft.core.loss import targets

    out = dict(batch)
    out["shift_labels"] = split.shard(targets(batch), dim=1)
    out.pop("labels", None)
    return out


def _truncate(samples, *, limit, tokenizer, ctx, on_bad):
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


def _prefetched(steps, depth: int):
    """Collate the next ``depth`` steps in a background thread while the model trains.

    Collation is CPU work on already-preprocessed samples; a thread (not a process)
    keeps the tensors shareable without copies.
    """
    import queue
    import threading

    if depth == 0:
        yield from steps
        return
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill():
        try:
            for step in steps:
                buffer.put(step)
        except BaseException as error:  # hand the error to the consumer
            buffer.put(error)
        buffer.put(done)

    threading.Thread(target=fill, daemon=True, name="weft-prefetch").start()
    while (item := buffer.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def sample_source(recipe) -> tuple[Any, Any]:
    """(tokenizer, iterator of Sample | BadSample) for the recipe's data, as a run reads it."""
    from weft.plugins.models.build import model_config
    from weft.strategies import datasets
    from weft.strategies.conversation import load_processor

    _, processor = model_config(recipe)
    tokenizer, image_processor = load_processor(processor)
    if recipe.data.source == "synthetic":
        return tokenizer, datasets.synthetic_samples(
            seed=recipe.train.seed, num_samples=recipe.data.num_samples, min_side=recipe.data.min_side,
            max_side=recipe.data.max_side, tokenizer=tokenizer, image_processor=image_processor,
        )
    path = pathlib.Path(recipe.data.path)
    if not path.is_absolute():
        path = pathlib.Path(recipe.source).parent / path
    if not path.is_file():
        raise WeftError(f"data.path {str(path)!r} does not exist", where=recipe.source)
    from weft.strategies.preprocess import default_workers

    workers = default_workers() if recipe.data.workers == -1 else recipe.data.workers
    cache = path.with_name(path.name + ".weft-cache") if recipe.data.cache else None
    return tokenizer, datasets.jsonl_samples(path, processor=processor, workers=workers, cache_dir=cache)


def _steps(params, recipe, plan, mesh, model, ctx, split, keep_vision=False):
    from weft.strategies import datasets
    from weft.strategies.conversation import collate
    from weft.strategies.token_budget import pack_micro_batches, schedule_steps

    tokenizer, source = sample_source(recipe)

    def on_bad(bad):
        if recipe.data.strict:
            raise WeftError(f"bad sample ({bad.reason}); data.strict = true stops the run", where=bad.where)
        ctx.count("skipped_samples")
        ctx.log.warning("data.skipped", where=bad.where, reason=bad.reason)

    import torch.distributed as dist

    shared_cache = recipe.data.source == "jsonl" and recipe.data.cache and dist.is_initialized() and dist.get_world_size() > 1
    if shared_cache:
        # Rank 0 preprocesses and fills the cache; the others then read it. Preprocessing a
        # large dataset outlasts the run's collective timeout, so this waits on a CPU group
        # of its own with a long one.
        import datetime

        waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=12))
        if dist.get_rank() != 0:
            dist.barrier(group=waiting)
    samples = datasets.collect(source, on_bad=on_bad)
    if shared_cache and dist.get_rank() == 0:
        dist.barrier(group=waiting)
    budget = recipe.train.micro_batch_tokens
    limit = min(budget, recipe.train.seq_len)
    if params.over_long == "truncate":
        samples = _truncate(samples, limit=limit - (split.multiple if split else 1) + 1, tokenizer=tokenizer, ctx=ctx, on_bad=on_bad)
    # Over-long samples get a length past the budget, so packing leaves them out.
    lengths = [s.num_tokens if s.num_tokens <= limit else budget + 1 for s in samples]
    too_long = sum(1 for n in lengths if n > budget)
    if too_long:
        ctx.count("skipped_samples", too_long)
        ctx.log.warning("data.too_long", samples=too_long, micro_batch_tokens=budget, max_seq_len=recipe.train.seq_len)
    pad_id = tokenizer.pad_token_id
    me = mesh.dp_rank()
    multiple = split.multiple if split else 1
    if params.pack:
        from weft.strategies.packing import collate_packed, pack_documents

        positions = document_positions(model)

        def make(indices):
            return collate_packed([samples[i] for i in indices], pad_id=pad_id, pad_to_multiple_of=multiple, positions=positions)
    else:

        def make(indices):
            return collate([samples[i] for i in indices], pad_id=pad_id, pad_to_multiple_of=multiple)

    step = 0
    epoch = 0
    while True:
        if params.pack:
            batches = pack_documents(lengths, budget=budget, seed=recipe.train.seed, epoch=epoch)
        else:
            batches = pack_micro_batches(lengths, budget=budget, seed=recipe.train.seed, epoch=epoch, bucket_size=params.bucket_size)
        steps = schedule_steps(batches, lengths, dp_size=plan.mesh.dp, step_tokens=recipe.train.step_tokens, packed=params.pack)
        if not steps:
            raise WeftError(
                f"the data gives no full step: {len(samples)} usable samples make {len(batches)} micro-batches "
                f"for {plan.mesh.dp} data-parallel ranks; add samples or lower train.step_tokens",
                where=recipe.source,
            )
        for rounds in steps:
            if step >= ctx.start_step:
                micro = [make(round_[me]) for round_ in rounds]
                if keep_vision:
                    import torch

                    from weft.plugins.models.vision_sync import FLAG

                    for batch, round_ in zip(micro, rounds):
                        # Every rank sees the whole round: if any rank has images, all run the tower.
                        if "pixel_values" not in batch and any(samples[i].pixel_values is not None for part in round_ for i in part):
                            batch[FLAG] = torch.ones((), dtype=torch.bool)
                yield [shard_batch(b, split) for b in micro] if split else micro
            step += 1
        epoch += 1
        ctx.log.info("data.epoch", epoch=epoch)


def describe_positions(recipe, plan, model) -> dict:
    """For `weft plan --positions`: every sample of the recipe's data as a run would feed
    it (over-long ones truncated or left out, as the batching rule says), and the
    largest position id each reaches through the model's own rope index (3-D mRoPE for
    vision-language models; packed documents restart at 0, so a sample's own ids are
    what the decoder sees). ``model`` may be on the meta device."""
    from weft.plugins.models.build import trained_context
    from weft.strategies.conversation import truncate_sample
    from weft.strategies.datasets import BadSample
    from weft.strategies.yarn import needed_factor

    params = plan.decision("batching").params
    limit = min(recipe.train.micro_batch_tokens, recipe.train.seq_len)
    tokenizer, source = sample_source(recipe)
    positions = document_positions(model)
    tokens, largest = [], []
    bad = dropped = 0
    for sample in source:
        if isinstance(sample, BadSample):
            bad += 1
            continue
        if sample.num_tokens > limit:
            if getattr(params, "over_long", "drop") != "truncate":
                dropped += 1
                continue
            try:
                sample = truncate_sample(sample, limit, tokenizer=tokenizer)
            except ValueError:
                bad += 1
                continue
        tokens.append(sample.num_tokens)
        largest.append(int(positions(sample).max()))
    context, trained = trained_context(model.config, original=recipe.model.rope_original_max)
    top = max(largest, default=-1)
    return {
        "samples": len(largest), "bad": bad, "dropped_over_long": dropped,
        "max_tokens": max(tokens, default=0), "largest_position": top,
        "p50_position": sorted(largest)[len(largest) // 2] if largest else -1,
        "context": context, "trained_positions": trained,
        "needed_factor": needed_factor(top, trained=trained) if top >= 0 else 1.0,
        "beyond_context": sum(1 for x in largest if x >= context),
    }


def describe_vision_split(recipe, plan) -> list[dict]:
    """For `weft plan`: which SP rank runs which images of the first step, and how.

    Uses the same first samples as `weft check` (two per data-parallel rank) and the
    same assignment the vision hooks make at run time.
    """
    from weft.core.check import check_batch
    from weft.plugins.attention import vision_share_threshold
    from weft.strategies.sequence_split import assign_images

    if plan.mesh.sp == 1:
        return []
    threshold = vision_share_threshold(plan)
    rows = []
    for dp_rank, batch in enumerate(check_batch(recipe, dp=plan.mesh.dp, multiple=1)):
        if "image_grid_thw" not in batch:
            continue
        grid = batch["image_grid_thw"].tolist()
        patches = [t * h * w for t, h, w in grid]
        shared = threshold is not None and max(patches) >= threshold
        owned = [list(range(len(grid)))] * plan.mesh.sp if shared else assign_images(patches, plan.mesh.sp)
        for sp_rank, images in enumerate(owned):
            rows.append({
                "dp_rank": dp_rank,
                "sp_rank": sp_rank,
                "images": [{"index": i, "grid_thw": grid[i], "patches": patches[i]} for i in images],
                "vision": f"vision_ulysses: all SP ranks share every image's patches (an image has >= {threshold})" if shared else "own images, whole (tower run locally)",
            })
    return rows


def document_positions(model):
    """positions(sample) for packing: each document's own position ids, restarting at 0.

    Vision-language models: the model's own 3-D mRoPE rope-index function on the
    document alone; text models: 0..L-1.
    """
    import inspect

    import torch

    finder = next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)
    params = set(inspect.signature(finder.get_rope_index).parameters) if finder is not None else set()

    def positions(sample):
        if finder is None or sample.image_grid_thw is None:
            n = sample.num_tokens
            base = torch.arange(n)[None]  # (1, L)
            return base if finder is None else base.expand(3, 1, n)  # text-only document in a VL model
        kwargs = {"input_ids": sample.input_ids[None], "image_grid_thw": sample.image_grid_thw,
                  "mm_token_type_ids": sample.mm_token_type_ids[None], "attention_mask": torch.ones_like(sample.input_ids)[None]}
        position_ids, _ = finder.get_rope_index(**{k: v for k, v in kwargs.items() if k in params})
        return position_ids  # (3, 1, L)

    return positions
