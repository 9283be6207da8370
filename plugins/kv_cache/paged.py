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

from weft.plugins.kv_cache.sharded import ShardedCache, ShardedLayer


class PagedLayer(ShardedLayer):
    """One decoder layer's cache on this rank: ``vision_keys``/``vision_values`` (B, Hkv, Nv, D)
    beside the sharded layer's text buffer, ``keys``/``values`` (B, Hkv, capacity, D) of which
    the first ``filled`` rows are filled (whole pages of ``page_tokens`` rows)."""

    def __init__(self, *, state: dict) -> None:
        super().__init__(state=state)  # shared by the layers: ... and the page's rows
        self.vision_keys = self.vision_values = None

    def prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """This rank's part of the prompt: its image and video rows into the vision pool, at
        their exact size; its other real rows into the text pages."""
        keep, vision = self.state["keep"], self.state["vision"]
        rows = torch.ones(key_states.shape[-2], dtype=torch.bool, device=key_states.device) if keep is None else keep
        pooled = rows & vision if vision is not None else torch.zeros_like(rows)
        self.vision_keys, self.vision_values = key_states[:, :, pooled], value_states[:, :, pooled]
        self.append(key_states[:, :, rows & ~pooled], value_states[:, :, rows & ~pooled])

    def partition_bytes(self) -> dict[str, int]:
        """Bytes held: the vision pool, the text rows filled, the text buffer's whole pages."""
        def size(*tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        row = size(self.keys[:, :, :1], self.values[:, :, :1]) if self.keys is not None else 0
        return {"vision": size(self.vision_keys, self.vision_values), "text": row * self.filled,
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
