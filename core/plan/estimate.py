"""Before launching: per-rank GPU memory and host memory of a recipe, by arithmetic (its step
time: core/plan/step_time.py, on the units and shape defined here).

``weft plan RECIPE --estimate`` answers "does it fit, how fast, how long can I go" from the
plan alone: the units' parameter counts and shard rules, the model's shape, the mesh and
the sequence length, and a small table of measured rates per GPU kind. Nothing runs on a
GPU. The memory model counts what a step holds at its peak, in torch's own accounting
(``max_memory_allocated``): weights, gradients and AdamW states (a frozen base's weights
only, its adapters' all three); FSDP2's gathered copies; every layer's saved activations by
its checkpoint mode; then the larger of the loss's working memory and one layer's
recomputation. Coefficients that depend on kernels, not arithmetic (what a layer saves, how
much a recomputation holds at once) were fitted to measured 7B runs on one H200 and are named,
with the runs, in core/plan/coefficients.py; the tests check the arithmetic against hand sums
and the model against measurements.
Plain arithmetic (no torch): ``estimate_inputs`` builds its inputs from a plan.
"""

from __future__ import annotations

import math
from typing import Callable

import attrs

from weft.core.plan.coefficients import (
    ADAPTER_RECOMPUTE_MLP,
    BY_HAND_RECOMPUTE_MLP,
    FLOAT8_MLP_SAVED,
    FLOAT8_RECOMPUTE_MLP,
    FUSED_LOSS_CHUNKS,
    GIB,
    LAYER_SAVED,
    LOGITS_LOSS_CHUNKS,
    MLP_SAVED,
    NF4_BYTES,
    RECOMPUTE_ATTENTION,
    RECOMPUTE_MLP,
    RECOMPUTE_OFFLOADED,
    TILED_RECOMPUTE_MLP,
)


