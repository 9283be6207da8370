"""Sibling linears that read the same input — an attention's query, key and value projections,
an MLP's gate and up — computed as one matrix product over their weights laid out in one storage.

Decoding a token reads every weight once: each product over a (B, 1, K) input is bound by that
read, and each kernel also pays its own start, ramp and tail (and cuBLAS's split-K reduction
where it picks one). The 7B's key and value projections are 3.7 MB each, read in under a
microsecond at the H200's bandwidth, yet cost a kernel each, in each of 28 layers: one product
over the three weights reads the same bytes in one kernel (BENCHMARKS.md has what it moved).

Attached with module hooks, not by replacing modules or their classes (as
strategies/memory/tiled_mlp.py): the siblings' weights (and biases) move into one storage whose
row slices become the parameters' own data — the same names, the same values, no second copy
(a slice of rows of a row-major matrix is contiguous, so every other use of a parameter sees the
same tensor as before). When the first sibling is called with gradients off on at most
``MAX_ROWS`` rows (decoding), its forward pre-hook keeps the input and hands its own forward
zero tokens; its forward hook returns its columns of the fused product and keeps the others'
for them; each other sibling, called next with that same input, is handed zero tokens and
returns its kept part. Anything else — a call with gradients on, a longer input, another input,
another order, a tensor without a token dimension — runs the module's own forward. Nothing is
kept across calls: the last sibling takes the last part. Under torch.compile the hooks trace
with the step (no graph break) and the zero-token products vanish from the generated code.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

#: Inputs of at most this many rows (tokens x batch) take the fused product: decoding's regime,
#: where a product is bound by its weights' read. A prefill's products are bound by their
#: arithmetic, gain nothing from one kernel more or less, and run each module's own forward
#: (its compiled units keep the graphs they were compiled with).
MAX_ROWS = 256


def fusable(linears: Sequence[torch.nn.Module]) -> bool:
    """Whether ``linears`` can share one storage: plain ``nn.Linear`` (no adapter or quantized
    class), plain tensors (no DTensor, float8 or 4-bit subclass) of one dtype and device, the
    same input width, all with a bias or none."""
    if len(linears) < 2 or any(type(m) is not torch.nn.Linear for m in linears):
        return False
    weights = [m.weight for m in linears]
    if any(type(w.data) is not torch.Tensor or w.device.type == "meta" for w in weights):
        return False
    first = weights[0]
    same = all(w.dtype == first.dtype and w.device == first.device and w.shape[1] == first.shape[1] for w in weights)
    return same and len({m.bias is None for m in linears}) == 1


class FusedLinears:
    """One group of sibling linears (see the module docstring), attached at construction."""

    def __init__(self, linears: Sequence[torch.nn.Linear], *, max_rows: int = MAX_ROWS) -> None:
        if not fusable(linears):
            raise ValueError("fused linears must be plain nn.Linear modules of one dtype, device and input width")
        self.max_rows = max_rows
        self.sizes = [m.out_features for m in linears]
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in linears])  # (sum N, K)
            self.bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
            start = 0
            for m, size in zip(linears, self.sizes):
                m.weight.data = self.weight[start:start + size]  # (N, K) rows of the one storage
                if self.bias is not None:
                    m.bias.data = self.bias[start:start + size]
                start += size
        self._input: torch.Tensor | None = None  # the first sibling's input, while its parts wait
        self._parts: list[torch.Tensor | None] = []  # the fused product's columns, by sibling
        self._taking = [False] * len(linears)  # which sibling was handed zero tokens
        for index, m in enumerate(linears):
            m.register_forward_pre_hook(self._before(index))
            m.register_forward_hook(self._after(index))

    def _before(self, index: int):
        def hook(module: torch.nn.Module, args: tuple):
            x = args[0] if args else None
            if index == 0:
                self._input, self._parts = None, []  # a new call of the group: nothing left over
                if (torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2
                        or x.numel() > self.max_rows * x.shape[-1]):
                    return None
                self._input = x
            elif self._input is None or x is not self._input or len(self._parts) <= index or self._parts[index] is None:
                return None
            self._taking[index] = True
            return (x.narrow(-2, 0, 0), *args[1:])  # the module's own forward runs on zero tokens

        return hook

    def _after(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor):
            if not self._taking[index]:
                return None
            self._taking[index] = False
            if index == 0:
                y = F.linear(self._input, self.weight, self.bias)  # (..., S, sum N)
                self._parts = list(y.split(self.sizes, dim=-1))
            part, self._parts[index] = self._parts[index], None
            if all(p is None for p in self._parts):  # the last part taken: nothing kept past the group
                self._input, self._parts = None, []
            return part

        return hook


def fuse_siblings(model: torch.nn.Module, *, groups: Sequence[Sequence[str]]) -> int:
    """Fuse every group of children named as in ``groups`` (each in the order the parent's
    forward calls them, e.g. ``("q_proj", "k_proj", "v_proj")``) found under ``model`` whose
    members are ``fusable``; returns how many groups were fused."""
    fused = 0
    for module in model.modules():
        for names in groups:
            linears = [getattr(module, name, None) for name in names]
            if all(isinstance(m, torch.nn.Module) for m in linears) and fusable(linears):
                FusedLinears(linears)
                fused += 1
    return fused
