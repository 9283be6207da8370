"""The decoding step and its loops, shared by `weft generate`'s one prompt and its batches:
one step through the model into the cache, greedy decoding with the token kept on the
device, the text shown as it comes, the stop tokens, the cache's bytes, the text model's
attention switched to the cache's."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from weft.core.train.attention_install import set_attention_names

#: Greedy tokens read back to the host (stop check, streaming) every this many steps.
READ_EVERY = 16


def printer(*, decode):
    """``show(token)``: prints the text each new token adds (decoded whole: a token may
    complete a multi-byte character)."""
    tokens: list[int] = []
    shown = ""

    def show(token: int) -> None:
        nonlocal shown
        tokens.append(token)
        text = decode(tokens)
        print(text[len(shown):], end="", flush=True)
        shown = text

    return show


def streaming(choose, *, show):
    """``choose``, showing each token it chooses."""

    def streamed(logits: torch.Tensor) -> int:
        token = choose(logits)
        show(token)
        return token

    return streamed


def decode_step(model: torch.nn.Module, *, cache, token: torch.Tensor, position: int,
                cache_position: torch.Tensor):
    """One decoding step: ``token`` (1, 1) at ``position`` through the model into ``cache``."""
    if hasattr(cache, "at"):  # a preallocated cache: where this token's row goes
        cache.at(position, device=token.device)
    # No attention mask: positions then follow the cache's (global) length, as transformers'
    # generate slices them.
    return model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1,
                 cache_position=cache_position)


def decode_greedy(model: torch.nn.Module, *, cache, tokens: list[int], logprobs: list[float], length: int,
                  max_new_tokens: int, stops: set[int], device: torch.device, show) -> None:
    """Greedy decoding with the chosen token kept on the device: each step's input is the
    previous step's argmax (broadcast from rank 0) and its position a device counter, so the
    host never waits for a token before launching the next step; the tokens come back every
    ``READ_EVERY`` steps, where the stop tokens are looked for (steps past a stop are
    computed and dropped). The same tokens and log-probabilities as choosing on the host."""
    if tokens[-1] in stops or len(tokens) >= max_new_tokens:
        return
    current = torch.tensor([[tokens[-1]]], device=device)  # (1, 1)
    cache_position = torch.tensor([length], device=device)  # the first decoded token's position
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(len(tokens), max_new_tokens):
        output = decode_step(model, cache=cache, token=current, position=length + step - 1,
                             cache_position=cache_position)
        logits = output.logits[:, -1].float()  # (1, V)
        chosen = logits.argmax(dim=-1)  # (1,)
        dist.broadcast(chosen, src=0)
        pending.append((chosen, torch.log_softmax(logits.double(), dim=-1).gather(1, chosen[:, None])[:, 0]))
        current, cache_position = chosen[:, None], cache_position + 1
        if len(pending) == READ_EVERY or step == max_new_tokens - 1:
            ids = torch.cat([t for t, _ in pending]).tolist()
            values = torch.cat([v for _, v in pending]).tolist()
            pending.clear()
            for token, value in zip(ids, values):
                tokens.append(int(token))
                logprobs.append(float(value))
                if show is not None:
                    show(int(token))
                if token in stops:
                    return


def stop_tokens(model: torch.nn.Module) -> set[int]:
    """The ids that end an answer: the model's generation config's end-of-sequence ids."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def cache_bytes(cache) -> int:
    """This rank's cached keys and values (any transformers cache of per-layer tensors; a
    paged cache's vision pool and text pages as allocated)."""
    if hasattr(cache, "partition_bytes"):
        parts = cache.partition_bytes()
        return parts["vision"] + parts["text_capacity"]
    return int(sum(t.numel() * t.element_size() for layer in getattr(cache, "layers", [])
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None))


def weight_bytes(model: torch.nn.Module, *, skip: list[torch.nn.Module]) -> int:
    """Bytes of this rank's parameters a decoding step reads: all but those under ``skip`` (the
    vision tower, the input embedding, of which a step reads one row) unless the output head
    shares them (tied embeddings: the head reads the whole matrix)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = {id(head.weight)} if head is not None else set()
    skipped = {id(p) for m in skip if m is not None for p in m.parameters()} - kept
    # An FSDP2 parameter counts its local shard (a DTensor's numel is the whole tensor's).
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters() if id(p) not in skipped]
    return int(sum(t.numel() * t.element_size() for t in local))


def compile_step(cache, *, device: torch.device, model: torch.nn.Module) -> bool:
    """Whether the decoding step over ``cache`` runs through torch.compile (the one place this is
    decided): where the cache asks (the static cache's ``compile_step``, its default), on CUDA,
    where the fused kernels pay for the compilation (seconds at the first token; the CPU decodes
    eagerly), on one process (ranks choose each token together) and with no FSDP2 module
    (its hooks gather weights inside the forward: breaks the trace would go around)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (bool(getattr(cache, "compile_step", False)) and device.type == "cuda" and world == 1
            and not sharded_by_fsdp(model))


def sharded_by_fsdp(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards any of ``model``'s modules (its hooks gather weights in the forward:
    no graph to capture, and graph breaks a compiled step would trace around)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def steady(decode_s: float, steps: int, *, first_s: float | None, capture_s: float | None = None
           ) -> tuple[float, int]:
    """The decoding seconds and steps a token's cost is reckoned over: without the first step
    where the step timed it apart (``first_step_s``: torch.compile's compilation, the attention
    kernel's JIT, one-time set-up) and without the graph's capture (``graph_capture_s``: it
    records the step without running it, the replay after it makes that token), neither of
    which is a token's cost; both are reported apart. The host's set-up before the first step
    (``decode_setup_s``) the callers leave out of ``decode_s`` themselves."""
    decode_s -= capture_s or 0.0
    if first_s is None or steps < 2:
        return decode_s, steps
    return decode_s - first_s, steps - 1


def text_attention(model: torch.nn.Module, name: str) -> None:
    """Decode the text model with ``name``; the vision tower keeps its own."""
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        set_attention_names(model, name)
    else:
        set_attention_names(model, {"text_config": name, "vision_config": vision._attn_implementation})


def prompt_sample(inputs: dict) -> Any:
    """The prompt's tensors as the family's ``positions`` reads a sample (B = 1 dropped)."""
    ids = inputs["input_ids"][0]
    return types.SimpleNamespace(
        input_ids=ids, num_tokens=int(ids.shape[0]), image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"), second_per_grid_ts=inputs.get("second_per_grid_ts"),
        mm_token_type_ids=inputs.get("mm_token_type_ids", torch.zeros_like(inputs["input_ids"]))[0])


def next_rotary(inputs: dict, *, positions_of) -> torch.Tensor:
    """The rotary position ids of the first token after the prompt ``inputs``, (3, 1, 1) for
    mRoPE or (1, 1): the prompt's largest plus one (the data's own ids where it gives them,
    else the model's rope index, ``positions_of``), as transformers' generate numbers it."""
    ids = inputs.get("position_ids")
    if ids is None:
        ids = positions_of(prompt_sample(inputs))
    return torch.full((*ids.shape[:-1], 1), int(ids.max()) + 1, dtype=torch.long)


def layer_index_dynamic():
    """Around a prefill: the attention modules' ``layer_idx`` (an int attribute, which torch.compile
    holds constant) traced as a dynamic int, so a rule's compiled attention is compiled twice
    (the first layer, then every other one), not once a layer until torch's recompile limit
    leaves the rest eager. The caches keep their update out of the trace (``StaticCache.update``),
    where the index would pick a layer object and guard on it again."""
    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)
