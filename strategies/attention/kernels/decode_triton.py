"""Split-KV ("flash-decoding") attention of one query token per row over a preallocated cache (Triton).

The same contract as ``split_decode_attention`` (strategies/attention/decode_split.py): one
query per row (B, Hq, 1, D) over a cache (B, Hkv, N, D) of which row b sees its first
``lengths[b]`` rows, read from the device tensor (no host-side length anywhere: every call
launches the same grids with the same arguments, so a captured CUDA graph replays it as the
rows grow). Why a kernel: the torch version writes and rereads the float32 scores and runs a
few hundred small GEMMs per call (~0.5 TB/s at 128K rows on an H200); this one reads each
key and value once.

Two kernels:

- ``split``: grid (B x Hkv, splits). A program takes the G = Hq / Hkv query heads of its KV
  head (padded to 16 rows: tl.dot's smallest tile; the padding is masked on the store), and
  sweeps its split's range of cache rows in ``BLOCK_N``-row blocks, stopping at the row's
  length: an online softmax in float32 (exp2, log2(e) folded into the scale), P cast to the
  cache's dtype for P @ V (what the flash kernels do), accumulated in float32. It writes the
  split's normalised float32 output and log2-sum-exp to scratch; a split wholly past the
  length writes out 0 and lse -inf.
- ``merge``: grid (B x Hq,). The splits' outputs weighted by exp(lse - max), in float32,
  the result in the query's dtype and the natural-log LSE of the scaled scores.

The number of splits depends on (B x Hkv, N) and the GPU's SM count only, never on lengths.
Both kernels run behind one torch operator (``weft::triton_decode``, with a fake
implementation) so that torch.compile traces through the call without a graph break.
"""

from __future__ import annotations

import functools

import torch

_LOG2E = 1.4426950408889634
#: Cache dtypes the kernels take.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Rows of one block of the sweep, warps and pipeline stages of the split kernel, and the
#: programs per SM the split count aims for (more than one, so the last wave is no long tail):
#: measured on one H200 (benchmarks/attention/decode_attention.py --sweep). Read at every call, so the
#: benchmark's sweep can set them. ``pdl``: both kernels launched with programmatic dependent launch
#: (Hopper on), each waiting in its body for the kernel before it (``gdc_wait``) so that its launch
#: overlaps that kernel's tail; off until measured (benchmarks/decode/inductor_options.py). The
#: merge's splits a load (``merge_block_s``), head columns a program (``merge_block_d``) and warps:
#: it is a few microseconds of latency a layer, not bandwidth (decode_attention.py --sweep-merge).
CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "waves": 2, "pdl": False,
          "merge_block_s": 16, "merge_block_d": 128, "merge_warps": 4}
#: The SM count assumed off the GPU (the interpreter's tests): an H200's, so the CPU runs the
#: split layout the GPU would.
DEFAULT_SMS = 132


