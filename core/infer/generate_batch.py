"""`weft generate --prompt-file` / `--prompt-from-data N`: several prompts decoded together,
greedily, on one process.

Each prompt is prefilled alone, through the plan's own attention, into its row of one
preallocated cache (the ``static`` cache: (B, Hkv, capacity, D) per layer, capacity the
longest prompt plus the new tokens); then every decoding step runs the B rows at once: one
token per row at that row's own position (the rows past it masked), the rotary position of
each row's next token the prompt's largest position plus one (mRoPE: the model's own rope
index over the prompt), kept on the device. A row that has stopped keeps decoding until all
have (its tokens after the stop are dropped). Greedy only: the answers are the ones each
prompt gets alone (tests/test_generate.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from weft.core.errors import WeftError
from weft.core.infer.decode import (
    READ_EVERY,
    cache_bytes,
    compile_step,
    layer_index_dynamic,
    prompt_sample,
    steady,
    stop_tokens,
    text_attention,
)
from weft.core.infer.decode_graph import decode_rows_buffered
from weft.core.infer.prefill_chunks import prefill_chunk_for, prefill_in_chunks
from weft.core.infer.sampling import Sampling, choose_now
from weft.core.recipe import Recipe

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe.rule_engine import Decision, Plan
    from weft.core.train.prepare import Prepared


def _batched_cache(plan: Plan, pm: WeftPluginManager) -> Decision:
    """The kv_cache decision of a batch of prompts: a cache that keeps rows of different lengths,
    each written at its own position (a strategy whose record says ``batched_prompts``: the
    built-in ``static``), whatever the rules say: the rule's own where it is one (its kernel too),
    else the first such strategy with its defaults."""
    from weft.core.recipe.rule_engine import Decision

    ruled = [m.get("kv_cache") for m in plan.modules_for("kv_cache") if m.info.modality == "text"]
    if ruled and (record := plan.strategy(ruled[0])) is not None and record.batched_prompts:
        return ruled[0]
    record = next((s for s in pm.registry.all() if s.point == "kv_cache" and s.batched_prompts), None)
    if record is None:
        raise WeftError("several prompts decode together in a cache that keeps rows of different lengths, and no "
                        "kv_cache strategy declares one (batched_prompts); give one prompt at a time")
    return Decision(point="kv_cache", strategy=record.name, params=record.params(),
                    source="weft generate (several prompts)", rule="several prompts decode together in one cache")


def generate_batch(model: torch.nn.Module, *, run: Prepared, ctx: RunContext, pm: WeftPluginManager, recipe: Recipe,
                   inputs: list[dict], max_new_tokens: int, autocast: Any, cuda_graph: bool = True,
                   sampling: Sampling | None = None, warmup: bool = False,
                   profiled: Any = contextlib.nullcontext) -> dict:
    """``inputs``: each prompt's model inputs (B = 1), as ``prompt_inputs`` or the data give them;
    ``cuda_graph``: the rows' step replayed as a CUDA graph where it can be; ``sampling``: every
    token (the prompts' first ones too) drawn on the device from its generator, else greedy;
    ``warmup``: the first prompt prefilled once untimed (compiled units compile there);
    ``profiled``: a context the decoding steps run in (``--profile``: core/infer/decode_profile.py)."""
    device = ctx.device
    lengths = [int(x["input_ids"].shape[1]) for x in inputs]
    positions_of = ctx.family.positions(model)
    # The next text position after each prompt: its largest rotary position plus one.
    starts = [int(positions_of(prompt_sample(x)).max()) + 1 for x in inputs]
    stops = stop_tokens(model)
    cache = pm.kv_cache(decision=_batched_cache(run.plan, pm), model=model, plan=run.plan, mesh=run.mesh, ctx=ctx)
    chunk = prefill_chunk_for(cache.prefill_chunk, model=model, prompt=max(lengths), device=device,
                              cached_tokens=len(inputs) * (max(lengths) + max_new_tokens),
                              precision=recipe.train.precision)
    cache.reserve(max(lengths) + max_new_tokens, rows=len(inputs))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    chunks = [1] * len(inputs)  # each prompt's prefill forwards

    def prefill(row: int) -> torch.Tensor:
        """Prompt ``row`` into its row of the cache (in chunks where the cache asks); its last
        token's logits (1, V), float64."""
        with layer_index_dynamic():
            if chunk and lengths[row] > chunk:
                logits, chunks[row] = prefill_in_chunks(model, inputs=inputs[row], cache=cache, device=device, row=row,
                                                        chunk=chunk, positions_of=ctx.family.positions(model))
                return logits.double()
            cache.begin_prefill(keep=None, prompt=lengths[row], row=row)
            output = model(**{k: v.to(device) for k, v in inputs[row].items()}, past_key_values=cache,
                           use_cache=True, logits_to_keep=1)
        return output.logits[:, -1].double()

    if warmup:  # untimed; row 0 is written again below
        with torch.no_grad(), autocast:
            prefill(0)
        sync()
    start = time.perf_counter()
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    with torch.no_grad(), autocast:
        for row in range(len(inputs)):
            logits = prefill(row)
            chosen = int(choose_now(logits, sampling=sampling)[0])
            tokens.append([chosen])
            logprobs.append([float(torch.log_softmax(logits, dim=-1)[0, chosen])])
        sync()
        prefill_s = time.perf_counter() - start
        cache.begin_decode()
        text_attention(model, cache.decode_attention)
        rotary = torch.tensor(starts)[:, None]  # (B, 1): each row's next rotary position
        setup_s = time.perf_counter() - start - prefill_s  # host set-up between the prefill and the steps
        # Units a rule compiles run eagerly while decoding (see generate_one.py); the rows' step from
        # device buffers, captured as a CUDA graph where it can be (core/infer/decode_graph.py).
        with torch.compiler.set_stance("force_eager"), profiled() as profiling:
            graph = decode_rows_buffered(model, cache=cache, tokens=tokens, logprobs=logprobs, rows=lengths,
                                         rotary=rotary, max_new_tokens=max_new_tokens, stops=stops, device=device,
                                         show=None, capture=cuda_graph, read_every=READ_EVERY, sampling=sampling,
                                         compile=compile_step(cache, device=device, model=model))
            profiling["steps"] = graph["decode_steps"]  # the steps run: every row may stop early
        sync()
    decode_wall_s = time.perf_counter() - start - prefill_s
    decode_s, counted = steady(decode_wall_s - setup_s, graph["decode_steps"],
                               first_s=graph.get("first_step_s"), capture_s=graph.get("graph_capture_s"))
    new = sum(len(t) - 1 for t in tokens)
    if counted < graph["decode_steps"]:  # the first step set apart: its tokens (one a decoded row) with it
        new -= sum(len(t) > 1 for t in tokens)
    return {
        "answers": [{"tokens": t, "logprobs": lp, "text": ctx.family.decode_tokens(recipe, t)}
                    for t, lp in zip(tokens, logprobs)],
        "prompt_tokens": lengths, "prefill_s": prefill_s, "prefill_tokens_per_s": sum(lengths) / max(prefill_s, 1e-9),
        "prefill_chunks": chunks,
        "decode_ms_per_step": 1e3 * decode_s / max(counted, 1),
        "decode_tokens_per_s": new / max(decode_s, 1e-9), "decode_setup_s": setup_s, "decode_wall_s": decode_wall_s,
        "cache": type(cache).__name__,
        "cache_bytes_per_rank": [cache_bytes(cache)], "world_size": 1, **graph,
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }

