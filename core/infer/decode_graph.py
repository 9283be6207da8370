"""Decoding loops over ``DecodeStep`` (core/infer/decode_step.py: the step from device
buffers, compiled and captured as a CUDA graph where it can be): one prompt or B rows
together, the tokens read back every ``read_every`` steps (the stop check), and what keeps a
step from being captured here (``capture_blocker``). weft's eval and generate attach no
recomputation hooks (``ctx.inference``): nothing is recomputed without a backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weft.core.infer.decode import sharded_by_fsdp
from weft.core.infer.decode_step import DecodeStep
from weft.core.infer.sampling import Sampling


def capture_blocker(model: torch.nn.Module, *, cache, device: torch.device, world: int) -> str | None:
    """Why the greedy step of ``model`` over ``cache`` cannot be captured here (None: it can)."""
    if device.type != "cuda":
        return f"decoding on {device.type}"
    if world > 1:
        return f"{world} ranks choose together (a broadcast per token)"
    if not getattr(cache, "capturable", False):
        return f"the {type(cache).__name__} changes shape or host state per token"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(config, "rope_parameters", None) or {}
    kinds = [rope.get("rope_type")] if "rope_type" in rope else [r.get("rope_type") for r in rope.values()
                                                                 if isinstance(r, dict)]
    if any(kind and ("dynamic" in kind or kind == "longrope") for kind in kinds):
        return f"the {'/'.join(k for k in kinds if k)} rotary embedding reads its largest position on the host"
    if sharded_by_fsdp(model):
        return "FSDP gathers and frees the weights in every forward"
    return None


def decode_buffered(model: torch.nn.Module, *, cache, tokens: list[int], logprobs: list[float], row: int,
                    rotary: torch.Tensor, max_new_tokens: int, stops: set[int], device: torch.device,
                    show, capture: bool, read_every: int, sampling: Sampling | None = None,
                    compile: bool = False) -> dict:
    """One prompt through ``decode_rows_buffered``: ``tokens``/``logprobs`` grow in place; ``row``:
    the cache row of the first decoded token (the prompt's length); ``rotary``: its rotary
    position ids ((3, 1, 1) or (1, 1)); ``show`` streams each token read back."""
    return decode_rows_buffered(model, cache=cache, tokens=[tokens], logprobs=[logprobs], rows=[row], rotary=rotary,
                                max_new_tokens=max_new_tokens, stops=stops, device=device, show=show,
                                capture=capture, read_every=read_every, sampling=sampling, compile=compile)


def decode_rows_buffered(model: torch.nn.Module, *, cache, tokens: list[list[int]], logprobs: list[list[float]],
                         rows: list[int], rotary: torch.Tensor, max_new_tokens: int, stops: set[int],
                         device: torch.device, show, capture: bool, read_every: int,
                         sampling: Sampling | None = None, compile: bool = False) -> dict:
    """Decoding of B rows together through one ``DecodeStep`` (greedy, or ``sampling``'s nucleus
    draws on the device): row b's ``tokens[b]`` /
    ``logprobs[b]`` (each holding its first token) grow in place up to ``max_new_tokens`` or a
    stop token; the tokens come back every ``read_every`` steps (the stop check; ``show``, for
    one row, streams them); the step goes on until every row has stopped or the longest may.
    ``rows``: each row's cache row for its first decoded token; ``rotary``: their rotary
    position ids ((3, B, 1) or (B, 1)); ``compile``: the step's body through torch.compile (as
    ``decode.compile_step`` decides: one process, no FSDP2). Returns what the step reports:
    whether its body was compiled (else why not) and the first step's seconds (the
    compilation's), whether a graph was replayed (else why not),
    its pool's bytes, the capture's host seconds, the replays' count and mean GPU ms a token
    (the eager warm-up steps and the capture are not in it)."""
    done = [t[-1] in stops or len(t) >= max_new_tokens for t in tokens]
    blocked = "no step to decode" if all(done) else None
    blocked = blocked or (None if capture else "--no-cuda-graph")
    world = dist.get_world_size() if dist.is_initialized() else 1
    blocked = blocked or capture_blocker(model, cache=cache, device=device, world=world)
    step = None
    if not all(done):
        step = DecodeStep(model, cache=cache, token=torch.tensor([[t[-1]] for t in tokens], device=device),
                          rotary=rotary.to(device), row=torch.tensor(rows, device=device), capture=blocked is None,
                          world=world, sampling=sampling, compile=compile)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index in range(min(len(t) for t in tokens), max_new_tokens):
            pending.append(step())
            if len(pending) < read_every and index < max_new_tokens - 1:
                continue
            ids = torch.stack([t for t, _ in pending]).T.tolist()  # (B, steps)
            values = torch.stack([v for _, v in pending]).T.tolist()
            pending.clear()
            for b in range(len(tokens)):
                if not done[b]:
                    done[b] = _take(ids[b], values[b], tokens=tokens[b], logprobs=logprobs[b], stops=stops,
                                    limit=max_new_tokens, show=show if len(tokens) == 1 else None)
            if all(done):
                break
    steps = {"decode_steps": step.steps if step is not None else 0,  # run, read-back granularity included
             "step_compiled": bool(step is not None and step.compiled)}
    if step is not None and step.first_s is not None:
        steps["first_step_s"] = step.first_s  # one-time work in it: not in decode_ms_per_token
    if step is not None and (step.compiled or step.compile_error):
        steps.update({"step_compile_s": step.first_s, **step.trace_report()} if step.compiled
                     else {"step_compile_off": step.compile_error})
    if step is None or step.graph is None:
        return {"cuda_graph": False, "graph_pool_bytes": 0,
                "cuda_graph_off": step.error if step is not None and step.error else blocked, **steps}
    retry = {"graph_capture_retry": step.capture_retry} if step.capture_retry else {}
    return {"cuda_graph": True, "graph_pool_bytes": step.pool_bytes, "graph_capture_s": step.capture_s,
            "graph_replays": step.replays, "graph_ms_per_token": step.replay_ms(), **retry, **steps}


def _take(ids: list[int], values: list[float], *, tokens: list[int], logprobs: list[float], stops: set[int],
          limit: int, show) -> bool:
    """Keep a row's read-back tokens up to its first stop or ``limit`` tokens (the steps past
    either are dropped); True once the row is done."""
    for token, value in zip(ids, values):
        tokens.append(int(token))
        logprobs.append(float(value))
        if show is not None:
            show(int(token))
        if token in stops or len(tokens) >= limit:
            return True
    return False
