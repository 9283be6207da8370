"""Split-KV ("flash-decoding") attention of one new token per row over a preallocated cache.

A decoding step has one query per row, (B, Hq, 1, D), and a cache buffer of a fixed
``rows`` (B, Hkv, N, D) of which each row has filled its first ``lengths[b]``. Nothing
here depends on a host-side length: the rows past each row's length are masked from the
device tensor ``lengths``, so every call has the same shapes and the same kernels from
one token to the next, which a captured CUDA graph replays.

One batched GEMM gives every (row, KV head) its scores over the whole cache (its output
tiles spread over the cache's rows); P @ V runs as B x Hkv x ``splits`` independent products
over chunks of ``N // splits`` rows (the static cache sizes its buffer so that the split is
exact: ``split_rows``; a rest past the last whole chunk is one more product), summed in
float32: a single query per row still fills the GPU at 128K, where one product reducing over
the whole cache runs in a handful of thread blocks (or leaves it to the library's choice of
split-K). With ``return_lse`` the scores' log-sum-exp comes too, so partitions of the keys
(a rank's shard, a vision pool, text pages) merge into one softmax
(strategies/attention/sharded_decode.py).

Numerics, as the flash kernels do them:

- grouped-query heads are a view: query head ``h`` reads KV head ``h // G`` (G = Hq / Hkv;
  transformers' ``repeat_kv`` order), so the queries are read as (B, Hkv, G, D) and the
  cache is never repeated or expanded into a copy;
- scores in float32 (on CUDA, bf16/fp16 GEMMs written as float32: ``out_dtype``, no
  float32 copy of the cache), scaled and masked there;
- the softmax over the whole row in float32: one max and one sum over all chunks at once,
  so there is nothing to rescale (no per-chunk log-sum-exp merge: the scores of all
  chunks are in memory anyway, a few MB at 128K);
- P cast to the cache's dtype for P @ V (bf16 P, float32 accumulation: what a flash
  kernel does), the chunks' float32 parts summed, the output in the query's dtype.

Float32 or float64 caches keep everything in their dtype: on the CPU the result is SDPA
over the filled rows to rounding (tests/test_decode_split.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

#: Target rows of one chunk: at 128K, ~64 chunks x Hkv heads -> a few hundred GEMMs per call.
CHUNK_ROWS = 2048


#: Device types with an autocast to switch off (the meta device, the tests' tracing, has none).
_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu")


def split_rows(rows: int, *, chunk: int = CHUNK_ROWS) -> tuple[int, int]:
    """(buffer rows, splits) for a cache of at least ``rows`` rows: ``splits`` chunks of equal
    length covering ``rows`` (the buffer's rows a multiple of ``splits``). The padding is
    less than one row per chunk (at 128K and 2048-row chunks: < 65 rows), and none below
    ``chunk`` rows, where the cache is one chunk."""
    splits = max(1, -(-rows // chunk))
    per_split = -(-rows // splits)
    return per_split * splits, splits


@torch.compiler.assume_constant_result
def _gemm_writes_float32(device: torch.device) -> bool:
    """Whether this torch's GEMMs on ``device`` write bf16 products as float32 (``out_dtype``): a
    constant to torch.compile (a compiled decoding step asks it while tracing, eagerly)."""
    return _probe_gemm_float32(device)


@functools.cache
def _probe_gemm_float32(device: torch.device) -> bool:
    """Asked once per device, by a tiny product: the first decoding steps are eager, so the answer
    is known before a CUDA graph captures the step (a failing call inside a capture would
    spoil it)."""
    a = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
    try:
        torch.bmm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError) as error:  # exact without it, but a float32 copy of the cache a call
        warnings.warn(f"bmm(out_dtype=float32) unavailable on {device} ({error}); split_decode_attention "
                      "copies the cache to float32 at every call", stacklevel=3)
        return False
    return True


def _scores_dtype_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b batched, in float32 at least: bf16/fp16 on CUDA written as float32 by the GEMM
    (no float32 copy of the cache); on the CPU (tests, no such kernel) upcast first."""
    if a.dtype in (torch.float32, torch.float64):
        return torch.bmm(a, b)
    if a.is_cuda and _gemm_writes_float32(a.device):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def split_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                           lengths: torch.Tensor | None, scale: float, splits: int = 1,
                           return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query per row ``query`` (B, Hq, 1, D) over ``key``/``value`` (B, Hkv, N, D), row b
    seeing its first ``lengths[b]`` cache rows (``lengths``: (B,) or (1,) long, on the device,
    at least 1; None: every row). P @ V runs as ``splits`` chunks of ``N // splits`` rows (a
    rest past the last whole chunk as one more product). Returns (B, Hq, 1, Dv) in the query's
    dtype; with ``return_lse`` also the scores' log-sum-exp (B, Hq, 1) in their dtype (float32;
    float64 for a float64 cache), for merging
    with other partitions of the keys (strategies/attention/sharded_decode.py)."""
    b, hq, sq, d = query.shape
    hkv, n, dv = key.shape[1], key.shape[2], value.shape[-1]
    if sq != 1 or hq % hkv:
        raise ValueError(f"split_decode_attention takes one query per row and Hq a multiple of Hkv; got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    groups = hq // hkv
    splits = max(1, min(splits, n))
    chunk = n // splits
    whole = chunk * splits  # the rows in whole chunks; the rest (< one chunk) is one more product
    # The run's autocast would cast these GEMMs' float32 inputs down: the dtypes are chosen here.
    # (Which devices have an autocast is a fixed list, not torch.amp.is_autocast_available: a
    # builtin torch.compile 2.11 cannot trace, a graph break in every layer of a compiled step.)
    kind = query.device.type
    with torch.autocast(kind, enabled=False) if kind in _AUTOCAST_DEVICES else contextlib.nullcontext():
        q = query.to(key.dtype).reshape(b * hkv, groups, d)  # (B x Hkv, G, D): head h = kv * G + g
        scores = _scores_dtype_bmm(q, key.reshape(b * hkv, n, d).transpose(1, 2))  # (B x Hkv, G, N), float32+
        scores = scores.view(b, hkv, groups, n).mul_(scale)
        if lengths is not None:
            visible = torch.arange(n, device=key.device) < lengths.reshape(-1, 1, 1, 1)  # (B or 1, 1, 1, N)
            scores.masked_fill_(~visible, float("-inf"))
        # One softmax over the row's whole cache: its max and sum over N (no per-chunk rescaling).
        top = scores.amax(dim=-1, keepdim=True)  # (B, Hkv, G, 1): finite, row 0 is visible
        probs = scores.sub_(top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        probs = probs.div_(total).to(value.dtype)  # (B, Hkv, G, N)
        # P @ V as B x Hkv x S independent products over chunks of the cache (views of it), the
        # parts summed in float32: a single query still fills the GPU at 128K.
        p = probs[..., :whole].reshape(b, hkv, groups, splits, chunk).transpose(2, 3)  # (B, Hkv, S, G, C)
        v = value[:, :, :whole].reshape(b * hkv * splits, chunk, dv)
        parts = _scores_dtype_bmm(p.reshape(b * hkv * splits, groups, chunk), v)  # (B x Hkv x S, G, Dv)
        out = parts.view(b, hkv, splits, groups, dv).sum(dim=2)  # (B, Hkv, G, Dv)
        if whole < n:
            rest = probs[..., whole:].reshape(b * hkv, groups, n - whole)
            out = out + _scores_dtype_bmm(rest, value[:, :, whole:].reshape(b * hkv, n - whole, dv)).view(
                b, hkv, groups, dv)
    out = out.reshape(b, hq, 1, dv).to(query.dtype)
    if not return_lse:
        return out
    lse = (top + total.log()).reshape(b, hq, 1)  # (B, Hq, 1), the scores' dtype: float32, or float64
    return out, lse
