"""The ``sharded`` KV cache as transformers' own Cache: one layer object per decoder layer.

Prefill (``begin_prefill``): the model runs the recipe's sequence-parallel attention;
each layer's ``update`` receives this rank's part of the keys and values, keeps the rows
of real tokens (the core pads the prompt to the split's multiple) and hands the part back
unchanged to the ring or Ulysses attention. Decode (``begin_decode``): every rank runs the
whole model on the new token; ``update`` keeps its keys and values on one rank (round
robin, strategies/attention/sharded_decode.py), written in place into a buffer that grows by
whole pages, and returns this rank's filled rows, over which the decode attention (registered
with transformers' AttentionInterface; split-KV over the shard) attends and merges by
log-sum-exp across the group. ``get_seq_length`` is the global length, so the model's own
position and cache-position arithmetic is the unsharded one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from weft.plugins.kv_cache.decode_attention import register_decode_attention
from weft.strategies.attention.sharded_decode import decode_owner, grown_capacity, partitioned_decode_attention

#: Rows a sharded cache's buffer grows by when it fills (the paged cache's ``page_tokens``).
GROW_ROWS = 256


class ShardedLayer(DynamicLayer):
    """One decoder layer's shard of the cache on this rank: ``keys``/``values`` (B, Hkv,
    capacity, D) of which the first ``filled`` rows hold this rank's tokens, written in place
    (a full buffer grows by whole pages: one copy per page of tokens, not the whole cache
    concatenated at every token as transformers' dynamic cache does)."""

    def __init__(self, *, state: dict) -> None:
        super().__init__()
        self.state = state  # shared by the layers: phase, keep mask, prompt length, rank, world
        self.total = 0  # tokens of the whole sequence cached so far, on every rank
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))  # (B, Hkv, 0, D)
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        state = self.state
        if state["phase"] == "prefill":  # key_states: (B, Hkv, S_local, D), this rank's part
            self.prefill(key_states, value_states)
            self.total += state["prompt"]
            return key_states, value_states  # the SP attention works on the padded part
        # decode: the same new token on every rank; one rank keeps it (the k-th decoded
        # token of every layer goes to the same rank: k = tokens past the prompt)
        if decode_owner(self.total - state["prompt"], state["world"]) == state["rank"]:
            self.append(key_states, value_states)
        self.total += key_states.shape[-2]
        return self.keys[:, :, :self.filled], self.values[:, :, :self.filled]

    def prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """This rank's part of the prompt: the rows of real tokens kept, in a buffer with room for
        this rank's share of the tokens to come (``ShardedCache.reserve``)."""
        keep, state = self.state["keep"], self.state
        coming = max(state["reserved"] - state["prompt"], 0)
        self.append(key_states if keep is None else key_states[:, :, keep],
                    value_states if keep is None else value_states[:, :, keep],
                    spare=-(-coming // state["world"]))  # round robin: at most ceil(coming / W) here

    def append(self, keys: torch.Tensor, values: torch.Tensor, *, spare: int | None = None) -> None:
        """Write ``keys``/``values`` (B, Hkv, n, D) after the filled rows; a buffer too small is
        replaced by one of the filled rows, these and ``spare`` rows more, or (``spare`` None)
        of whole pages."""
        n = keys.shape[-2]
        if self.keys.shape[-2] < self.filled + n:
            capacity = (self.filled + n + spare if spare is not None
                        else grown_capacity(self.filled + n, page=self.state.get("page", GROW_ROWS)))
            grown_k = self.keys.new_empty((*keys.shape[:2], capacity, keys.shape[-1]))
            grown_v = self.values.new_empty((*values.shape[:2], capacity, values.shape[-1]))
            grown_k[:, :, :self.filled] = self.keys[:, :, :self.filled]
            grown_v[:, :, :self.filled] = self.values[:, :, :self.filled]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.filled:self.filled + n] = keys
        self.values[:, :, self.filled:self.filled + n] = values
        self.filled += n

    def get_seq_length(self) -> int:
        return self.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.total + query_length, 0


class ShardedCache(Cache):
    """Keys and values split over the sequence-parallel group; see the module docstring.
    ``extra``: more shared layer state (a subclass's, e.g. the paged cache's page size)."""

    layer_class = ShardedLayer

    def __init__(self, *, num_layers: int, rank: int, world: int, group: Any, **extra: Any) -> None:
        self.state = {"phase": "prefill", "keep": None, "vision": None, "prompt": 0, "reserved": 0, "rank": rank,
                      "world": world, **extra}
        self.group = group
        super().__init__(layers=[self.layer_class(state=self.state) for _ in range(num_layers)])
        # The decode attention: registered under a name of this cache, selected by the core
        # for the text model once the prefill is done.
        self.decode_attention = register_decode_attention(self, self._attend)

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # Outside a rule's compiled attention, as the static cache's (plugins/kv_cache/static.py):
        # traced, the layer's index and its layer object would guard one compilation per layer.
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reserve(self, tokens: int) -> None:
        """The prompt and the tokens to generate (called before the prefill): each rank's buffer
        is allocated once, its part of the prompt and its share of the new tokens."""
        self.state["reserved"] = tokens

    def begin_prefill(self, *, keep: torch.Tensor | None, prompt: int, vision: torch.Tensor | None = None) -> None:
        """``keep``: (S_local,) bool, this rank's rows that are real tokens (not padding);
        ``prompt``: the prompt's real length; ``vision``: (S_local,) bool, its rows of image
        or video tokens (for layers that keep them apart)."""
        self.state.update(phase="prefill", keep=keep, vision=vision, prompt=prompt)

    def begin_decode(self) -> None:
        self.state.update(phase="decode", keep=None, vision=None)

    def decode_parts(self, module, key: torch.Tensor, value: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (key, value) partitions the decode attends over: here one, what
        ``update`` returned."""
        return [(key, value)]

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (B, Hq, Sq, D), key/value (B, Hkv, N_local, D) -> (B, Sq, Hq, D), no weights
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = partitioned_decode_attention(query, self.decode_parts(module, key, value), scale=scale,
                                           group=self.group)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
