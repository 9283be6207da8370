"""Split-KV ("flash-decoding") attention of one new token per row over a preallocated cache.

A decoding step has one query per row, (B, Hq, 1, D), and a cache buffer of a fixed
``rows`` (B, Hkv, N, D) of which each row has filled its first ``lengths[b]``. Nothing
here depends on a host-side length: the rows past each row's length are masked from the
device tensor ``lengths``, so every call has the same shapes and the same kernels from
one token to the next, which a captured CUDA graph replays.

The cache dimension is cut into ``splits`` chunks of ``N // splits`` rows (the static
cache sizes its buffer so that the split is exact: ``split_rows``). One batched GEMM gives
every (row, KV head, chunk) its scores, one more its part of P @ V: B x Hkv x splits
independent matrices, so a single query per row still fills the GPU at 128K, where one
GEMM over the whole cache reduces 128K rows in a handful of thread blocks (or leaves it to
the library's choice of split-K). The chunks' parts of P @ V are summed in float32.

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


def split_rows(rows: int, *, chunk: int = CHUNK_ROWS) -> tuple[int, int]:
    """(buffer rows, splits) for a cache of at least ``rows`` rows: ``splits`` chunks of equal
    length covering ``rows`` (the buffer's rows a multiple of ``splits``). The padding is
    less than one row per chunk (at 128K and 2048-row chunks: < 65 rows), and none below
    ``chunk`` rows, where the cache is one chunk."""
    splits = max(1, -(-rows // chunk))
    per_split = -(-rows // splits)
    return per_split * splits, splits


@functools.cache
def _gemm_writes_float32(device: torch.device) -> bool:
    """Whether this torch's GEMMs on ``device`` write bf16 products as float32 (``out_dtype``).
    Asked once per device, by a tiny product: the first decoding steps are eager, so the answer
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
                           lengths: torch.Tensor, scale: float, splits: int = 1) -> torch.Tensor:
    """One query per row ``query`` (B, Hq, 1, D) over ``key``/``value`` (B, Hkv, N, D), row b
    seeing its first ``lengths[b]`` cache rows (``lengths``: (B,) or (1,) long, on the device,
    at least 1). ``splits`` must divide N (else one chunk). Returns (B, Hq, 1, Dv) in the
    query's dtype."""
    b, hq, sq, d = query.shape
    hkv, n, dv = key.shape[1], key.shape[2], value.shape[-1]
    if sq != 1 or hq % hkv:
        raise ValueError(f"split_decode_attention takes one query per row and Hq a multiple of Hkv; got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    if splits < 1 or n % splits:
        splits = 1
    groups, chunk = hq // hkv, n // splits
    # The run's autocast would cast these GEMMs' float32 inputs down: the dtypes are chosen here.
    kind = query.device.type
    with torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext():
        q = query.to(key.dtype).reshape(b, hkv, 1, groups, d)  # (B, Hkv, 1, G, D): head h = kv * G + g
        q = q.expand(b, hkv, splits, groups, d).reshape(b * hkv * splits, groups, d)  # a small copy
        k = key.reshape(b * hkv * splits, chunk, d)  # (B x Hkv x S, C, D): a view of the buffer
        scores = _scores_dtype_bmm(q, k.transpose(1, 2))  # (B x Hkv x S, G, C), float32 or float64
        scores = scores.view(b, hkv, splits, groups, chunk).mul_(scale)
        rows = torch.arange(n, device=key.device).view(1, 1, splits, 1, chunk)
        visible = rows < lengths.reshape(-1, 1, 1, 1, 1)  # (B or 1, 1, S, 1, C)
        scores.masked_fill_(~visible, float("-inf"))
        # One softmax over the row's whole cache (all chunks): its max and sum over (S, C).
        top = scores.amax(dim=(2, 4), keepdim=True)  # (B, Hkv, 1, G, 1): finite, row 0 is visible
        probs = scores.sub_(top).exp_()
        probs = probs.div_(probs.sum(dim=(2, 4), keepdim=True))
        p = probs.to(value.dtype).view(b * hkv * splits, groups, chunk)
        v = value.reshape(b * hkv * splits, chunk, dv)  # a view, as the keys
        parts = _scores_dtype_bmm(p, v)  # (B x Hkv x S, G, Dv): each chunk's part of P @ V
        out = parts.view(b, hkv, splits, groups, dv).sum(dim=2)  # (B, Hkv, G, Dv), float32 sum
    return out.reshape(b, hq, 1, dv).to(query.dtype)