@functools.cache
def _kernels():
    import triton  # optional: present with torch's CUDA builds
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, K, V, LENGTHS, O_PART, L_PART,
        sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sl,
        kv_heads, groups, n_rows, head_dim, split_rows, num_splits, qk_scale2,
        HAS_LENGTHS: tl.constexpr, DOT_F32: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # launched early: the query and the cache's new row are the kernels' before this one's
            tl.extra.cuda.gdc_wait()
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // kv_heads).to(tl.int64)  # int64: b x its stride passes 2^31 elements at large batches
        kvh = (bh % kv_heads).to(tl.int64)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_ok = offs_g < groups
        d_ok = offs_d < head_dim
        heads = kvh * groups + offs_g  # query head h = kv * G + g (transformers' repeat_kv order)
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + offs_d[None, :] * sqd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (G_PAD, D_PAD)
        q = q.to(K.dtype.element_ty)  # the scores of the cache's dtype, as split_decode_attention's
        if HAS_LENGTHS:
            length = tl.minimum(tl.load(LENGTHS + b * sl).to(tl.int32), n_rows)
        else:
            length = n_rows
        start = split * split_rows
        end = tl.minimum(start + split_rows, length)  # <= start: a split past the length, no block
        m = tl.full((G_PAD,), float("-inf"), tl.float32)  # running max, log2 units
        total = tl.zeros((G_PAD,), tl.float32)  # running sum of exp2(s - m)
        acc = tl.zeros((G_PAD, D_PAD), tl.float32)
        k_base = K + b * skb + kvh * skh
        v_base = V + b * svb + kvh * svh
        if DOT_F32:  # float32 operands (exact products of the rounded inputs): float32 caches, the interpreter
            q = q.to(tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)  # (BN, D)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
            p_dtype = v.dtype
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (G_PAD, BN)
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(n_ok[None, :], s * qk_scale2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every block has a visible row
            alpha = tl.exp2(m - m_new)  # 0 at the first block (m = -inf)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            p = p.to(p_dtype)  # P in the cache's dtype for P @ V, float32 accumulation
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m = m_new
        if PDL:  # the merge may launch now (it waits for this grid's end in its own body)
            tl.extra.cuda.gdc_launch_dependents()
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # an empty split: 0, not 0 / 0
        lse2 = m + tl.log2(total)  # an empty split: -inf
        row = (b * kv_heads * groups + heads) * num_splits + split  # (G_PAD,): scratch (B x Hq, S[, D])
        tl.store(O_PART + row[:, None] * head_dim + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(L_PART + row, lse2, mask=g_ok)

    @triton.jit
    def merge_kernel(
        O_PART, L_PART, OUT, LSE, num_splits, head_dim,
        S_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)  # b x Hq + h
        part = tl.program_id(1)  # which BLOCK_D columns of the head
        offs_s = tl.arange(0, S_PAD)
        offs_d = part * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        lse2 = tl.load(L_PART + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        top = tl.max(lse2, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # no visible row at all: out 0, lse -inf (not NaN)
        total = tl.sum(tl.exp2(lse2 - top), 0)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):  # blocks of splits: the tile stays small at any count
            offs = s0 + tl.arange(0, BLOCK_S)
            ok = offs < num_splits
            w = tl.exp2(tl.load(L_PART + row * num_splits + offs, mask=ok, other=float("-inf")) - top)  # (BS,)
            o = tl.load(O_PART + (row * num_splits + offs[:, None]) * head_dim + offs_d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)  # (BS, BLOCK_D)
            acc += tl.sum(w[:, None] * o, 0)
        out = acc / tl.where(total > 0, total, 1.0)
        tl.store(OUT + row * head_dim + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)
        if part == 0:
            tl.store(LSE + row, (top + tl.log2(total)) * 0.6931471805599453)  # natural log

    return triton, split_kernel, merge_kernel


def triton_decode_available(device: torch.device | str) -> bool:
    """Whether the kernels can run on ``device``: a CUDA device and an importable Triton."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_decode_takes(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``triton_decode_attention`` runs over this cache here: its device (CUDA with
    Triton), its dtype, and values as wide as the keys."""
    return (key.dtype in DTYPES and value.dtype == key.dtype and value.shape[-1] == key.shape[-1]
            and triton_decode_available(key.device))


@torch.compiler.assume_constant_result  # a host query of the device (torch caches it): a constant to torch.compile
def sm_count(device: torch.device) -> int:
    """The device's SM count (``DEFAULT_SMS`` off CUDA). A caller that decodes through a compiled
    step asks it before the step (``split_plan``): the trace then holds no host query at all."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits(batch_heads: int, rows: int, *, sms: int, block_n: int | None = None,
               waves: int | None = None) -> tuple[int, int]:
    """(splits, rows per split) for ``batch_heads`` = B x Hkv programs' worth of work over a
    ``rows``-row cache: enough splits that the grid has ~``waves`` programs per SM, each split
    a whole number of ``block_n``-row blocks. A function of the shapes alone (never of the
    lengths): one captured graph serves every token."""
    block_n, waves = block_n or CONFIG["BLOCK_N"], waves or CONFIG["waves"]
    blocks = _cdiv(rows, block_n)
    wanted = max(1, _cdiv(waves * sms, batch_heads))  # splits per (row, KV head)
    per_split = _cdiv(blocks, min(wanted, blocks)) * block_n
    return _cdiv(rows, per_split), per_split


def split_plan(key: torch.Tensor, *, splits: int | None = None) -> tuple[int, int]:
    """(splits, rows per split) for a cache ``key`` (B, Hkv, N, D) on its device: what
    ``triton_decode_attention`` takes as ``plan``, asked once where the shapes are fixed.
    ``splits``: about that many instead (tests, tuning): whole blocks each, so the count may shrink."""
    b, hkv, n = key.shape[:3]
    if splits is None:
        return num_splits(b * hkv, n, sms=sm_count(key.device))
    block = CONFIG["BLOCK_N"]
    per_split = _cdiv(_cdiv(n, max(1, splits)), block) * block
    return _cdiv(n, per_split), per_split


@torch.library.custom_op("weft::triton_decode", mutates_args=())
def _triton_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor | None,
                   scale: float, splits: int, split_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    triton, split_kernel, merge_kernel = _kernels()
    b, hq, _, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    groups = hq // hkv
    o_part = torch.empty(b * hq, splits, d, dtype=torch.float32, device=query.device)  # every split is written
    l_part = torch.empty(b * hq, splits, dtype=torch.float32, device=query.device)
    length_stride = 0
    if lengths is not None:
        lengths = lengths.reshape(-1)  # (B,) or (1,): one length for every row (stride 0)
        length_stride = 0 if lengths.numel() == 1 else lengths.stride(0)
    d_pad = max(16, triton.next_power_of_2(d))
    pdl = bool(CONFIG["pdl"]) and query.is_cuda
    launch = {"launch_pdl": True} if pdl else {}  # only where asked: a Triton without it takes no such key
    split_kernel[(b * hkv, splits)](
        query, key, value, lengths if lengths is not None else key, o_part, l_part,
        query.stride(0), query.stride(1), query.stride(3), *key.stride(), *value.stride(),
        length_stride,
        hkv, groups, n, d, split_rows, splits, scale * _LOG2E,
        HAS_LENGTHS=lengths is not None,
        DOT_F32=key.dtype == torch.float32 or not key.is_cuda,  # off CUDA: Triton's interpreter (tests)
        G_PAD=max(16, triton.next_power_of_2(groups)), D_PAD=d_pad, BLOCK_N=CONFIG["BLOCK_N"], PDL=pdl,
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"], **launch,
    )
    out = torch.empty(b, hq, 1, d, dtype=query.dtype, device=query.device)  # (B, Hq, 1, D)
    lse = torch.empty(b, hq, 1, dtype=torch.float32, device=query.device)  # (B, Hq, 1)
    s_pad = triton.next_power_of_2(splits)
    block_d = min(d_pad, CONFIG["merge_block_d"])
    merge_kernel[(b * hq, triton.cdiv(d, block_d))](
        o_part, l_part, out, lse, splits, d, S_PAD=s_pad, BLOCK_S=min(s_pad, CONFIG["merge_block_s"]),
        BLOCK_D=block_d, PDL=pdl, num_warps=CONFIG["merge_warps"], **launch)
    return out, lse


@_triton_decode.register_fake
def _(query, key, value, lengths, scale, splits, split_rows):
    b, hq, _, d = query.shape
    return query.new_empty(b, hq, 1, d), query.new_empty(b, hq, 1, dtype=torch.float32)


def triton_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                            lengths: torch.Tensor | None, scale: float, return_lse: bool = False,
                            plan: tuple[int, int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query per row ``query`` (B, Hq, 1, D) over ``key``/``value`` (B, Hkv, N, D), any
    strides, row b seeing its first ``lengths[b]`` cache rows (``lengths``: (B,) or (1,)
    integer, on the device; None: every row). Returns (B, Hq, 1, D) in the query's dtype;
    with ``return_lse`` also the natural-log log-sum-exp of the scaled scores (B, Hq, 1),
    float32 (a row with no visible key: out 0, lse -inf). ``plan``: ``split_plan(key)``, asked
    beforehand (a compiled step's cache does, so its trace has no host query; tests and tuning
    ask it with their own split count); by default ``split_plan`` here."""
    _, hq, sq, d = query.shape
    hkv = key.shape[1]
    if sq != 1 or hq % hkv or value.shape[:3] != key.shape[:3] or value.shape[-1] != d or key.shape[-1] != d:
        raise ValueError(f"triton_decode_attention takes one query per row, Hq a multiple of Hkv and equal head "
                         f"sizes; got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.dtype not in DTYPES or value.dtype != key.dtype:
        raise ValueError(f"triton_decode_attention takes a bf16, fp16 or float32 cache; got {key.dtype}, "
                         f"{value.dtype}")
    splits, per_split = plan if plan is not None else split_plan(key)
    out, lse = _triton_decode(query, key, value, lengths, float(scale), splits, per_split)
    return (out, lse) if return_lse else out