@attrs.frozen(kw_only=True)
class Shape:
    """The model's sizes the arithmetic needs (text decoder, optional vision tower)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_params: int  # one decoder layer's parameters
    vision_hidden: int = 0
    vision_intermediate: int = 0
    vision_blocks: int = 0
    vision_params: int = 0


@attrs.frozen(kw_only=True)
class Unit:
    """One shard unit (or the root: what no unit owns) as its rule decided it."""

    path: str
    modality: str | None
    params: int  # its own, not those of units inside it
    strategy: str  # its shard rule's strategy, as `weft plan` names it
    storage_bytes: int
    checkpoint: str = "off"
    offload_activations: bool = False
    #: With offload_activations: only every Nth offloaded unit's input in host memory; the others
    #: regenerated in backward by one more forward of the unit before (strategies/memory/activation_offload.py).
    offload_keep_every: int = 1
    offload: bool = False
    mlp_tile_tokens: int = 0
    trainable: bool = True  # False: a frozen unit (no gradients, no optimizer states)
    adapter_params: int = 0  # its adapters' (LoRA's r x (in + out) per layer): trained, beside ``params``
    quantized_params: int = 0  # of ``params``, the linear weights stored in 4 bits (``quantize = "nf4"``)
    state_bytes: float | None = None  # optimizer state per parameter; None: two moments in the storage dtype
    float8: str = ""  # matmul = "float8" by rule: its float8_recipe (the scaling); "": the storage dtype's products
    compiled: bool = False  # compile = true by rule: its children through torch.compile
    source: str = ""
    #: What its strategy's record declares (core/registry.py Strategy): the mesh dims whose ranks split
    #: its weights, gradients and optimizer states, and whether it is gathered whole around its
    #: forward and backward (FSDP's way). The defaults: kept whole on every rank.
    shard_dims: tuple[str, ...] = ()
    gathers: bool = False


@attrs.frozen(kw_only=True)
class Setup:
    tokens: int  # one micro-batch's whole sequence
    patches: int = 0  # vision patches per micro-batch (before merging)
    rows: int = 1  # the micro-batch's sequences, tokens / rows each: attention stays inside each
    dp_shard: int = 1
    dp_replicate: int = 1
    ring: int = 1
    ulysses: int = 1
    loss: str = "fused"
    micro_batches: int = 1  # per rank per step (train.step_tokens): gradients from the first live in the rest

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    @property
    def fsdp(self) -> int:
        """Ranks an FSDP2 unit is sharded over: dp_shard x the SP ranks."""
        return self.dp_shard * self.sp

    def ranks(self, dims: tuple[str, ...]) -> int:
        """The ranks of the mesh dims ``dims`` (a unit's ``shard_dims``): the product of their degrees."""
        return math.prod(getattr(self, dim) for dim in dims)


@attrs.frozen(kw_only=True)
class Contribution:
    """What one of the root's strategies adds to the estimate: its record's ``estimate_memory`` and
    ``estimate_time`` with its rule's params bound, called as ``memory(units=, shape=, setup=)`` and
    ``seconds(units=, shape=, setup=, gpu=)``, each {part: amount}."""

    source: str  # the deciding rule (file:line)
    memory: Callable[..., dict] | None = None
    seconds: Callable[..., dict] | None = None


def add_parts(part: dict[str, float], more: dict[str, float]) -> None:
    """A contribution's parts into the table: its own names as rows, the core's added to theirs."""
    for name, value in more.items():
        part[name] = part.get(name, 0.0) + value


def memory(units: list[Unit], shape: Shape, setup: Setup, *, extra: tuple[Contribution, ...] = ()) -> dict[str, float]:
    """Per-rank bytes at the step's peak, by part; ``total`` their sum; ``extra``: the root's
    strategies' own parts."""
    tokens = setup.tokens / setup.sp  # this rank's share of the sequence
    layer_in = tokens * shape.hidden * 2  # one layer's input, bf16
    part = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0}
    host_static = 0.0
    for u in units:
        shard = setup.ranks(u.shard_dims)
        trained = _trained(u)  # a frozen base's weights only; its adapters' gradients and states too
        if u.offload:  # FSDP2 offload: shards, gradients and states live on the CPU
            host_static += ((u.params + u.adapter_params) + 3 * trained) * u.storage_bytes / shard
            continue
        part["weights"] += ((u.params - u.quantized_params + u.adapter_params) * u.storage_bytes
                            + u.quantized_params * NF4_BYTES) / shard
        part["gradients"] += trained * u.storage_bytes / shard
        per = 2 * u.storage_bytes if u.state_bytes is None else u.state_bytes
        part["optimizer"] += trained * per / shard
    fsdp = [u for u in units if u.gathers]
    # A gathered unit's bytes: bf16, its 4-bit weights as their codes and scalers (what FSDP2 gathers).
    largest = max((((u.params - u.quantized_params + u.adapter_params) * 2 + u.quantized_params * NF4_BYTES)
                   for u in fsdp if u.modality is not None), default=0)
    # A unit's gradients in float32 for the reduce-scatter (none over one rank).
    reduced = max((_trained(u) * 4 for u in fsdp if u.modality is not None and setup.ranks(u.shard_dims) > 1),
                  default=0)
    root = next((u for u in fsdp if u.modality is None), None)
    # FSDP2 gathers a unit (and prefetches the next); the root's own weights (embedding,
    # head) stay gathered from forward to backward when the fused loss reads the head.
    part["gathered"] = 2 * largest + (root.params * 2 if root is not None and setup.loss == "fused" else 0)
    text = [u for u in units if u.modality == "text"]
    part["activations"] = sum(0.0 if u.offload_activations else
                              layer_saved(u.checkpoint, shape, layer_in, tokens, tiled=u.mlp_tile_tokens > 0,
                                          mlp_saved=FLOAT8_MLP_SAVED.get(u.float8, MLP_SAVED) if u.compiled
                                          else MLP_SAVED)
                              for u in text)
    vision = [u for u in units if u.modality == "vision"]
    patches = setup.patches / setup.sp  # images are spread over the SP ranks
    if vision and shape.vision_hidden and backward_reaches(vision):
        v_in = patches * shape.vision_hidden * 2
        v_shape = attrs.evolve(shape, hidden=shape.vision_hidden, intermediate=shape.vision_intermediate)
        part["vision"] = sum(layer_saved(u.checkpoint, v_shape, v_in, patches) for u in vision)
    else:
        part["vision"] = 0.0
    recompute = max(((RECOMPUTE_OFFLOADED if u.offload_activations else RECOMPUTE_ATTENTION) * layer_in
                     + _recompute_mlp(u) * _mlp_rows(u, tokens) * shape.intermediate * 2
                     # a tiled MLP's 4-bit weights expanded to 16 bits while its tiles run (tiled_mlp.py)
                     + 6 * shape.hidden * shape.intermediate * bool(u.quantized_params and u.mlp_tile_tokens)
                     for u in text if u.checkpoint != "off"), default=0.0)
    head = all(u.trainable for u in units if u.modality is None)  # a frozen head has no gradient
    if setup.loss == "fused":  # the head's gradient summed in float32 over the chunks, kept to the step's end
        loss, head_grad = FUSED_LOSS_CHUNKS, shape.vocab * shape.hidden * 4 * head
    else:  # bf16 logits, their gradient in their storage
        loss, head_grad = tokens * shape.vocab * 2 + LOGITS_LOSS_CHUNKS, shape.vocab * shape.hidden * 2 * head
    # The loss runs before any layer's backward; the hidden states' gradient then flows down.
    part["loss or recomputation"] = max(loss, recompute) + layer_in
    # The backward frees each layer's saved activations as it makes that layer's gradients, so its
    # peak is at one end: at its first layer, every layer's activations held and of the gradients
    # only the head's (a snapshot of the 7B 128K 4-layer slice: BENCHMARKS.md, issue 46), or at
    # its last, where every gradient is made (activations offloaded: none held). The fused loss
    # only: the logits loss keeps every gradient, as fitted (its 32K slice peaks at the loss with no
    # gradient, but the whole 32K recipe holds ~0.5 GiB a layer more than that explains; docs/
    # estimate.md). Several micro-batches a step: the first one's gradients live through the rest.
    every = part["gradients"]
    if setup.loss == "fused" and setup.micro_batches == 1 and head_grad + part["activations"] >= every:
        part["gradients"] = head_grad
    else:  # every gradient counted in the storage dtype; the float32 sum's surplus beside it
        part["loss or recomputation"] += max(0, head_grad - shape.vocab * shape.hidden * 2 * head)
    part["communication"] = _comm_buffers(shape, setup, tokens, reduced)
    for c in extra:
        add_parts(part, c.memory(units=units, shape=shape, setup=setup) if c.memory is not None else {})
    part["total"] = sum(part.values())
    # The first step: AdamW makes its states in its first optimizer step, after the backward,
    # so that step's peak is the larger of the backward's (without states) and the states'.
    states = part["weights"] + every + part["optimizer"]
    part["first step"] = max(part["total"] - part["optimizer"], states)
    part["host"] = host_static + _host(units, layer_in) + 8 * GIB
    return part


