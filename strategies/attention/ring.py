"""Ring attention: K/V blocks travel around the ring while each rank merges partial outputs.

Forward: at step i a rank attends its queries to the K/V block that started on
rank (r - i) mod W, while the next block is already in flight (async send/recv
overlapped with the block's compute). Partial outputs are merged in float32
(float64 for float64 inputs) with the log-sum-exp update
``lse' = logaddexp(lse, l); out' = out * exp(lse - lse') + o * exp(l - lse')``.
Backward runs its own ring: K/V travel again, and a dK/dV buffer travels with
them collecting every rank's contribution, arriving home after W hops.

Layouts (see ``sequence_shard``): ``zigzag`` gives each rank chunks r and
2W-1-r, so under a causal mask every step costs every rank the same; with
``contiguous`` the ranks late in the sequence do more work.
GQA: K/V travel with their own (fewer) heads and are expanded per block;
their gradients are summed back over each head group.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import torch.distributed as dist

from weft.strategies.attention.kernels.blocks import BlockKernel, expand_kv_heads, select_kernel
from weft.strategies.sequence.layout import LAYOUTS

_ALL = slice(None)


@attrs.frozen
class Block:
    """One ring step's work for one rank: query rows x key rows of the local tensors."""

    q: slice
    kv: slice
    causal: bool


def block_for(*, rank: int, src: int, world: int, layout: str, causal: bool, local_len: int) -> Block | None:
    """What rank ``rank`` computes against the K/V block that started on rank ``src``.

    None: nothing (a contiguous-layout block entirely in the future).
    """
    if not causal:
        return Block(_ALL, _ALL, False)
    if src == rank:
        return Block(_ALL, _ALL, True)  # own chunks: positions increase, so plain causal is exact
    if layout == "contiguous":
        return Block(_ALL, _ALL, False) if src < rank else None
    half = local_len // 2
    if src < rank:
        # Chunks src and 2W-1-src; only chunk src lies before both of ours.
        return Block(_ALL, slice(0, half), False)
    # src > rank: both K/V chunks lie before our tail chunk 2W-1-r, after our head chunk r.
    return Block(slice(half, None), _ALL, False)


class _Ring:
    """Neighbour exchange on one process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send to the next rank and receive from the previous one, asynchronously."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _reduce(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(dim=2)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    block_lse = block_lse.to(lse.dtype)
    empty = torch.isneginf(block_lse)  # rows this block masks out entirely (packed documents)
    weight = torch.where(empty, 0.0, torch.sigmoid(block_lse - lse)).unsqueeze(-1)  # (B, H, S, 1)
    out.lerp_(torch.where(empty.unsqueeze(-1), 0.0, block_out.to(out.dtype)), weight)
    lse.copy_(torch.logaddexp(lse, block_lse))


@functools.cache
def _fused_merge():
    # On CUDA the merge is memory-bound: compiled, its five element-wise passes become one
    # kernel (one read of out/block_out/lse, one write). dynamic=True: one compile for every
    # block length. CPU runs (tests, float64) use the eager ops.
    return torch.compile(_merge, dynamic=True)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running (out, lse) in place.

    With w = exp(l - logaddexp(lse, l)) = sigmoid(l - lse), the two weights sum to
    one, so the update is a single lerp: out + w * (o - out). Stable for any
    magnitudes, and the first block (lse = -inf) gives w = 1 exactly.
    """
    (_fused_merge() if out.is_cuda else _merge)(out, lse, block_out, block_lse)


def _operands(kernel: BlockKernel, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if kernel.strided else t.contiguous() for t in tensors]


