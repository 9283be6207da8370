"""Frozen linear weights stored in 4 bits: torchao's NF4 (NormalFloat4, QLoRA's format).

A weight becomes an ``NF4Tensor``: 4-bit codes in blocks of 64 values, each block's absmax
scaler quantised again to 8 bits in blocks of scalers (double quantisation), about 0.52
bytes a weight against bf16's 2. ``F.linear`` on it dequantises to the input's dtype and
runs one ordinary product (torchao's ``__torch_function__``), so a PEFT LoRA layer over it,
torch.compile and activation checkpointing work unchanged; it takes no gradient (nothing
can update 4-bit codes), which is why only frozen weights are quantised.

Why torchao's tensor and not bitsandbytes' ``Linear4bit``: it is a tensor, not a module
(module names and PEFT's wrapping stay as transformers builds them), it implements FSDP2's
all-gather hooks, and on one H200 its product is 1-10% slower than bf16's at 72B shapes
(BENCHMARKS.md, "A frozen NF4 base linear").

Quantising is deterministic: the same weights give the same codes on every rank and in
``weft check``'s unsharded reference.
"""

from __future__ import annotations

import functools
import math

import torch

METHODS: tuple[str, ...] = ("none", "nf4")
BLOCK = 64  # values per 4-bit block (QLoRA's)
SCALER_BLOCK = 256  # block scalers per second-level scaler (QLoRA's), fewer for small tensors
MIN_SCALER_GROUPS = 8  # second-level scalers a weight keeps at least, where it can: FSDP2 over up to 8 ranks
#: PEFT's adapter layers are linear layers too: they train, so they stay in full precision.
ADAPTER_PART = "lora_"


def quantizable(weight: torch.Tensor) -> bool:
    """A 2-D weight whose element count splits into whole 64-value blocks."""
    return weight.ndim == 2 and weight.numel() % BLOCK == 0


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) as an NF4 tensor of the same shape and (dequantised) dtype."""
    from torchao.quantization import to_nf4 as torchao_to_nf4

    blocks = weight.numel() // BLOCK
    # The scalers are quantised in blocks that must divide their count: QLoRA's 256 where it
    # does, else the largest power of two that does (tiny test models); and at least
    # MIN_SCALER_GROUPS groups of them where the weight allows, so FSDP2 can split a weight's
    # scaler groups over up to that many ranks (torchao's NF4 chunks every inner tensor
    # evenly). Every weight of the 7B and the 72B keeps QLoRA's 256.
    scaler_block = math.gcd(blocks, SCALER_BLOCK, max(1, blocks // MIN_SCALER_GROUPS))
    return torchao_to_nf4(weight.detach().contiguous(), BLOCK, scaler_block)


def quantize_linears(module: torch.nn.Module, *, method: str) -> dict[str, int]:
    """Every linear layer's weight under ``module`` (adapters excepted) as ``method``, in place.
    Returns counts: layers quantised, weights left as they were (not whole blocks), bytes
    before and after."""
    if method not in METHODS:
        raise ValueError(f"unknown quantisation {method!r}; accepted: {', '.join(METHODS)}")
    counts = {"layers": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    if method == "none":
        return counts
    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.Linear) or ADAPTER_PART in name or is_quantized(layer.weight):
            continue
        weight = layer.weight
        if not quantizable(weight):
            counts["kept"] += 1
            continue
        counts["bytes_before"] += weight.numel() * weight.element_size()
        layer.weight = torch.nn.Parameter(to_nf4(weight), requires_grad=False)
        counts["bytes_after"] += stored_bytes(layer.weight)
        counts["layers"] += 1
    return counts


def is_quantized(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor" or type(getattr(tensor, "data", None)).__name__ == "NF4Tensor"


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a parameter holds: an NF4 tensor's codes and scalers, else numel x element size."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and is_quantized(tensor):
        names, _ = flatten()
        return sum(stored_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def dequantize(module: torch.nn.Module) -> int:
    """Every NF4 weight under ``module`` back to a plain tensor of its dtype (for merging an
    adapter into it, or exporting). Returns how many."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and is_quantized(layer.weight):
            layer.weight = torch.nn.Parameter(layer.weight.get_original_weight(), requires_grad=False)
            count += 1
    return count


def expanded(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 weight as a plain tensor of its dtype, the same values bit for bit as torchao's
    ``get_original_weight``: its block scalers undone by torchao's own method (one value per 64
    weights), then codes -> table values -> times their block's scaler in one kernel where the
    weight is on a GPU (compiled). torchao's eager path makes int64 code tensors, two gathers,
    two products and a stack: at 72B's MLP shapes ~4.5 ms a weight on an H100, paid per tile
    and per pass by the tiled MLP (BENCHMARKS.md, issue 46's 72B profile)."""
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                        weight.scaler_block_size)  # (blocks,)
    expand = _compiled_expand() if weight.quantized_data.is_cuda else _expand
    return expand(weight.quantized_data, weight.nf4, scalers).view(weight.shape)


def _expand(codes: torch.Tensor, table: torch.Tensor, scalers: torch.Tensor) -> torch.Tensor:
    # codes (n / 2,) uint8, two 4-bit codes a byte, the first value in the high half; table (16,);
    # scalers (n / block,). A bf16 x bf16 product is exact in float32, so Inductor's float32
    # arithmetic rounds it to the same bf16 as the eager product.
    pairs = torch.stack((codes >> 4, codes & 0b1111), dim=-1).view(scalers.numel(), -1)  # (blocks, block)
    return table[pairs.long()] * scalers.unsqueeze(-1)  # (blocks, block)


@functools.cache
def _compiled_expand():
    # Made on first use: torch.compile imports dynamo (~2.5 s), which a CPU run never needs.
    return torch.compile(_expand, dynamic=False)


def unshardable(module: torch.nn.Module, *, ranks: int) -> tuple[str, str] | None:
    """The first 4-bit weight under ``module`` that FSDP2 cannot split over ``ranks`` ranks, as
    (its name, why), or None. torchao's NF4 tensor splits into equal row blocks, each of its
    inner tensors (codes, block scalers, their scaler groups) evenly: FSDP2's padding of an
    uneven split is not available to it."""
    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.Linear) or not is_quantized(layer.weight):
            continue
        weight = layer.weight
        rows, groups = weight.shape[0], weight.quantization_factor.numel()
        if rows % ranks or groups % ranks:
            return name, f"{rows} rows and {groups} scaler groups, not both multiples of {ranks}"
    return None
