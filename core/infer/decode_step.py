"""The decoding step with no host work in it (greedy, or sampled on the device): compiled once,
captured as a CUDA graph and replayed per token (the static cache, one process, on CUDA), or
the same step run eagerly.

A decoding step of the 7B launches some 1,400 kernels from Python (~50 a layer); once the
cache is read in place (the static cache, split-KV attention from a device position) the
host's launches, not the GPU, set the pace: 32.8 ms a token at 128K eagerly, 20.5 replayed
(BENCHMARKS.md). A CUDA graph launches them all at once; ``torch.compile`` first
fuses the small ones (norms, rotary, casts, softmax) into a few hundred, since a replayed
graph still pays each kernel's own start (``compile``: one trace of the whole step, no graph
break, compiled in the first, eager step). A graph replays exactly what was recorded, so the
step must not depend on anything the host decides per token. ``DecodeStep`` owns its inputs
as buffers at fixed addresses — the token (B, 1), the rotary position ids (3, B, 1) for
mRoPE or (B, 1), the cache row each row's token is written at (B,) — and its outputs (the
argmax (B,) and its log-probability (B,)); the step runs the one-token forward into the
cache, takes the argmax on the device and advances its own inputs in place (token = argmax,
positions + 1).

What the forward asks of the host, checked in transformers' Qwen2.5-VL (Qwen2/Llama alike):
- positions: passed, so the model computes none (no ``get_seq_length``, no rope index
  from the stored ``rope_deltas``); ``cache.at(tensor)`` makes the cache's length answers
  the buffer's rows in any case, the same at every token;
- the mask: the cache's decode attention is a name transformers has no mask function
  for, so ``create_causal_mask`` returns before asking the cache for sizes; the attention
  masks from the device position itself;
- the rotary embedding: default, YaRN and linear scaling compute from the ids on the
  device; ``dynamic`` and ``longrope`` compare the largest id on the host each call (not
  captured: ``capture_blocker``);
- activation checkpointing's hooks (composable ``checkpoint``) stash the RNG state per
  module even under no_grad, and under torch 2.11 break a compiled step in every layer: weft
  eval and generate attach none (``ctx.inference``: nothing is recomputed without a backward);
- autocast's cast cache: off inside the step, so a cast made while capturing is the
  graph's own tensor, not one that the enclosing autocast frees when it exits.

On CUDA the first ``WARMUP`` steps run eagerly on a side stream (lazy initialisation,
cuBLAS workspaces, allocator growth: outside the capture, as torch.cuda.graph asks);
they are real decoding steps. Then one step is captured into a graph with its own memory
pool (``pool_bytes``: what the allocator reserved for it) and every later token is one
replay. Anywhere else (the CPU, several ranks, a cache that is not ``capturable``, FSDP,
``--no-cuda-graph``), and if the capture fails, the same step runs eagerly on the same
buffers: the CPU tests run exactly the code that is captured.
"""

from __future__ import annotations

import collections
import contextlib
import time
import traceback

import torch
import torch.distributed as dist

from weft.core.infer.sampling import Sampling, nucleus_from_noise

#: Eager steps before the capture (on CUDA): lazy initialisation happens outside the graph.
WARMUP = 2


def _traced() -> tuple[collections.Counter, int]:
    """torch.compile's running counts in this process: graph breaks by reason, graphs compiled."""
    from torch._dynamo.utils import counters

    return collections.Counter(counters["graph_break"]), int(counters["stats"]["unique_graphs"])