def attend_block(
    q, kv, *, block: Block, groups: int, scale: float, kernel: BlockKernel, out, lse, first: bool = False, mask=None
) -> None:
    """One ring step's forward for one rank: attend, then merge into (out, lse).

    ``first``: nothing merged yet for these rows, so the block's result is copied
    in instead of merged (one pass over the accumulator saved). ``mask``: the block's
    document mask (B, 1, Sq, Sk), which replaces its causal flag.
    """
    expand = 1 if kernel.gqa else groups
    qb, kb, vb = _operands(
        kernel, q[:, :, block.q], expand_kv_heads(kv[0][:, :, block.kv], expand),
        expand_kv_heads(kv[1][:, :, block.kv], expand),
    )
    extra = {} if mask is None else {"mask": mask}
    block_out, block_lse = kernel.forward(qb, kb, vb, causal=block.causal and mask is None, scale=scale, **extra)
    if first and mask is None:
        out[:, :, block.q].copy_(block_out)
        lse[:, :, block.q].copy_(block_lse)
    else:
        merge_block(out[:, :, block.q], lse[:, :, block.q], block_out, block_lse)


def attend_block_backward(
    dout, q, kv, out, lse, *, block: Block, groups: int, scale: float, kernel: BlockKernel, dq, dkv, mask=None
) -> None:
    """One ring step's backward for one rank: add this block's dQ and dK/dV in place."""
    if kernel.accumulate is not None:
        # The kernel adds into the float32 buffers itself: no per-block rounding.
        extra = {} if mask is None else {"mask": mask}
        kernel.accumulate(
            dout[:, :, block.q], q[:, :, block.q], kv[0][:, :, block.kv], kv[1][:, :, block.kv],
            out[:, :, block.q], lse[:, :, block.q],
            causal=block.causal and mask is None, scale=scale,
            dq=dq[:, :, block.q], dk=dkv[0][:, :, block.kv], dv=dkv[1][:, :, block.kv], **extra,
        )
        return
    expand = 1 if kernel.gqa else groups
    operands = _operands(
        kernel, dout[:, :, block.q], q[:, :, block.q],
        expand_kv_heads(kv[0][:, :, block.kv], expand), expand_kv_heads(kv[1][:, :, block.kv], expand),
        out[:, :, block.q],
    )
    extra = {} if mask is None else {"mask": mask}
    dq_b, dk_b, dv_b = kernel.backward(
        *operands, lse[:, :, block.q].contiguous(), causal=block.causal and mask is None, scale=scale, **extra
    )
    dq[:, :, block.q] += dq_b
    dkv[0][:, :, block.kv] += _reduce(dk_b, expand)
    dkv[1][:, :, block.kv] += _reduce(dv_b, expand)


class _Documents:
    """Global document ids and positions of a packed sequence, for per-block masks."""

    def __init__(self, doc_ids: torch.Tensor, *, world: int, layout: str, causal: bool) -> None:
        from weft.strategies.sequence.layout import sequence_index

        self.doc_ids, self.causal = doc_ids, causal  # (B, S_global)
        seq = doc_ids.shape[1]
        self.index = [sequence_index(seq, rank=r, world=world, layout=layout).to(doc_ids.device) for r in range(world)]

    def mask(self, *, rank: int, src: int, block: Block) -> torch.Tensor | None:
        """(B, 1, Sq, Sk) for ``block``, or None when no query may see any key (skip it)."""
        from weft.strategies.attention.document_mask import document_mask

        idx_q, idx_k = self.index[rank][block.q], self.index[src][block.kv]
        mask = document_mask(self.doc_ids[:, idx_q], self.doc_ids[:, idx_k], idx_q, idx_k, causal=self.causal)
        return mask if bool(mask.any()) else None


def _step_work(*, rank: int, src: int, world: int, layout: str, causal: bool, local_len: int, docs: _Documents | None):
    """(block, document mask or None) for this rank against ``src``'s K/V, or None: nothing to do."""
    block = block_for(rank=rank, src=src, world=world, layout=layout, causal=causal, local_len=local_len)
    if block is None or docs is None:
        return None if block is None else (block, None)
    mask = docs.mask(rank=rank, src=src, block=block)
    return None if mask is None else (block, mask)


