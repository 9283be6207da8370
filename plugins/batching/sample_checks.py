"""What a run leaves of its samples before batching them: over-long ones cut (or counted and
dropped) and those whose image/video tokens do not match their grids named and passed on.
A store's samples stay on disk: only the token counts, ids and grids are read."""

from __future__ import annotations


def truncate(samples, *, limit, tokenizer, ctx, on_bad):
    """Samples longer than ``limit`` keep their head (never cutting an image span). Only the
    over-long ones are read (the token counts say which): a store's samples stay on disk."""
    from weft.strategies.data.conversation import truncate_sample
    from weft.strategies.data.datasets import BadSample
    from weft.strategies.data.shards import SampleView, token_counts

    kept, overlay = [], {}
    for index, count in enumerate(token_counts(samples)):
        if count <= limit:
            kept.append(index)
            continue
        if tokenizer is None:
            on_bad(BadSample(f"sample {index}", "too long, and no tokenizer to find its image spans for a cut"))
            continue
        if samples[index].pair_split is not None:
            on_bad(BadSample(f"sample {index}", "a preference pair longer than the limit: not cut (a cut response "
                                                 "is another response)"))
            continue
        try:
            overlay[index] = truncate_sample(samples[index], limit, tokenizer=tokenizer)
            kept.append(index)
            ctx.count("truncated_samples")
        except ValueError as error:
            on_bad(BadSample(f"sample {index}", str(error)))
    if isinstance(samples, list):
        return [overlay.get(i, samples[i]) for i in kept]  # in memory already: a list, as it came
    return SampleView(samples, kept, overlay)  # a store, a view or a mixture: read when batched


def check_vision(samples, *, config, ctx, on_bad):
    """Samples whose image and video tokens match their grids; the others named and passed to
    ``on_bad``. Logs the share of image and video tokens (a dataset whose ratio drops to 0 lost
    its images). A store's samples are checked once, from their token ids and grids alone (not
    their pixels), the answer kept beside its shards for the next run."""
    from weft.strategies.data.datasets import BadSample
    from weft.strategies.data.shards import SampleStore, SampleView, remembered
    from weft.strategies.data.vision_integrity import vision_mismatch

    token = getattr(config, "image_token_id", None)
    vision = getattr(config, "vision_config", None)
    if token is None or vision is None:
        return samples  # a text model
    video_token = getattr(config, "video_token_id", None)
    merge = getattr(vision, "spatial_merge_size", 2)
    fields = ("input_ids", "image_grid_thw", "video_grid_thw")
    read = ((lambda i: samples.fields(i, fields)) if isinstance(samples, SampleStore)
            else (lambda i: {name: getattr(samples[i], name) for name in fields}))

    def check() -> dict:
        bad, image_tokens, tokens = [], 0, 0
        for index in range(len(samples)):
            sample = read(index)
            ids = sample["input_ids"]
            reason = vision_mismatch(ids, sample.get("image_grid_thw"), image_token_id=token, merge_size=merge)
            if reason is None and video_token is not None:
                reason = vision_mismatch(ids, sample.get("video_grid_thw"), image_token_id=video_token,
                                         merge_size=merge, kind="video")
            if reason is not None:
                bad.append([index, reason])
                continue
            image_tokens += int((ids == token).sum())
            image_tokens += int((ids == video_token).sum()) if video_token is not None else 0
            tokens += int(ids.numel())
        return {"bad": bad, "image_tokens": image_tokens, "tokens": tokens}

    if isinstance(samples, SampleStore):
        found = remembered(samples, f"vision-{token}-{video_token}-{merge}", check)
    else:
        found = check()
    refused = {index for index, _ in found["bad"]}
    for index, reason in found["bad"]:
        on_bad(BadSample(f"sample {index}", f"vision integrity: {reason}"))
    ctx.log.info("data.vision", samples=len(samples) - len(refused),
                 image_token_ratio=round(found["image_tokens"] / max(found["tokens"], 1), 4))
    if not refused:
        return samples  # as they came: a million-sample store needs no view of all its indices
    kept = [i for i in range(len(samples)) if i not in refused]
    if isinstance(samples, (SampleStore, SampleView)):
        return SampleView(samples, kept)
    return [samples[i] for i in kept]