class DecodeStep:
    """One greedy step over ``cache`` per call, from device buffers (see the module docstring).

    ``token`` (B, 1): the last chosen tokens; ``rotary``: the next token's rotary position ids,
    (3, B, 1) or (B, 1); ``row`` (B,) or (1,): the cache row it is written at. Each call
    returns fresh (B,) tensors of the chosen tokens and their log-probabilities (float64),
    on the device; nothing is read back."""

    def __init__(self, model: torch.nn.Module, *, cache, token: torch.Tensor, rotary: torch.Tensor,
                 row: torch.Tensor, capture: bool, world: int = 1, sampling: Sampling | None = None,
                 compile: bool = False) -> None:
        self.model, self.cache, self.world, self.sampling = model, cache, world, sampling
        self.token, self.rotary, self.row = token.clone(), rotary.clone(), row.clone()  # the step's own buffers
        rows = token.shape[0]
        self.chosen = torch.zeros(rows, dtype=torch.long, device=token.device)  # (B,)
        self.noise = None  # (B, V) uniform draws of the sampled step, refilled before each step
        self.logprob = torch.zeros(rows, dtype=torch.float64, device=token.device)  # (B,)
        self.capture, self.steps = capture, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool_bytes, self.capture_s, self.replays = 0, 0.0, 0
        self.error: str | None = None  # why a capture failed (then every step is eager)
        self.capture_retry: str | None = None  # why the capture keeping the allocator's cache failed
        self._first_replay: torch.cuda.Event | None = None  # times the replays without a host sync
        # The body through torch.compile: one trace over every layer (no graph break: the cache's
        # decode write and attention trace with it), its norms, rotary, casts and softmax fused,
        # so the graph replays a few hundred kernels a token instead of ~50 a layer. Compiled
        # at the first step (eager warm-up, outside any capture); a body torch cannot compile
        # decodes eagerly (``compile_error`` says why).
        self.compiled, self.compile_error = compile, None
        # The first step's seconds: its one-time work (torch.compile's, Triton's JIT of the
        # attention kernel, cuBLAS's set-up) is no token's cost; reported apart (first_step_s).
        self.first_s: float | None = None
        # Rounded where eager rounds (Inductor's emulate_precision_casts): fused, a bf16 step keeps
        # its intermediates in float32 and its tokens part from the eager step's within a few
        # tokens (the 7B's widths, 4 layers, on the CPU with torch 2.13: 3e-2 apart in the first
        # token's log-probability, parted at the second token; emulated, 1e-14 and the same tokens:
        # benchmarks/decode/step_trace_check.py, docs/inference.md).
        self._body = (torch.compile(self._forward, dynamic=False, options={"emulate_precision_casts": True})
                      if compile else self._forward)
        self._traced_before = _traced() if compile else None

    def trace_report(self) -> dict:
        """What torch.compile made of the step over the tokens so far: the graphs it compiled and
        its graph breaks (the first one's reason) — one graph and none when the whole step
        traces. A break leaves the rest of a layer to eager code, where a rule's compiled unit
        recompiles for each layer up to torch's limit: the speed of a step that did not trace."""
        if not self.compiled or self._traced_before is None:
            return {}
        breaks, graphs = _traced()
        breaks.subtract(self._traced_before[0])
        breaks = {reason: n for reason, n in breaks.items() if n > 0}
        report = {"step_graphs": graphs - self._traced_before[1], "step_graph_breaks": sum(breaks.values())}
        if breaks:
            report["step_graph_break"] = next(iter(breaks))[:300]
        return report

    def _step(self) -> None:
        """The step itself: what is captured, and what runs eagerly."""
        self.cache.at(self.row, device=self.row.device)  # a device position: no host length
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # the casts this step makes are its own (the module docstring)
        try:
            if self.compiled:  # `weft generate` decodes the rules' compiled units eagerly: not this body
                with torch.compiler.set_stance("default"):
                    self._body()
            else:
                self._forward()
        finally:
            torch.set_autocast_cache_enabled(cached)

    def _first_compiled(self) -> None:
        """The first step, which compiles the body; rerun eagerly if that fails (the step's
        inputs advance only at its end; its cache rows are written again in place)."""
        try:
            self._step()
        except Exception as error:  # noqa: BLE001 - a body torch cannot compile decodes eagerly
            self.compiled, self._body = False, self._forward
            self.compile_error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            self._step()

    def _forward(self) -> None:
        output = self.model(input_ids=self.token, position_ids=self.rotary, past_key_values=self.cache,
                            use_cache=True, logits_to_keep=1, cache_position=self.row[:1])
        logits = output.logits[:, -1].float()  # (B, V)
        if self.sampling is None:
            chosen = logits.argmax(dim=-1)  # (B,)
        else:
            chosen = nucleus_from_noise(logits, self.noise, temperature=self.sampling.temperature,
                                        top_p=self.sampling.top_p)
        if self.world > 1:  # never captured (capture_blocker): rank 0's choice for every rank
            dist.broadcast(chosen, src=0)
        self.logprob.copy_(torch.log_softmax(logits.double(), dim=-1).gather(1, chosen[:, None])[:, 0])
        self.chosen.copy_(chosen)
        self.token.copy_(chosen[:, None])
        self.rotary.add_(1)  # a new text token: every mRoPE axis one further
        self.row.add_(1)

    def _warm(self) -> None:
        stream = torch.cuda.Stream(device=self.row.device)
        stream.wait_stream(torch.cuda.current_stream(self.row.device))
        with torch.cuda.stream(stream):
            if self.steps == WARMUP - 1:
                self._checked_step()
            elif self.steps == 0 and self.compiled:
                self._first_compiled()
            else:
                self._step()
        torch.cuda.current_stream(self.row.device).wait_stream(stream)

    def _checked_step(self) -> None:
        """The last warm-up step with torch's synchronisation check on: a read-back the module
        docstring's list missed fails here, named by the line that made it, instead of spoiling
        the capture. The step then runs again unchecked and every later one eagerly (its inputs
        advance only at its end, and its cache rows are written again at the same position)."""
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._step()
        except RuntimeError as error:
            frames = [f for f in traceback.extract_tb(error.__traceback__) if "/torch/" not in f.filename]
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            self.capture, self.error = False, f"the step reads back from the device{where}: {str(error)[:200]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if not self.capture:
            self._step()

    def _record(self) -> None:
        # torch.cuda.graph's steps without its emptying of the allocator's cache (0.83 s after a 128K prefill,
        # 0.03 after 16K, for a ~50 MiB pool: BENCHMARKS.md), else torch.cuda.graph itself (``capture_retry``:
        # why). No garbage collection: torch's capture runs none unless told to (force_cudagraph_gc).
        start, device = time.perf_counter(), self.row.device  # capture_s: all of this, one-time
        for kept in (True, False):
            torch.cuda.synchronize(device)
            if not kept:  # as torch.cuda.graph starts, so the reserved bytes gained are the pool's
                torch.cuda.empty_cache()
            graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
            before = torch.cuda.memory_reserved(device)
            try:
                if kept:
                    self._capture_keeping_cache(graph, pool=pool, device=device)
                else:
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        self._step()
            except Exception as error:  # noqa: BLE001 - once more as torch does it; then decode eagerly
                torch.cuda.synchronize(device)
                reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
                if kept:
                    self.capture_retry = reason
                    continue
                self.capture, self.error = False, reason
                return
            self.pool_bytes = torch.cuda.memory_reserved(device) - before
            self.capture_s, self.graph = time.perf_counter() - start, graph
            return

    def _capture_keeping_cache(self, graph: torch.cuda.CUDAGraph, *, pool, device: torch.device) -> None:
        stream = torch.cuda.Stream(device=device)  # a capture runs on a side stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                self._step()
            except BaseException:  # the step's own error, not the ended capture's
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)

    def replay_ms(self) -> float | None:
        """The replays' mean GPU time (ms a token, the read-backs' gaps included), or None."""
        if not self.replays:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._first_replay.elapsed_time(end) / self.replays

    def _replay(self) -> None:
        if self._first_replay is None:
            self._first_replay = torch.cuda.Event(enable_timing=True)
            self._first_replay.record()
        self.graph.replay()
        self.replays += 1

    def _draw(self) -> None:
        """The next step's uniform draws, into the buffer the step reads: an ordinary kernel
        before the step (a captured graph then replays no random draw of its own)."""
        if self.noise is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self.noise = torch.empty(self.token.shape[0], vocab, device=self.token.device)  # (B, V)
        torch.rand(self.noise.shape, generator=self.sampling.generator, device=self.noise.device, out=self.noise)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter() if self.steps == 0 else None
        if self.sampling is not None:
            self._draw()
        if self.graph is None and self.capture and self.steps >= WARMUP:
            self._record()  # records the step without running it; the replay below runs it
        if self.graph is not None:
            self._replay()
        elif self.capture:
            self._warm()
        elif self.steps == 0 and self.compiled:
            self._first_compiled()
        else:
            self._step()
        if start is not None:
            if self.row.is_cuda:
                torch.cuda.synchronize(self.row.device)
            self.first_s = time.perf_counter() - start
        self.steps += 1
        return self.chosen.clone(), self.logprob.clone()  # the next replay overwrites the buffers
