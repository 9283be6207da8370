"""The ``static`` KV cache: every layer's keys and values preallocated, written in place.

Each layer holds (B, Hkv, capacity, D) buffers, capacity = the prompt plus the tokens to
generate (``reserve``, called by the core before the prefill): the prefill copies the
prompt's keys and values in and hands them back unchanged (the recipe's own attention runs
on the prompt alone); each decoded token is one row written at its position by
``index_copy_`` from a device tensor. Nothing is concatenated and no tensor changes shape
from one token to the next, which a captured CUDA graph needs; transformers' dynamic cache
copies the whole cache at every token (at 128K, 7 GB per token for the 7B). Decoding attends
over the whole buffer with the rows past the current position masked out (an O(capacity)
read, as the filled rows are). One process, whole sequence: under sequence parallelism the
``sharded`` and ``paged`` caches split it over the ranks.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer


class StaticLayer(DynamicLayer):
    """One decoder layer's buffers; ``state`` (shared by the layers) holds the phase, the
    capacity, the position the next token is written at (a (1,) device tensor) and the
    length so far."""

    def __init__(self, *, state: dict) -> None:
        super().__init__()
        self.state = state

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        state = self.state
        if state["phase"] == "prefill":  # (B, Hkv, S, D): the prompt
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            b, h, s, d = key_states.shape
            capacity = max(state["capacity"], s)
            self.keys = key_states.new_zeros((b, h, capacity, d))  # (B, Hkv, capacity, D)
            self.values = value_states.new_zeros((b, h, capacity, value_states.shape[-1]))
            self.keys[:, :, :s] = key_states
            self.values[:, :, :s] = value_states
            return key_states, value_states
        # decode: the one new token, at the shared position
        if state["position"] is None or int(self.keys.shape[2]) <= 0:
            raise RuntimeError("the static cache decodes after its prefill")
        self.keys.index_copy_(2, state["position"], key_states)
        self.values.index_copy_(2, state["position"], value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.state["length"]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state["length"] + query_length, 0


class StaticCache(Cache):
    """See the module docstring. ``decode_attention``: the name of this cache's decode
    attention in transformers' AttentionInterface (the core selects it after the prefill)."""

    def __init__(self, *, num_layers: int) -> None:
        self.state = {"phase": "prefill", "capacity": 0, "position": None, "length": 0, "prompt": 0}
        super().__init__(layers=[StaticLayer(state=self.state) for _ in range(num_layers)])
        self.decode_attention = f"weft_static_decode_{id(self):x}"
        AttentionInterface.register(self.decode_attention, self._attend)

    def reserve(self, tokens: int) -> None:
        """Rows every layer allocates at the prefill: the prompt plus the tokens to generate."""
        self.state["capacity"] = tokens

    def begin_prefill(self, *, keep: torch.Tensor | None, prompt: int, vision: torch.Tensor | None = None) -> None:
        if keep is not None:
            raise ValueError("the static cache keeps the whole sequence on one process; under sequence parallelism "
                             "use the sharded or paged cache")
        self.state.update(phase="prefill", length=0, prompt=prompt, position=None)  # empty until the prefill ends

    def begin_decode(self) -> None:
        self.state.update(phase="decode", length=self.state["prompt"])

    def at(self, position: int, *, device: torch.device) -> None:
        """The next token is written at ``position`` (the cache then holds ``position + 1`` rows)."""
        if self.state["position"] is None:
            self.state["position"] = torch.zeros(1, dtype=torch.long, device=device)
        self.state["position"].fill_(position)
        self.state["length"] = position

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (B, Hq, 1, D), key/value (B, Hkv, capacity, D) -> (B, 1, Hq, D), no weights
        visible = torch.arange(key.shape[2], device=key.device) <= self.state["position"]  # (capacity,)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=visible[None, None, None, :], scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
