"""The split-KV decode attention (strategies/attention/decode_split.py) equals SDPA over each
row's filled cache rows: rows of different lengths in one batch, grouped-query heads
(Qwen2.5-VL's 28 query over 4 KV heads, at a small head size), float32 and float64, one
chunk or many; the buffer layout (``split_rows``) and the cache's own decode attention."""

from __future__ import annotations

import pytest
import torch

from weft.strategies.attention.decode_split import split_decode_attention, split_rows

pytestmark = pytest.mark.quick

TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}


def _reference(query, key, value, lengths, scale):
    """SDPA of each row over its first lengths[b] rows alone (no mask: the rows are sliced)."""
    rows = []
    for b, length in enumerate(lengths.tolist()):
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            query[b:b + 1], key[b:b + 1, :, :length], value[b:b + 1, :, :length], scale=scale, enable_gqa=True))
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("hq, hkv, d", [(28, 4, 8), (4, 4, 16), (6, 2, 8)], ids=["qwen2.5-vl", "mha", "gqa3"])
@pytest.mark.parametrize("chunk", [8, 4096], ids=["chunks", "one-chunk"])
def test_equals_sdpa_over_the_filled_rows(dtype, hq, hkv, d, chunk):
    torch.manual_seed(0)
    rows, splits = split_rows(37, chunk=chunk)
    assert rows >= 37 and rows % splits == 0
    query = torch.randn(3, hq, 1, d, dtype=dtype)  # (B, Hq, 1, D)
    key = torch.randn(3, hkv, rows, d, dtype=dtype)  # (B, Hkv, rows, D): the rows past a length are noise
    value = torch.randn(3, hkv, rows, d, dtype=dtype)
    lengths = torch.tensor([1, 20, 37])  # a row that sees one key, one halfway, one the whole capacity
    got = split_decode_attention(query, key, value, lengths=lengths, scale=0.3, splits=splits)
    want = _reference(query, key, value, lengths, 0.3)
    assert got.dtype == dtype and got.shape == (3, hq, 1, d)
    assert (got - want).abs().max() < TOLERANCE[dtype]


def test_one_length_for_every_row_and_a_split_that_does_not_divide():
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 28, 1, 8), torch.randn(2, 4, 30, 8), torch.randn(2, 4, 30, 8)
    want = _reference(query, key, value, torch.tensor([11, 11]), 8 ** -0.5)
    for splits in (1, 3, 7, 30, 64):  # 7 leaves a rest of 2 rows past 7 chunks of 4; 64: one row a chunk
        got = split_decode_attention(query, key, value, lengths=torch.tensor([11]), scale=8 ** -0.5, splits=splits)
        assert (got - want).abs().max() < 2e-6


def test_no_copy_of_the_cache():
    """The chunks are views of the buffer: the keys and values are never repeated per query
    head nor copied (what a 128K bf16 cache cannot afford per layer per token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        """The largest tensor an op allocates (views and in-place ops share an input's storage)."""

        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, out.numel())
            return out

    rows, splits = split_rows(4096, chunk=512)
    query, key, value = torch.randn(1, 28, 1, 8), torch.randn(1, 4, rows, 8), torch.randn(1, 4, rows, 8)
    with Sizes() as sizes:
        split_decode_attention(query, key, value, lengths=torch.tensor([3000]), scale=0.5, splits=splits)
    assert sizes.largest <= 28 * rows  # the scores (B, Hq, rows); the cache holds 4 * rows * 8


def test_split_rows():
    assert split_rows(60) == (60, 1)  # one chunk below its size: no spare row
    rows, splits = split_rows(131172)  # 128K prompt + 100 new tokens
    assert splits == 65 and rows % splits == 0 and 0 <= rows - 131172 < splits


def test_the_static_cache_decodes_rows_of_different_lengths():
    """The cache's decode attention (its registered AttentionInterface function) over rows
    written at their own positions: SDPA over each row's filled rows."""
    from weft.plugins.kv_cache.static import StaticCache

    torch.manual_seed(2)
    cache = StaticCache(num_layers=1)
    cache.reserve(9, rows=2)
    prompts = [torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4)]
    for row, keys in enumerate(prompts):
        cache.begin_prefill(keep=None, prompt=keys.shape[2], row=row)
        cache.update(keys, keys * 2, 0)
    cache.begin_decode()
    cache.at(torch.tensor([5, 3]), device=torch.device("cpu"))
    new = torch.randn(2, 2, 1, 4)
    keys, values = cache.update(new, new * 2, 0)
    query = torch.randn(2, 6, 1, 4)
    out, _ = cache._attend(None, query, keys, values, None, scaling=0.5)  # (B, 1, Hq, D)
    for row, prompt in enumerate(prompts):
        k = torch.cat([prompt, new[row:row + 1]], dim=2)
        want = torch.nn.functional.scaled_dot_product_attention(query[row:row + 1], k, k * 2, scale=0.5,
                                                                enable_gqa=True)
        assert (out[row:row + 1].transpose(1, 2) - want).abs().max() < 2e-6


