"""What `weft plan` shows of the built-in batching's data: the first step's images per
sequence-parallel rank, and (``--positions``) the largest position id of every sample."""

from __future__ import annotations


def describe_positions(recipe, plan, model, family) -> dict:
    """Every sample of the recipe's data as a run would feed it (over-long ones truncated
    or left out, as the batching rule says), and the largest position id each reaches
    through the model's own rope index (3-D mRoPE for vision-language models; packed
    documents restart at 0, so a sample's own ids are what the decoder sees).
    ``model`` may be on the meta device."""
    from weft.plugins.batching.samples import sample_source
    from weft.plugins.models.build import trained_context
    from weft.strategies.data.conversation import truncate_sample
    from weft.strategies.data.datasets import BadSample
    from weft.strategies.model.yarn import needed_factor

    params = plan.decision("batching").params
    limit = min(recipe.train.micro_batch_tokens, recipe.train.seq_len)
    tokenizer, source = sample_source(recipe, family)
    positions = family.positions(model)
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


def describe_vision_split(recipe, plan, family) -> list[dict]:
    """Which SP rank runs which images of the data's first samples (two per
    data-parallel rank), and how: the assignment the vision hooks make at run time."""
    from weft.plugins.batching.samples import sample_source
    from weft.strategies.data.datasets import BadSample
    from weft.strategies.sequence.model_split import assign_images

    if plan.mesh.sp == 1:
        return []
    _, source = sample_source(recipe, family)
    samples = []
    for sample in source:
        if not isinstance(sample, BadSample):
            samples.append(sample)
        if len(samples) == 2 * plan.mesh.dp:
            break
    threshold = plan.vision_share_threshold()
    rows = []
    for dp_rank in range(plan.mesh.dp):
        grids = [s.image_grid_thw for s in samples[dp_rank :: plan.mesh.dp] if s.image_grid_thw is not None]
        if not grids:
            continue
        grid = [row for g in grids for row in g.tolist()]
        patches = [t * h * w for t, h, w in grid]
        shared = threshold is not None and max(patches) >= threshold
        owned = [list(range(len(grid)))] * plan.mesh.sp if shared else assign_images(patches, plan.mesh.sp)
        for sp_rank, images in enumerate(owned):
            rows.append({
                "dp_rank": dp_rank,
                "sp_rank": sp_rank,
                "images": [{"index": i, "grid_thw": grid[i], "patches": patches[i]} for i in images],
                "vision": (f"vision_ulysses: all SP ranks share every image's patches (an image has >= {threshold})"
                           if shared else "own images, whole (tower run locally)"),
            })
    return rows
