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

import time
from typing import Any

import torch

from weft.core.commands.decode import cache_bytes, prompt_sample, stop_tokens, text_attention
from weft.core.recipe import Recipe


def generate_batch(model: torch.nn.Module, *, run: Any, ctx: Any, pm: Any, recipe: Recipe, inputs: list[dict],
                   max_new_tokens: int, autocast: Any) -> dict:
    """``inputs``: each prompt's model inputs (B = 1), as ``prompt_inputs`` or the data give them."""
    device = ctx.device
    lengths = [int(x["input_ids"].shape[1]) for x in inputs]
    positions_of = ctx.adapter.positions(model)
    # The next text position after each prompt: its largest rotary position plus one.
    starts = [int(positions_of(prompt_sample(x)).max()) + 1 for x in inputs]
    stops = stop_tokens(model)
    # The batch's cache is the kv_cache hook's ``static`` one whatever the rules say: it alone
    # keeps rows of different lengths, each written at its own position.
    from weft.core.recipe.rules import Decision
    from weft.core.registry import NoParams

    static = Decision(point="kv_cache", strategy="static", params=NoParams(), source="weft generate (several prompts)",
                      rule="several prompts decode together in the static cache")
    cache = pm.call_first("weft_kv_cache", decision=static, model=model, plan=run.plan, mesh=run.mesh, ctx=ctx)
    cache.reserve(max(lengths) + max_new_tokens, rows=len(inputs))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    with torch.no_grad(), autocast:
        for row, x in enumerate(inputs):
            cache.begin_prefill(keep=None, prompt=lengths[row], row=row)
            output = model(**{k: v.to(device) for k, v in x.items()}, past_key_values=cache, use_cache=True,
                           logits_to_keep=1)
            logits = output.logits[:, -1].double()  # (1, V)
            chosen = int(logits.argmax(dim=-1))
            tokens.append([chosen])
            logprobs.append([float(torch.log_softmax(logits, dim=-1)[0, chosen])])
        sync()
        prefill_s = time.perf_counter() - start
        cache.begin_decode()
        text_attention(model, cache.decode_attention)
        current = torch.tensor([[t[0]] for t in tokens], device=device)  # (B, 1)
        cache_rows = torch.tensor(lengths, device=device)  # (B,): where each row's next token is written
        rotary = torch.tensor(starts, device=device)[:, None]  # (B, 1): its rotary position
        done = [t[0] in stops for t in tokens]
        steps = 1
        with torch.compiler.set_stance("force_eager"):
            while steps < max_new_tokens and not all(done):
                cache.at(cache_rows, device=device)
                output = model(input_ids=current, past_key_values=cache, use_cache=True, logits_to_keep=1,
                               position_ids=rotary, cache_position=cache_rows[:1])
                logits = output.logits[:, -1].double()  # (B, V)
                chosen = logits.argmax(dim=-1)  # (B,)
                values = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0]
                for row, (token, value) in enumerate(zip(chosen.tolist(), values.tolist())):
                    if not done[row]:
                        tokens[row].append(int(token))
                        logprobs[row].append(float(value))
                        done[row] = token in stops
                current, cache_rows, rotary = chosen[:, None], cache_rows + 1, rotary + 1
                steps += 1
        sync()
    decode_s = time.perf_counter() - start - prefill_s
    new = sum(len(t) - 1 for t in tokens)
    return {
        "answers": [{"tokens": t, "logprobs": lp, "text": ctx.adapter.decode_tokens(recipe, t)}
                    for t, lp in zip(tokens, logprobs)],
        "prompt_tokens": lengths, "prefill_s": prefill_s, "prefill_tokens_per_s": sum(lengths) / max(prefill_s, 1e-9),
        "decode_steps": steps - 1, "decode_ms_per_step": 1e3 * decode_s / max(steps - 1, 1),
        "decode_tokens_per_s": new / max(decode_s, 1e-9), "cache": type(cache).__name__,
        "cache_bytes_per_rank": [cache_bytes(cache)], "world_size": 1,
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }

