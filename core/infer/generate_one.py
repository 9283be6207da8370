"""Greedy or sampled decoding under the recipe's plan, on each rank of `weft generate`.

The prompt (the family's encoding of one user turn) is prefilled by the plan's own
forward: its sharding, its sequence-parallel attention, its precision. The KV cache comes
from ``weft_kv_cache`` (the text decoder's ``kv_cache`` rule): under sequence parallelism
the default is the ``sharded`` cache, where each rank keeps its part of the prompt's keys
and values. Then the sequence split's hooks come off, and every rank runs the model on
each new token, the text attention merging the ranks' partial results by log-sum-exp.
All ranks choose the same token (one generator, seeded, on every rank; rank 0's choice is
broadcast so no rounding difference can split them).
"""

from __future__ import annotations

import functools
import pathlib
import time
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.infer.decode import (
    READ_EVERY,
    cache_bytes,
    compile_step,
    decode_greedy,
    decode_step,
    layer_index_dynamic,
    next_rotary,
    printer,
    steady,
    stop_tokens,
    streaming,
    text_attention,
    weight_bytes,
)
from weft.core.infer.decode_graph import decode_buffered
from weft.core.infer.decode_profile import decode_profile
from weft.core.infer.prefill_chunks import prefill_chunk_for, prefill_in_chunks
from weft.core.infer.sampling import Sampling, choose_now
from weft.core.recipe import Recipe

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.train.prepare import Prepared