@pytest.mark.parametrize("splits", [1, 4, 5])
def test_the_log_sum_exp_merges_partitions_as_one_softmax(splits):
    """``return_lse``: the scores' log-sum-exp, with which two partitions of the keys (a rank's
    shard, a vision pool and text pages) merge into attention over their union."""
    from weft.strategies.attention.sharded_decode import merge_partials

    torch.manual_seed(2)
    query = torch.randn(2, 6, 1, 8, dtype=torch.float64)
    key, value = torch.randn(2, 2, 23, 8, dtype=torch.float64), torch.randn(2, 2, 23, 8, dtype=torch.float64)
    parts = [split_decode_attention(query, k, v, lengths=None, scale=0.4, splits=splits, return_lse=True)
             for k, v in ((key[:, :, :9], value[:, :, :9]), (key[:, :, 9:], value[:, :, 9:]))]
    merged = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    want = _reference(query, key, value, torch.tensor([23, 23]), 0.4)
    assert (merged - want).abs().max() < 1e-12
    scores = torch.einsum("bhd,bhnd->bhn", query[:, :, 0], key.repeat_interleave(3, dim=1)) * 0.4
    whole = split_decode_attention(query, key, value, lengths=None, scale=0.4, splits=splits, return_lse=True)[1]
    assert (whole[..., 0] - torch.logsumexp(scores, dim=-1)).abs().max() < 1e-12


def test_the_decode_kernels_are_the_rules_error_where_they_cannot_run(monkeypatch):
    """decode_kernel = "flash" needs flash-attn-4 on a Blackwell GPU (its split-KV forward
    stops on an H200), "triton" a CUDA GPU: elsewhere a message naming the key, the device
    and what runs there, not a failure inside the first decoded token. "auto" (the default)
    takes Triton on CUDA, the plain-torch split-KV elsewhere."""
    from weft.core.errors import WeftError
    from weft.plugins.kv_cache import static as static_cache
    from weft.plugins.kv_cache.static import StaticCache
    from weft.strategies.attention.kernels import blocks

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(WeftError, match="decode_kernel = 'flash' runs flash-attn-4's decode on a Blackwell GPU; "
                                        "here: the cpu device; use decode_kernel = 'triton' \\(CUDA\\), 'split'"):
        StaticCache(num_layers=1, kernel="flash", device=cpu)
    with pytest.raises(WeftError, match="decode_kernel = 'triton' runs weft's Triton kernel on a CUDA GPU; here: "
                                        "the cpu device; use decode_kernel = 'split'"):
        StaticCache(num_layers=1, kernel="triton", device=cpu)
    assert StaticCache(num_layers=1, kernel="auto", device=cpu).kernel == "split"
    assert StaticCache(num_layers=1, device=cpu).kernel == "split"
    # A CUDA device stood in for (nothing is allocated before the prefill): an H200 with
    # flash-attn-4 installed, and Triton.
    monkeypatch.setattr(blocks, "fa4_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with pytest.raises(WeftError, match="here: NVIDIA H200, compute capability 9.x \\(its split-KV forward needs "
                                        "10\\+\\); use decode_kernel = 'triton'"):
        StaticCache(num_layers=1, kernel="flash", device=cuda)
    monkeypatch.setattr(static_cache, "triton_decode_available", lambda device: device.type == "cuda")
    assert StaticCache(num_layers=1, kernel="auto", device=cuda).kernel == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert StaticCache(num_layers=1, kernel="flash", device=cuda).kernel == "flash"


def test_a_cache_is_not_kept_alive_by_its_decode_attention():
    """transformers' AttentionInterface lives as long as the process: the entry a cache registers
    holds it weakly, so a finished `weft generate` frees its cache (7 GB at 128K for the 7B), and
    the entry refuses afterwards instead of attending over a dead cache."""
    import gc
    import weakref

    from transformers import AttentionInterface

    from weft.plugins.kv_cache.sharded import ShardedCache
    from weft.plugins.kv_cache.static import StaticCache

    for make in (lambda: StaticCache(num_layers=2, device=torch.device("cpu")),
                 lambda: ShardedCache(num_layers=2, rank=0, world=1, group=None)):
        cache = make()
        name, alive = cache.decode_attention, weakref.ref(cache)
        entry = AttentionInterface._global_mapping[name]
        del cache
        gc.collect()
        assert alive() is None
        with pytest.raises(RuntimeError, match="outlived its cache"):
            entry(None, None, None, None, None)


def test_the_static_cache_keeps_keys_in_the_values_dtype():
    """Under autocast over float32 weights (``precision = "bf16"``) mRoPE's float32 cos/sin make
    the keys and queries float32 while the values are bf16: the cache holds both halves in the
    values' dtype and attends with the query cast to it (the H200's bf16 decode failed on float32
    keys beside bf16 values). The answer: SDPA over the keys rounded to bf16."""
    from weft.plugins.kv_cache.static import StaticCache

    torch.manual_seed(3)
    cache = StaticCache(num_layers=1)
    cache.reserve(7, rows=1)
    prompt = torch.randn(1, 2, 4, 8)  # float32 keys, as mRoPE leaves them
    cache.begin_prefill(keep=None, prompt=4)
    cache.update(prompt, prompt.bfloat16(), 0)
    cache.begin_decode()
    cache.at(4, device=torch.device("cpu"))
    new = torch.randn(1, 2, 1, 8)
    keys, values = cache.update(new, new.bfloat16(), 0)
    assert keys.dtype == values.dtype == torch.bfloat16
    query = torch.randn(1, 4, 1, 8)  # float32
    out, _ = cache._attend(None, query, keys, values, None, scaling=0.25)
    k = torch.cat([prompt, new], dim=2).bfloat16().float()
    want = torch.nn.functional.scaled_dot_product_attention(query.bfloat16().float(), k, k, scale=0.25,
                                                            enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert (out.float().transpose(1, 2) - want).abs().max() < 2e-2