def accumulators(q, v):
    """A row block's running output and log-sum-exp, zero and -inf, in the merge dtype."""
    b, h, s, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(b, h, s, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _forward(
    q,
    k,
    v,
    *,
    ring: _Ring,
    causal: bool,
    scale: float,
    layout: str,
    kernel: BlockKernel,
    docs: _Documents | None = None,
):

    s = q.shape[2]  # (B, H, S_local, D)
    groups = q.shape[1] // k.shape[1]
    out, lse = accumulators(q, v)
    kv = torch.stack([k, v])  # (2, B, KV, S_local, D): one message per step
    for step in range(ring.world):
        if step + 1 < ring.world:
            incoming, works = ring.exchange(kv)
        work = _step_work(
            rank=ring.rank,
            src=(ring.rank - step) % ring.world,
            world=ring.world,
            layout=layout,
            causal=causal,
            local_len=s,
            docs=docs,
        )
        if work is not None:
            block, mask = work
            attend_block(
                q,
                kv,
                block=block,
                groups=groups,
                scale=scale,
                kernel=kernel,
                out=out,
                lse=lse,
                first=step == 0,
                mask=mask,
            )
        if step + 1 < ring.world:
            _wait(works)
            kv = incoming
    return out.to(q.dtype), lse


def _backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    ring: _Ring,
    causal: bool,
    scale: float,
    layout: str,
    kernel: BlockKernel,
    docs: _Documents | None = None,
):
    s = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    travelling = None  # (recv buffer, works): the dK/dV buffer arriving from the previous rank
    for step in range(ring.world):
        if step + 1 < ring.world:
            incoming, works = ring.exchange(kv)
        work = _step_work(
            rank=ring.rank,
            src=(ring.rank - step) % ring.world,
            world=ring.world,
            layout=layout,
            causal=causal,
            local_len=s,
            docs=docs,
        )
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this block's gradient, (2, B, KV, S, D)
        if work is not None:
            block, mask = work
            attend_block_backward(
                dout,
                q,
                kv,
                out,
                lse,
                block=block,
                groups=groups,
                scale=scale,
                kernel=kernel,
                dq=dq,
                dkv=dkv,
                mask=mask,
            )
        if travelling is not None:
            _wait(travelling[1])
            dkv += travelling[0]
        # Pass the block's gradient on with the block; after W hops it is home.
        travelling = ring.exchange(dkv) if ring.world > 1 else (dkv, [])
        if step + 1 < ring.world:
            _wait(works)
            kv = incoming
    _wait(travelling[1])
    dkv = travelling[0]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, backend, doc_ids):
        ring = _Ring(group)
        kernel = select_kernel(
            backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1], masked=doc_ids is not None
        )
        docs = None if doc_ids is None else _Documents(doc_ids, world=ring.world, layout=layout, causal=causal)
        out, lse = _forward(q, k, v, ring=ring, causal=causal, scale=scale, layout=layout, kernel=kernel, docs=docs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (ring, causal, scale, layout, kernel, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale, layout, kernel, docs = ctx.config
        dq, dk, dv = _backward(
            dout, q, k, v, out, lse, ring=ring, causal=causal, scale=scale, layout=layout, kernel=kernel, docs=docs
        )
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    scale: float | None = None,
    layout: str = "zigzag",
    backend: str = "auto",
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence split across ``group``'s ranks.

    q: (B, H, S_local, D); k, v: (B, KV, S_local, D) with H % KV == 0 (GQA);
    this rank's part of the sequence in ``layout`` (see ``sequence_shard``).
    ``doc_ids``: (B, S_global) document ids of the whole packed sequence; attention then
    stays inside each document (blocks with no shared document are skipped).
    Returns (B, H, S_local, D) in q's dtype. Differentiable (own backward ring).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown ring layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "ring_attention takes (batch, heads, seq, head_dim) tensors, "
            f"got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}, {v.shape[1]})"
        )
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(
            f"q, k, v must hold the same local sequence length, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}"
        )
    if dist.get_world_size(group if group is not None else dist.group.WORLD) == 1:
        layout = "contiguous"  # one rank holds the whole sequence: no halves to balance
    if causal and layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(
            f"zigzag layout: the local sequence holds two equal chunks, so its length must be even; got {q.shape[2]}"
        )

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, scale, layout, backend, doc_ids)