def generate_on_rank(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
                     prompt: str | None, images: list[str], videos: list[str], max_new_tokens: int,
                     temperature: float, top_p: float, seed: int, run_dir: pathlib.Path | None, step: int | None,
                     stream: bool = False, warmup: bool = False, adapter_dir: str | None = None,
                     prompts: list[dict] | None = None, from_data: int = 1, cuda_graph: bool = True,
                     profile: str | None = None, fused_projections: bool = True) -> dict:
    """One rank's part of `weft generate` (inside its process group): the prompt (or prompts)
    prefilled and decoded; rank 0's result is the command's."""
    from weft.core.infer.prepare_inference import prepare_inference
    from weft.core.train.step import autocast_for

    pm, ctx, run, checkpoint = prepare_inference(recipe, rank=rank, world_size=world_size, local_rank=local_rank,
                                                 device_type=device_type, run_dir=run_dir, step=step,
                                                 adapter_dir=adapter_dir)
    model, device = run.model, ctx.device
    # Each layer's q/k/v and gate/up as one product over one storage (the family's fuse_projections):
    # a decoding step reads the same weights in fewer kernels. Plain nn.Linear siblings only.
    fused_groups = ctx.family.fuse_projections(model) if fused_projections else 0
    if run.fused is not None:  # no loss here: its hook would hold the prefill's last hidden states (1 GB at 128K)
        run.fused.handle.remove()
    # Sampling on the device (the buffered step, a batch): draws from a generator seeded there.
    sampling = None if temperature <= 0 else Sampling(temperature=temperature, top_p=top_p,
                                                      generator=torch.Generator(device=device).manual_seed(seed))
    profiled = functools.partial(decode_profile, pathlib.Path(profile) if profile and rank == 0 else None,
                                 steps=max_new_tokens - 1)
    if prompts is not None or from_data > 1:
        from weft.core.infer.generate_batch import generate_batch

        batch = ([ctx.family.prompt_inputs(recipe, text=p["prompt"], images=p.get("images", []),
                                            videos=p.get("videos", [])) for p in prompts] if prompts is not None
                 else _prompts_from_data(recipe, run=run, pm=pm, ctx=ctx, count=from_data))
        return dict(generate_batch(model, run=run, ctx=ctx, pm=pm, recipe=recipe, inputs=batch,
                                   max_new_tokens=max_new_tokens, cuda_graph=cuda_graph, sampling=sampling,
                                   warmup=warmup, profiled=profiled,
                                   autocast=autocast_for(recipe.train.precision, device_type)),
                    checkpoint=checkpoint, fused_projection_groups=fused_groups)
    inputs = (ctx.family.prompt_inputs(recipe, text=prompt, images=images, videos=videos) if prompt is not None
              else _prompt_from_data(recipe, run=run, pm=pm, ctx=ctx))
    length = inputs["input_ids"].shape[1]
    positions_of = ctx.family.positions(model)  # the prompt's rotary positions (mRoPE: the model's rope index)
    text_rules = [m.get("kv_cache") for m in run.plan.modules_for("kv_cache") if m.info.modality == "text"]
    choose = _chooser(sampling)
    show = (printer(decode=lambda ids: ctx.family.decode_tokens(recipe, ids)) if stream and rank == 0
            else None)  # rank 0's stdout is the terminal's: the text as it comes
    if show is not None:
        choose = streaming(choose, show=show)
    stops = stop_tokens(model)
    autocast = autocast_for(recipe.train.precision, device_type)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    new_cache = functools.partial(pm.kv_cache, decision=text_rules[0], model=model, plan=run.plan, mesh=run.mesh,
                                  ctx=ctx)
    cache = new_cache()
    # Whole or in chunks (the rule's, or auto: where memory needs it), decided before anything is
    # allocated, so that the untimed first prefill runs as the timed one.
    chunk = prefill_chunk_for(getattr(cache, "prefill_chunk", 0), model=model, prompt=length,
                              cached_tokens=length + max_new_tokens, device=device,
                              precision=recipe.train.precision)
    if warmup:  # one untimed prefill first: compiled modules compile there, not in the figure
        with torch.no_grad(), autocast:
            _prefill(model, run=run, inputs=inputs, cache=new_cache(), device=device, positions_of=positions_of,
                     chunk=chunk)
    if hasattr(cache, "reserve"):  # a preallocated cache: the prompt and every token to come
        cache.reserve(length + max_new_tokens)
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad(), autocast:
        logits, chunks = _prefill(model, run=run, inputs=inputs, cache=cache, device=device,
                                  positions_of=positions_of, chunk=chunk)
        tokens, logprobs = [], []
        _pick(choose, logits, tokens, logprobs)
        sync()
        prefill_s = time.perf_counter() - start
        if run.split is not None:
            run.split.remove()  # every rank now runs the whole (one-token) sequence
        if hasattr(cache, "begin_decode"):
            cache.begin_decode()
        # Decoding attends from one query to the whole cache: the cache's own attention, or
        # transformers' SDPA over a whole-sequence cache (weft's training kernels take
        # equal query and key lengths).
        text_attention(model, getattr(cache, "decode_attention", None) or "sdpa")
        # Units a rule compiles (for training and the prefill) run eagerly while decoding:
        # each one-token step would otherwise recompile on the growing cache (its length,
        # each layer's cache object) until torch's recompile limit, seconds a token.
        graph = {"cuda_graph": False, "graph_pool_bytes": 0}
        buffered = getattr(cache, "capturable", False) and (temperature <= 0 or world_size == 1)
        rotary = next_rotary(inputs, positions_of=positions_of) if buffered else None
        setup_s = time.perf_counter() - start - prefill_s  # host set-up between the prefill and the steps
        with torch.compiler.set_stance("force_eager"), profiled() as profiling:
            if buffered:
                # A cache read in place from device positions: the step from device buffers,
                # captured as a CUDA graph where it can be (core/infer/decode_graph.py),
                # sampling (one process) on the device.
                graph = decode_buffered(
                    model, cache=cache, tokens=tokens, logprobs=logprobs, row=length, rotary=rotary,
                    max_new_tokens=max_new_tokens, stops=stops, device=device, show=show, capture=cuda_graph,
                    read_every=READ_EVERY, sampling=sampling, compile=compile_step(cache, device=device, model=model))
            elif temperature <= 0:
                decode_greedy(model, cache=cache, tokens=tokens, logprobs=logprobs, length=length,
                              max_new_tokens=max_new_tokens, stops=stops, device=device, show=show)
            while temperature > 0 and len(tokens) < max_new_tokens and tokens[-1] not in stops:
                position = length + len(tokens) - 1
                output = decode_step(model, cache=cache, token=torch.tensor([[tokens[-1]]], device=device),
                                     position=position, cache_position=torch.tensor([position], device=device))
                _pick(choose, output.logits[:, -1].float(), tokens, logprobs)
            profiling["steps"] = graph.get("decode_steps", len(tokens) - 1)  # the steps run: a stop ends them early
        sync()
    decode_wall_s = time.perf_counter() - start - prefill_s
    decode_s, counted = steady(decode_wall_s - setup_s, len(tokens) - 1,
                               first_s=graph.get("first_step_s"), capture_s=graph.get("graph_capture_s"))
    # Each rank's cache bytes, and a paged cache's vision pool and text pages: one gather.
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (cache_bytes(cache), getattr(cache, "partition_bytes", lambda: None)()))
    local_bytes, partitions = [g[0] for g in gathered], [g[1] for g in gathered]
    return {"tokens": tokens, "logprobs": logprobs, "text": ctx.family.decode_tokens(recipe, tokens),
            "prompt_tokens": length, "fused_projection_groups": fused_groups,
            # What a step reads (the bandwidth a token's milliseconds achieve): weights, then the cache.
            "weight_bytes_per_rank": weight_bytes(model, skip=[ctx.family.vision_tower(model),
                                                               model.get_input_embeddings()]),
            "prefill_s": prefill_s, "prefill_tokens_per_s": length / max(prefill_s, 1e-9), "prefill_chunks": chunks,
            "decode_ms_per_token": 1e3 * decode_s / max(counted, 1), "decode_setup_s": setup_s,
            "decode_wall_s": decode_wall_s, "cache": type(cache).__name__,
            "cache_bytes_per_rank": local_bytes, "world_size": world_size, **graph,
            **({"cache_partitions_per_rank": partitions} if partitions[0] is not None else {}),
            "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "checkpoint": checkpoint}


def _prefill(model: torch.nn.Module, *, run: Prepared, inputs: dict, cache, device: torch.device,
             positions_of, chunk: int) -> tuple[torch.Tensor, int]:
    """The prompt through the plan's forward into ``cache`` (in chunks of ``chunk`` tokens where
    it is longer: core/infer/prefill_chunks.py); the last real token's logits (1, V) and the
    forwards' count."""
    from weft.core.train.step import pad_to_multiple

    length = inputs["input_ids"].shape[1]
    if chunk and length > chunk and run.split is None:
        with layer_index_dynamic():
            return prefill_in_chunks(model, inputs=inputs, cache=cache, device=device, chunk=chunk,
                                     positions_of=positions_of)
    batch, keep, last = dict(inputs), None, torch.tensor([length - 1])
    if run.split is not None:
        # The split's multiple: pads at the right end, which causal attention keeps from the
        # real tokens; the cache drops their rows; the last real token's logits come from the
        # rank that holds it.
        batch = pad_to_multiple(batch, multiple=run.split.multiple)
        local = run.split.shard(torch.arange(batch["input_ids"].shape[1])[None], dim=1)[0]  # (S_local,)
        keep = local < length
        last = (local == length - 1).nonzero()[:, 0][:1]
    if hasattr(cache, "begin_prefill"):
        cache.begin_prefill(keep=None if keep is None else keep.to(device), prompt=length,
                            vision=_vision_rows(model, batch["input_ids"][0], run=run).to(device))
    held = torch.tensor(len(last))
    with layer_index_dynamic():
        output = model(**{k: v.to(device) for k, v in batch.items()}, past_key_values=cache, use_cache=True,
                       logits_to_keep=(last if len(last) else torch.tensor([0])).to(device))
    logits = output.logits[:, -1].float() * held.to(device)  # (1, V): zero where the row is not ours
    if run.split is not None:
        dist.all_reduce(logits, group=run.mesh.sp.get_group())
    return logits, 1


def _vision_rows(model: torch.nn.Module, ids: torch.Tensor, *, run: Prepared) -> torch.Tensor:
    """(S_local,) bool: this rank's rows of the (padded) prompt ``ids`` (S,) that are image or
    video tokens, for caches that keep them apart."""
    marks = [getattr(model.config, key, None) for key in ("image_token_id", "video_token_id")]
    rows = torch.isin(ids, torch.tensor([m for m in marks if m is not None], dtype=ids.dtype))
    return rows if run.split is None else run.split.shard(rows[None], dim=1)[0]


def _prompt_from_data(recipe: Recipe, *, run: Prepared, pm: WeftPluginManager,
                      ctx: RunContext) -> dict[str, torch.Tensor]:
    """The first sample of the recipe's own data as the prompt, labels dropped: long
    synthetic prompts (data.tokens, data.images) for models without a bundled tokenizer."""
    return _prompts_from_data(recipe, run=run, pm=pm, ctx=ctx, count=1)[0]


def _prompts_from_data(recipe: Recipe, *, run: Prepared, pm: WeftPluginManager, ctx: RunContext,
                       count: int) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` samples of the recipe's own data as prompts (one a micro-batch)."""
    if run.plan.mesh.dp > 1:
        raise WeftError(f"--prompt-from-data gives every rank one prompt, but the plan has {run.plan.mesh.dp} "
                        "data-parallel groups; set parallel.dp_shard/dp_replicate so that all ranks share the "
                        "sequence (ring/ulysses)", where="--prompt-from-data")
    ctx = attrs.evolve(ctx, one_pass=True)
    steps = pm.batching(decision=run.plan.decision("batching"), recipe=recipe, plan=run.plan, mesh=run.mesh,
                        model=run.model, ctx=ctx)
    found = []
    for micro_batches in steps:
        for batch in micro_batches:
            if batch["input_ids"].shape[0] != 1:
                raise WeftError(f"the data's micro-batches hold {batch['input_ids'].shape[0]} samples; a prompt is "
                                "one: set train.micro_batch_tokens to the sample length (data.tokens)",
                                where="--prompt-from-data")
            found.append({k: v for k, v in batch.items() if k not in ("labels", "shift_labels")})
            if len(found) == count:
                return found
    raise WeftError(f"--prompt-from-data {count}: the data gives {len(found)} prompts", where="--prompt-from-data")


def _pick(choose, logits: torch.Tensor, tokens: list[int], logprobs: list[float]) -> None:
    """Choose the next token; keep its log-probability under the model (before temperature)."""
    token = choose(logits)
    tokens.append(token)
    logprobs.append(float(torch.log_softmax(logits.double(), dim=-1)[0, token]))


def _chooser(sampling: Sampling | None):
    """The next token from (1, V) logits (``choose_now``); rank 0's choice is broadcast."""

    def choose(logits: torch.Tensor) -> int:
        token = choose_now(logits, sampling=sampling).reshape(1)
        dist.broadcast(token, src=0)
        return int(token)

    return choose