def _trained(u: Unit) -> int:  # parameters with gradients and optimizer states
    return u.params * u.trainable + u.adapter_params


def backward_reaches(units: list[Unit]) -> bool:  # nothing trained in it: no backward, nothing saved
    return any(_trained(u) for u in units)


def mlp_by_hand(unit: Unit) -> bool:
    """Whether a recomputed MLP of this unit is made again by hand, gate and up products only
    (plugins/shard/levers.py ``recomputed_swiglu``, strategies/memory/swiglu.py): its projections
    plain linear layers or PEFT's LoRA over them (4-bit or not), so anything but float8's. The
    estimate takes an adapter to be LoRA: DoRA keeps the module's own forward."""
    return not unit.float8


def _recompute_mlp(unit: Unit) -> float:
    """The MLP's intermediates (in rows x intermediate x 2 bytes) a layer's recomputation holds at once."""
    if unit.mlp_tile_tokens:
        return TILED_RECOMPUTE_MLP
    if mlp_by_hand(unit):
        return BY_HAND_RECOMPUTE_MLP
    whole = unit.checkpoint in ("except_attention", "full")
    mlp = FLOAT8_RECOMPUTE_MLP.get(unit.float8, RECOMPUTE_MLP) if whole else RECOMPUTE_MLP
    return mlp + ADAPTER_RECOMPUTE_MLP * bool(unit.adapter_params)


def _mlp_rows(unit: Unit, tokens: float) -> float:
    """Rows of the MLP's intermediates that exist at once: a tile's, or the whole sequence's."""
    return min(tokens, unit.mlp_tile_tokens) if unit.mlp_tile_tokens else tokens


def layer_saved(mode: str, shape: Shape, layer_in: float, tokens: float, *, tiled: bool = False,
                mlp_saved: float = MLP_SAVED) -> float:
    """Bytes one layer keeps between its forward and backward under checkpoint ``mode`` (a
    tiled MLP keeps only its input: its intermediates are made again in the backward;
    ``mlp_saved``: the MLP's intermediates kept, a float8 layer's fewer)."""
    saved = LAYER_SAVED[mode] * layer_in
    if mode in ("off", "attention") and not tiled:
        saved += mlp_saved * tokens * shape.intermediate * 2
    if mode == "except_attention":
        saved += tokens * shape.heads * 4  # the LSE, float32 per head and token
    return saved


def _comm_buffers(shape: Shape, setup: Setup, tokens: float, reduced: float) -> float:
    ring = 2 * tokens * 2 * shape.kv_heads * shape.head_dim * 2 if setup.ring > 1 else 0  # K/V in flight
    ulysses = 2 * tokens * (shape.hidden + 2 * shape.kv_heads * shape.head_dim) * 2 if setup.ulysses > 1 else 0
    return ring + ulysses + reduced


def _host(units: list[Unit], layer_in: float) -> float:
    """Pinned host buffers: each offloaded unit's input from its forward to its backward."""
    return sum(layer_in for u in offload_kept(units))


def offload_kept(units: list[Unit]) -> list[Unit]:
    """The offloaded decoder units whose input waits in host memory: every one, or every Nth in
    forward order (``offload_keep_every``; each thinning counted over its own units, as the lever
    groups them); the rest regenerate theirs."""
    offloaded = [u for u in units if u.offload_activations and u.modality == "text"]
    kept = []
    for every in sorted({u.offload_keep_every for u in offloaded}):
        kept += [u for i, u in enumerate(v for v in offloaded if v.offload_keep_every == every) if i % every == 0]
    return kept


def longest_fit(fits, *, low: int, high: int, multiple: int = 1024) -> int | None:
    """The largest length in [low, high], a multiple of ``multiple``, for which ``fits(length)``
    holds (memory grows with length), or None when not even ``low`` fits."""
    lo, hi = math.ceil(low / multiple), high // multiple
    if lo > hi or not fits(lo * multiple):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * multiple):
            lo = mid
        else:
            hi = mid - 1
    return lo * multiple
