"""The ``paged`` KV cache: each layer's keys and values in two partitions, a vision pool and
text pages, on every sequence-parallel rank.

The vision pool holds the image and video tokens' keys and values this rank keeps from the
prefill, allocated once at their exact size (what the grids make); it never grows. The text
partition is a buffer of whole pages (``page_tokens`` rows each) written in place: a decoded
token is one row copied, and a full buffer grows by a page, one copy per page instead of
transformers' dynamic cache's whole-cache concatenation per token. Decoding attends over
both partitions and merges them by log-sum-exp (a cached key's position is in its rotary
phase, and every cached key precedes the query, so the partitions' order does not matter);
under sequence parallelism each rank keeps its part of the prompt and every W-th decoded
token, as the ``sharded`` cache does, and the ranks' results merge the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from weft.plugins.sharded_cache import ShardedCache
from weft.strategies.attention.sharded_decode import decode_owner, grown_capacity


class PagedLayer(DynamicLayer):
    """One decoder layer's cache on this rank: ``vision_keys``/``vision_values`` (B, Hkv, Nv, D)
    and ``keys``/``values`` (B, Hkv, capacity, D) of which the first ``text_len`` rows are filled."""

    def __init__(self, *, state: dict) -> None:
        super().__init__()
        self.state = state  # shared by the layers: phase, keep and vision masks, prompt, rank, world, page
        self.total = 0  # tokens of the whole sequence cached so far, on every rank
        self.text_len = 0
        self.vision_keys = self.vision_values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))  # (B, Hkv, 0, D)
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        state = self.state
        if state["phase"] == "prefill":  # key_states: (B, Hkv, S_local, D), this rank's part
            keep, vision = state["keep"], state["vision"]
            rows = torch.ones(key_states.shape[-2], dtype=torch.bool, device=key_states.device) \
                if keep is None else keep
            pooled = rows & vision if vision is not None else torch.zeros_like(rows)
            self.vision_keys, self.vision_values = key_states[:, :, pooled], value_states[:, :, pooled]
            self._append(key_states[:, :, rows & ~pooled], value_states[:, :, rows & ~pooled])
            self.total += state["prompt"]
            return key_states, value_states  # the prefill's attention works on the whole part
        # decode: the same new token on every rank; one rank keeps it (round robin)
        if decode_owner(self.total - state["prompt"], state["world"]) == state["rank"]:
            self._append(key_states, value_states)
        self.total += key_states.shape[-2]
        return self.keys[:, :, :self.text_len], self.values[:, :, :self.text_len]

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` (B, Hkv, n, D) after the filled text rows, growing by pages."""
        n = keys.shape[-2]
        if self.keys.shape[-2] < self.text_len + n:
            capacity = grown_capacity(self.text_len + n, page=self.state["page"])
            grown_k = self.keys.new_empty((*keys.shape[:2], capacity, keys.shape[-1]))
            grown_v = self.values.new_empty((*values.shape[:2], capacity, values.shape[-1]))
            grown_k[:, :, :self.text_len] = self.keys[:, :, :self.text_len]
            grown_v[:, :, :self.text_len] = self.values[:, :, :self.text_len]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.text_len:self.text_len + n] = keys
        self.values[:, :, self.text_len:self.text_len + n] = values
        self.text_len += n

    def get_seq_length(self) -> int:
        return self.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.total + query_length, 0

    def partition_bytes(self) -> dict[str, int]:
        """Bytes held: the vision pool, the text rows filled, the text buffer's whole pages."""
        def size(*tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        row = size(self.keys[:, :, :1], self.values[:, :, :1]) if self.keys is not None else 0
        return {"vision": size(self.vision_keys, self.vision_values), "text": row * self.text_len,
                "text_capacity": size(self.keys, self.values)}


class PagedCache(ShardedCache):
    """Vision pool and text pages per layer, split over the sequence-parallel group when there is one."""

    layer_class = PagedLayer

    def __init__(self, *, num_layers: int, rank: int, world: int, group: Any, page_tokens: int) -> None:
        super().__init__(num_layers=num_layers, rank=rank, world=world, group=group, page=page_tokens)

    def partition_bytes(self) -> dict[str, int]:
        parts = [layer.partition_bytes() for layer in self.layers]
        return {key: sum(p[key] for p in parts) for key in ("vision", "text", "text_capacity")}

    def decode_parts(self, module, key: torch.Tensor, value: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # The layer's vision pool beside its filled text rows (what update returned).
        layer = self.layers[module.layer_idx]
        return [(layer.vision_keys, layer.vision_values), (key, value)]
