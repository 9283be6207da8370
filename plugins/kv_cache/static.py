"""The ``static`` KV cache: every layer's keys and values preallocated, written in place.

Each layer holds (B, Hkv, capacity, D) buffers, capacity = the prompt plus the tokens to
generate (past 2048 rows rounded up to equal chunks: fewer spare rows than chunks), for B
rows (``reserve``, called by the core before the prefill): each prefill copies its prompt's
keys and values into its row and hands them back unchanged (the recipe's own attention runs
on the prompt alone); each decoded token is one row written in place at its position, a
device tensor (one for every row, or one a row). Nothing is concatenated and no tensor
changes shape from one token to the next, which a captured CUDA graph needs; transformers'
dynamic cache copies the whole cache at every token (at 128K, 7 GB per token for the 7B).
Decoding attends over the whole buffer, the rows past each row's position masked from the
device position (split-KV: ``decode_kernel``'s Triton kernel on CUDA, or
``split_decode_attention`` in plain torch, the buffer's rows a multiple of its chunks; no
host-side length anywhere), so a decoding step reads no host state that changes from one
token to the next and can be compiled and captured as a CUDA graph
(core/infer/decode_step.py). One process, whole sequence: under sequence parallelism
the ``sharded`` and ``paged`` caches split it over the ranks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from weft.core.errors import WeftError
from weft.plugins.kv_cache.decode_attention import register_decode_attention
from weft.strategies.attention.chunk_prefill import prefix_chunk_attention
from weft.strategies.attention.decode_split import split_decode_attention, split_rows
from weft.strategies.attention.kernels.decode_triton import (
    split_plan,
    triton_decode_attention,
    triton_decode_available,
)


class StaticLayer(DynamicLayer):
    """One decoder layer's buffers; ``state`` (shared by the layers) holds the phase, the
    capacity and rows, the row being prefilled, the position the next token is written at
    (a (1,) or (B,) device tensor) and the length so far (None when the rows differ)."""

    def __init__(self, *, state: dict) -> None:
        super().__init__()
        self.state = state

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        state = self.state
        if state["phase"] == "prefill":  # (1, Hkv, S, D): the prompt of row state["row"], or its chunk at "start"
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            _, h, s, d = key_states.shape
            start = state["start"]
            if start == 0 and (state["row"] == 0 or self.keys.dim() != 4):  # the first prompt of a batch allocates
                # A few rows past the capacity (fewer than one a chunk), so the decode attention's
                # chunks are views of the buffer.
                rows, state["splits"] = split_rows(max(state["capacity"], s))
                shape = (state["rows"], h, rows, d)  # (B, Hkv, capacity rounded up, D)
                # One dtype for both halves, the values': under autocast (precision = "bf16" over
                # float32 weights) mRoPE's float32 cos/sin make the keys float32, the values bf16.
                self.keys = key_states.new_zeros(shape, dtype=value_states.dtype)
                self.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
            self.keys[state["row"], :, start:start + s] = key_states[0]
            self.values[state["row"], :, start:start + s] = value_states[0]
            if start == 0:  # the recipe's own attention on the prompt (or its first chunk) alone
                return key_states, value_states
            # A later chunk: the row's keys so far, its own last (the cache's attention, _attend).
            row = state["row"]
            return self.keys[row:row + 1, :, :start + s], self.values[row:row + 1, :, :start + s]
        # decode: one new token per row, each at its row's position
        if state["position"] is None:
            raise RuntimeError("the static cache decodes after its prefill")
        # (B, Hkv, 1, D) rows written in place at each row's position (one for every row
        # broadcasts), from the device position: no host index. index_copy_ or an indexed put,
        # not a scatter: Inductor writes either into the cache itself, but a scatter into a copy
        # of the whole layer's cache copied back (4x its bytes a token: at 128K more than the
        # weights' read; torch 2.11 and 2.13).
        where = state["position"].reshape(-1)  # (B,) or (1,): one position for every row
        if where.shape[0] == 1:  # index_copy_: what transformers' own static cache writes under CUDA graphs
            self.keys.index_copy_(2, where, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, where, value_states.to(self.values.dtype))
            return self.keys, self.values
        rows = torch.arange(self.keys.shape[0], device=self.keys.device)  # (B,)
        self.keys[rows, :, where] = key_states[:, :, 0].to(self.keys.dtype)  # (B, Hkv, D) at [b, :, pos_b]
        self.values[rows, :, where] = value_states[:, :, 0].to(self.values.dtype)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # A host position (eager decoding, a prefill): the length so far, from which the model
        # numbers the next token. A device position (a batch, a captured step): the buffer's
        # rows, the same answer at every token; the caller passes the positions.
        return self.state["length"] if self.state["length"] is not None else int(self.keys.shape[2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class StaticCache(Cache):
    """See the module docstring. ``decode_attention``: the name of this cache's decode
    attention in transformers' AttentionInterface (the core selects it after the prefill)."""

    #: A decoding step at a device position (``at(tensor)``) has the same shapes, kernels and
    #: host state at every token: core/infer/decode_step.py captures it.
    capturable = True

    def __init__(self, *, num_layers: int, kernel: str = "split", compile_step: bool = False,
                 device: torch.device | None = None, prefill_chunk: int | str = 0) -> None:
        if kernel == "auto":
            kernel = "triton" if device is not None and triton_decode_available(device) else "split"
        if kernel == "flash":
            _check_flash(device)
        if kernel == "triton" and (device is None or not triton_decode_available(device)):
            where = "no Triton installed" if device is not None and device.type == "cuda" else f"the {device} device"
            raise WeftError(f"kv_cache decode_kernel = 'triton' runs weft's Triton kernel on a CUDA GPU; here: "
                            f"{where}; use decode_kernel = 'split' (any device) or 'auto'",
                            where="kv_cache.decode_kernel")
        self.kernel = kernel
        self.compile_step = compile_step  # the decoding step through torch.compile (on CUDA: core/infer/decode.py)
        # A prompt longer than this many tokens is prefilled in chunks, "auto": where memory needs it
        # (core/infer/prefill_chunks.py); 0: whole.
        self.prefill_chunk = prefill_chunk
        self.state = {"phase": "prefill", "capacity": 0, "rows": 1, "row": 0, "position": None, "length": 0,
                      "prompt": 0, "splits": 1, "plan": None, "start": 0}
        super().__init__(layers=[StaticLayer(state=self.state) for _ in range(num_layers)])
        self._host_position: torch.Tensor | None = None
        self.decode_attention = register_decode_attention(self, self._attend)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.state["phase"] == "prefill":
            return self._prefill_update(key_states, value_states, layer_idx, *args, **kwargs)
        # A decoding step: traced with the whole step when it is compiled (one trace over every
        # layer, each layer's buffers fixed objects: no guard changes from one token to the next).
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable
    def _prefill_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
                        **kwargs):
        # Outside the compiled attention (a prefill under a rule's compile): traced, the layer's
        # index and its layer object's state would be guards, one compilation per layer up to
        # torch's recompile limit, the rest of the layers eager.
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reserve(self, tokens: int, *, rows: int = 1) -> None:
        """What every layer allocates at the prefill: ``tokens`` positions (the longest prompt
        plus the tokens to generate) for each of ``rows`` prompts decoded together."""
        self.state.update(capacity=tokens, rows=rows)

    def begin_prefill(self, *, keep: torch.Tensor | None, prompt: int, vision: torch.Tensor | None = None,
                      row: int = 0, start: int = 0) -> None:
        """The prompt of ``row`` (its prefill alone, one after another) goes in next; or its chunk
        from position ``start`` on, after the chunks before it."""
        if keep is not None:
            raise ValueError("the static cache keeps the whole sequence on one process; under sequence parallelism "
                             "use the sharded or paged cache")
        # the rows so far until the prefill ends
        self.state.update(phase="prefill", length=start, prompt=prompt, position=None, row=row, start=start)

    def begin_decode(self) -> None:
        # The Triton kernel's split layout, from the buffer's shapes and the GPU's SM count, asked
        # here on the host: a compiled step then traces no device query (one graph, any torch).
        plan = split_plan(self.layers[0].keys) if self.kernel == "triton" and self.layers[0].is_initialized else None
        self.state.update(phase="decode", length=self.state["prompt"], plan=plan)

    def at(self, position: int | torch.Tensor, *, device: torch.device) -> None:
        """Where the next token of each row is written: one position for every row, or (B,) on
        the device (prompts of different lengths); the rows past it are masked."""
        if isinstance(position, torch.Tensor):
            self.state.update(position=position, length=None)  # the rows' lengths live on the device only
            return
        if self._host_position is None:  # its own tensor: a caller's device position is never written here
            self._host_position = torch.zeros(1, dtype=torch.long, device=device)
        self._host_position.fill_(position)
        self.state.update(position=self._host_position, length=position)

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if self.state["phase"] == "prefill":  # a prompt's later chunk (core/infer/prefill_chunks.py)
            return self._chunk_attend(query, key, value, scaling=scaling)
        # query (B, Hq, 1, D), key/value (B, Hkv, rows, D) -> (B, 1, Hq, D), no weights.
        # transformers' mask is not used (none is made for this attention's name): each row sees
        # the cache up to its position, read from the device.
        lengths = self.state["position"].reshape(-1) + 1  # (B or 1,)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        query = query.to(key.dtype)  # the rotated query of an autocast step is float32, the cache is not
        if self.kernel == "triton":
            out = triton_decode_attention(query, key, value, lengths=lengths, scale=scale, plan=self.state["plan"])
        elif self.kernel == "flash":
            from weft.strategies.attention.kernels.flash_ops import fa4_decode

            out = fa4_decode(query, key, value, lengths=lengths, scale=scale)
        else:
            out = split_decode_attention(query, key, value, lengths=lengths, scale=scale,
                                         splits=self.state["splits"])
        return out.transpose(1, 2).contiguous(), None


    @torch.compiler.disable
    def _chunk_attend(self, query, key, value, *, scaling=None):
        # query (1, Hq, C, D), key/value (1, Hkv, start + C, D) -> (1, C, Hq, D). Not traced under a
        # rule's compiled attention: the chunk's start and the keys' length change at every chunk.
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        query = query.to(key.dtype)
        out = prefix_chunk_attention(query, key, value, start=self.state["start"], scale=scale)
        return out.transpose(1, 2).contiguous(), None


def _check_flash(device: torch.device | None) -> None:
    """``decode_kernel = "flash"`` runs only where flash-attn-4's split-KV forward does: the
    rule's error otherwise. Its split-KV path is Blackwell's: on an H200 (SM 9.0) flash-attn-4
    4.0.0b36 stops with "SplitKV not supported on SM 9.0" (BENCHMARKS.md)."""
    from weft.strategies.attention.kernels.blocks import fa4_importable

    if device is None or device.type != "cuda" or not fa4_importable():
        where = "no flash-attn-4 installed" if device is not None and device.type == "cuda" else f"the {device} device"
    elif (major := torch.cuda.get_device_capability(device)[0]) < 10:
        where = f"{torch.cuda.get_device_name(device)}, compute capability {major}.x (its split-KV forward needs 10+)"
    else:
        return
    raise WeftError(f"kv_cache decode_kernel = 'flash' runs flash-attn-4's decode on a Blackwell GPU; here: {where}; "
                    "use decode_kernel = 'triton' (CUDA), 'split' (any device) or 'auto'",
                    where="kv_cache.decode_kernel")
