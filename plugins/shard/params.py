"""What a shard rule decides (its params, one class a strategy) and the plan-time checks of
those decisions; plugins/shard/levers.py and plugins/shard/fsdp2_steps.py apply them."""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.recipe.convert import in_range
from weft.strategies.model.float8_scalings import Scaling as Float8Scaling

Dtype = Literal["float32", "bfloat16", "float16"]
Checkpoint = Literal["off", "full", "attention", "mlp", "except_attention"]


@attrs.frozen(kw_only=True)
class KeepParams:
    """What a unit's rule decides whatever its sharding (``none``, and ``fsdp2`` besides)."""

    storage_dtype: Dtype | None = attrs.field(default=None, metadata={
        "doc": "dtype the unit's weights, gradients and AdamW states are kept in; unset = float32"})
    checkpoint: Checkpoint = attrs.field(default="off", metadata={
        "doc": "activation checkpointing of the unit: off, full, selective (attention / mlp child only), or "
               "except_attention (all but the attention kernel, whose outputs are kept)"})
    compile: bool = attrs.field(default=False, metadata={
        "doc": "torch.compile the unit's children (norms, MLP; the attention where it runs one kernel on the local "
               "sequence): fused element-wise kernels"})
    compile_scope: Literal["children", "unit"] = attrs.field(default="children", metadata={
        "doc": "with compile = true: children (each child its own graph), or unit (the whole unit as one graph: "
               "its norms fused with the residual adds and float8's casts across children; a unit kept whole, "
               "with checkpoint = off, whose attention runs one kernel on the local sequence, else its children)"})
    offload_activations: bool = attrs.field(default=False, metadata={
        "doc": "with checkpoint = full: the unit's input (all it keeps) waits in host memory from its forward to "
               "its backward (pinned, copied on a side stream)"})
    offload_keep_every: int = attrs.field(default=1, validator=in_range(low=1), metadata={
        "doc": "with offload_activations: only every Nth offloaded unit's input waits in host memory; a unit in "
               "between regenerates its input in backward by running the unit before once more, without gradients "
               "(the same values): host memory 1/N of the units' inputs, one more forward of N - 1 units in N"})
    mlp_tile_tokens: int = attrs.field(default=0, validator=in_range(low=0), metadata={
        "doc": "apply the unit's MLP to the sequence in tiles of this many tokens (its intermediates never exist "
               "for the whole sequence; its forward runs twice: in the forward and in its backward, a "
               "recomputed layer's recomputation stopping before it); 0 = off"})
    trainable: bool = attrs.field(default=True, metadata={
        "doc": "false: the unit's parameters are frozen (no gradients, no optimizer state, no gradient reduction); "
               "its forward still runs and gradients still flow through it to the units before"})
    matmul: Literal["default", "float8"] = attrs.field(default="default", metadata={
        "doc": "float8: the unit's linear layers multiply in float8 (torchao's float8 training; GPUs with float8 "
               "units: Ada, Hopper, Blackwell), layers with a dimension not a multiple of 16 and adapters' layers "
               "excepted; default: in the storage (or autocast) dtype"})
    float8_recipe: Float8Scaling = attrs.field(default="tensorwise", metadata={
        "doc": "with matmul = float8, the scaling: tensorwise (one scale per tensor: the fastest, 1.22x rowwise on "
               "the 7B at 32K), rowwise (a scale per row: finer) or rowwise_with_gw_hp (rowwise, the weight "
               "gradient's product in the storage dtype: no transposed casts)"})
    float8_emulate: bool = attrs.field(default=False, metadata={
        "doc": "with matmul = float8: cast to float8 and back as the recipe does, but multiply in the storage "
               "dtype (torchao's emulation): float8's numerics on any device (a CPU check, a GPU without float8 "
               "units), none of its speed"})
    quantize: Literal["none", "nf4"] = attrs.field(default="none", metadata={
        "doc": "nf4: the unit's frozen linear weights stored in 4 bits (torchao NF4, QLoRA's format: ~0.52 bytes a "
               "weight), quantised as the unit materialises; the unit must be frozen (trainable = false) or its "
               "base frozen by an adapter rule; norms and biases keep storage_dtype"})


@attrs.frozen(kw_only=True)
class Fsdp2Params(KeepParams):
    group: str = attrs.field(default="", metadata={"doc": "name of the modality group, shown in the plan"})
    param_dtype: Dtype | None = attrs.field(default=None,
                                            metadata={"doc": "dtype of gathered parameters; unset = storage dtype"})
    reduce_dtype: Dtype | None = attrs.field(default=None, metadata={"doc": "dtype of the gradient reduce-scatter"})
    reshard_after_forward: bool = attrs.field(default=True, metadata={"doc": "free gathered params after forward"})
    offload: bool = attrs.field(default=False, metadata={"doc": "keep shards and optimizer state on the CPU"})


def check_keep(params, *, recipe, plan) -> str | None:
    if params.compile_scope == "unit" and (not params.compile or params.checkpoint != "off"
                                           or isinstance(params, Fsdp2Params) or params.mlp_tile_tokens):
        return ("compile_scope = 'unit' compiles a unit whose forward has no hooks around it: compile = true, "
                f"checkpoint = 'off' (got {params.checkpoint!r}), strategy 'none', no mlp_tile_tokens; "
                "or compile_scope = 'children'")
    if params.offload_keep_every > 1 and (not params.offload_activations or isinstance(params, Fsdp2Params)):
        return (f"offload_keep_every = {params.offload_keep_every} thins the inputs offload_activations keeps: it "
                "needs offload_activations = true and strategy 'none' (an FSDP2 unit cannot run its forward again "
                "inside the backward)")
    if params.offload_activations and params.checkpoint != "full":
        return (f"offload_activations = true needs checkpoint = 'full' (got {params.checkpoint!r}): only a fully "
                "checkpointed unit keeps nothing but its input")
    if params.matmul == "float8":
        if not _has_torchao():
            return "matmul = 'float8' needs the torchao package (pip install 'weft[float8]')"
        if params.quantize != "none":
            return (f"matmul = 'float8' and quantize = {params.quantize!r} on one unit: a 4-bit weight is not "
                    "multiplied in float8; choose one")
    if params.quantize != "none":
        return _check_quantize(params, plan=plan)
    return None


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def _check_quantize(params, *, plan) -> str | None:
    if not _has_torchao():
        return f"quantize = {params.quantize!r} needs the torchao package (pip install 'weft[qlora]')"
    if params.trainable and not plan.adapted():
        return (f"quantize = {params.quantize!r} stores weights no optimizer can update: freeze the unit "
                "(trainable = false) or add an adapter rule (adapter = { strategy = \"lora\" }), which freezes the "
                "base")
    return None
