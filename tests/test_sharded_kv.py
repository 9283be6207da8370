"""The sharded cache's arithmetic: attention over shards merged by log-sum-exp equals
attention over the whole cache (float64), with grouped-query heads and an empty shard."""

from __future__ import annotations

import pytest
import torch

from weft.strategies.attention.sharded_decode import (
    decode_owner,
    grown_capacity,
    merge_partials,
    partial_attention,
    partitioned_decode_attention,
)

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)


def test_merged_shards_equal_whole_attention():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, 16, dtype=torch.float64)  # (B, Hq, Sq, D)
    k, v = torch.randn(2, 2, 37, 16, dtype=torch.float64), torch.randn(2, 2, 37, 16, dtype=torch.float64)
    scale = 16 ** -0.5
    whole = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(4, dim=1)) * scale, dim=-1)
    want = torch.einsum("bhqk,bhkd->bhqd", whole, v.repeat_interleave(4, dim=1))
    cuts = [(0, 12), (12, 12), (12, 30), (30, 37)]  # the second shard is empty
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], scale=scale) for a, b in cuts]
    assert torch.isinf(parts[1][1]).all() and not parts[1][0].any()
    got = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)


def test_partitions_in_any_order_equal_whole_attention():
    """A vision pool and text rows, kept apart and in another order than the sequence's:
    the same attention (every cached key precedes the query)."""
    torch.manual_seed(1)
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 20, 8, dtype=torch.float64), torch.randn(1, 2, 20, 8, dtype=torch.float64)
    vision = torch.zeros(20, dtype=torch.bool)
    vision[5:13] = True
    want = partitioned_decode_attention(q, [(k, v)], scale=0.3, group=None)
    got = partitioned_decode_attention(q, [(k[:, :, ~vision], v[:, :, ~vision]), (k[:, :, vision], v[:, :, vision])],
                                       scale=0.3, group=None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_text_pages_grow_a_page_at_a_time():
    assert [grown_capacity(n, page=4) for n in (0, 1, 4, 5, 9)] == [4, 4, 4, 8, 12]


def test_decoded_tokens_go_round_robin():
    assert [decode_owner(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
