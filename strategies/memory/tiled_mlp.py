"""The MLP applied to the sequence in tiles: its intermediates never exist for the whole sequence.

A SwiGLU MLP is row-wise: token t's output depends on token t's input only. At 512K
tokens a 7B layer's gate, up and their product are 3 x 18,944 wide, ~55 GiB in bf16 for
the whole sequence; in tiles of N tokens only one tile's exist at a time. Forward runs
each tile without autograd and keeps the MLP's input alone; backward runs each tile again
with autograd, writes its rows of the input's gradient and adds its share of the weights'
gradients (in float32 for 16-bit weights: one rounding at the end, not one per tile). So
the MLP costs its forward twice, as under activation checkpointing, which it composes
with: a checkpointed layer's recomputation stops before the tiles (torch's early stop, once
the MLP's input is saved again), so there too the tiles run twice, not three times.

It is attached with module hooks, not by replacing the module or its class: a forward
pre-hook hands the MLP's own forward an empty slice of the sequence (it runs on zero
tokens) and keeps the real input; the forward hook returns the tiled result in its
place, computed by that same module's ``forward``, tile by tile. Parameter names, FSDP2
units and checkpoints are untouched. Rows are bit-identical to the untiled MLP's; the
weights' gradients are sums over tiles, equal up to the order of the additions.

A 4-bit (NF4) weight is expanded to its dtype once per pass, not once per tile: each tile runs
the module with the expanded tensors in place of the 4-bit parameters
(``torch.func.functional_call``; the same values, so the same rows). Per tile, torchao's
product would expand it again, twice in the backward (the tile's forward and its input
gradient): at 128K in 16K tiles that was 96 expansions a 72B layer, ~0.47 s of its step on an
H100 (BENCHMARKS.md, issue 46's 72B profile). The cost: the MLP's weights in 16 bits held
while its tiles run (1.4 GB at 72B; the planner counts it). The module's own zero-token call
runs on stand-ins for its 4-bit weights (one zero of the dtype, broadcast to the weight's
shape): its products are empty, and torchao's expansion of each weight in that call (three a
layer, six under recomputation, ~27 ms of a 72B layer's step on an H100) is not paid.
"""

from __future__ import annotations

import torch

from weft.strategies.model.quantize import expanded, is_quantized


class _Tiles:
    """One MLP's forward on a tile of rows, its 4-bit weights expanded by the caller once a pass."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def expand(self) -> dict[str, torch.Tensor]:
        return {name: expanded(p) for name, p in _four_bit(self.module)}

    def __call__(self, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        if not weights:
            return self.module.forward(x)
        # The module's call runs its hooks: TiledMLP's own pass a tile through untouched.
        return torch.func.functional_call(self.module, weights, (x,), strict=False)


class _Keep(torch.autograd.Function):
    """Keeps the MLP's input and parameters (its output: the input, as a view); its backward
    runs the tiles again with autograd, the MLP's output gradient in hand."""

    @staticmethod
    def forward(ctx, run: _Tiles, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *params)
        ctx.run, ctx.tile = run, tile
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        wants = [p.requires_grad for p in params]
        dx = torch.empty_like(x)
        sums: list[torch.Tensor | None] = [None] * len(params)
        with torch.no_grad():
            weights = ctx.run.expand()
        for s in range(0, x.shape[1], ctx.tile):
            with torch.enable_grad():
                xt = x[:, s:s + ctx.tile].detach().requires_grad_(True)
                yt = ctx.run(xt, weights)
            inputs = [xt] + [p for p, w in zip(params, wants) if w]
            got = torch.autograd.grad(yt, inputs, grad[:, s:s + ctx.tile])
            dx[:, s:s + ctx.tile] = got[0]
            it = iter(got[1:])
            for i, want in enumerate(wants):
                if want:
                    g = next(it)
                    g = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
        grads = [None if g is None else g.to(p.dtype) for g, p in zip(sums, params)]
        return (None, None, dx, *grads)


class _Rows(torch.autograd.Function):
    """The MLP's output tile by tile, without autograd and keeping nothing; its backward hands
    the output's gradient to ``_Keep`` (the MLP keeps its input's shape)."""

    @staticmethod
    def forward(ctx, run: _Tiles, tile: int, x: torch.Tensor) -> torch.Tensor:
        # x (B, S, H); the MLP's own forward, row-wise, on [s, s + tile) of the sequence dim.
        with torch.no_grad():
            weights = run.expand()
            return torch.cat([run(x[:, s:s + tile], weights) for s in range(0, x.shape[1], tile)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, grad


class TiledMLP:
    """Attach to MLP modules (each applied row-wise to a (B, S, H) input); one per run."""

    def __init__(self, *, tile_tokens: int) -> None:
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens must be at least 1, got {tile_tokens}")
        self.tile = tile_tokens
        self._inputs: dict[int, torch.Tensor] = {}  # id(module) -> the input held back from its own forward
        self._held: dict[int, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}  # 4-bit weights set aside

    def attach(self, modules: list[torch.nn.Module]) -> int:
        for module in modules:
            module.register_forward_pre_hook(self._before)
            # Registered first so that it runs first, and on an error too: _after sees the real weights.
            module.register_forward_hook(self._give_back, always_call=True)
            module.register_forward_hook(self._after)
        return len(modules)

    def _before(self, module: torch.nn.Module, args: tuple):
        x = args[0]
        if x.dim() != 3 or x.shape[1] <= self.tile:
            return None  # one tile or less: the module's own call as it stands
        self._inputs[id(module)] = x
        self._held[id(module)] = _stand_in(module)
        return (x[:, :0], *args[1:])  # the module's own forward runs on zero tokens

    def _give_back(self, module: torch.nn.Module, args: tuple, output) -> None:
        for owner, name, weight in self._held.pop(id(module), ()):
            owner._parameters[name] = weight

    def _after(self, module: torch.nn.Module, args: tuple, output: torch.Tensor):
        x = self._inputs.pop(id(module), None)
        if x is None:
            return None
        params = tuple(p for p in module.parameters())
        run = _Tiles(module)
        # Two steps, so that a checkpointed layer's recomputation ends at _Keep: torch's
        # non-reentrant checkpoint stops once the last tensor the backward needs is saved
        # again (early stop, its default), and _Keep's are the layer's last; the tiles'
        # forward then runs twice in all (forward, this backward), not three times.
        return _Rows.apply(run, self.tile, _Keep.apply(run, self.tile, x, *params))


def _stand_in(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Puts a stand-in in place of each 4-bit weight under ``module`` (a zero broadcast to its shape,
    no memory) and returns (owner, name, weight) to put back. Swapped in the owner's parameter
    table, as torch.func.functional_call does, so the module's class and its forward are its own."""
    held = []
    for path, weight in _four_bit(module):
        prefix, _, name = path.rpartition(".")
        owner = module.get_submodule(prefix)
        held.append((owner, name, weight))
        owner._parameters[name] = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
    return held


def _four_bit(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Under FSDP2 a sharded weight is a DTensor, never an NF4Tensor: those keep torchao's path.
    return [(path, p) for path, p in module.named_parameters() if is_quantized(p)]
