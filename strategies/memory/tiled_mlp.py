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
units and checkpoints are untouched. Rows are bit-identical to the untiled MLP's (a SwiGLU's
by hand, below, round their element-wise work once in float32, as a compiled module does); the
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

A SwiGLU MLP of plain linear layers (strategies/memory/swiglu.py) runs its rows by hand instead of
through the module's forward: its backward makes the gate and up products again, not the down
one (the module's forward under autograd would run all three). The same two autograd steps
with one tile of the whole sequence (``tile_tokens=None``) are how a recomputed, untiled SwiGLU
MLP is recomputed (plugins/shard/levers.py): a compiled MLP under torch's checkpoint ran its
down product again.

Autocast: each tile's backward runs under the autocast its forward ran under (torch's
checkpoint does the same for its recomputation), so a bf16 run over float32 weights gets its
gradients from the products the forward made.
"""

from __future__ import annotations

import contextlib

import torch

from weft.strategies.memory.swiglu import Parts, Weights, backward_rows, forward_rows, is_swiglu, parts
from weft.strategies.model.quantize import expanded, is_quantized


class _Tiles:
    """One MLP's rows tile by tile: by hand for a SwiGLU, else the module's own forward on each
    tile (its 4-bit weights expanded once a pass)."""

    def __init__(self, module: torch.nn.Module, *, swiglu: Parts | None, compile: bool) -> None:
        self.module, self.swiglu, self.compile = module, swiglu, compile
        # Which of the SwiGLU's twelve tensors exist: params() holds those, in that order.
        self.layout = tuple(t is not None for t in swiglu.tensors) if swiglu is not None else ()

    def params(self) -> tuple[torch.Tensor, ...]:
        if self.swiglu is not None:
            return tuple(t for t in self.swiglu.tensors if t is not None)
        return tuple(self.module.parameters())

    def expand(self) -> dict[str, torch.Tensor]:
        return {name: expanded(p) for name, p in _four_bit(self.module)}

    def _call(self, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        if not weights:
            return self.module.forward(x)
        # The module's call runs its hooks: TiledMLP's own pass a tile through untouched.
        return torch.func.functional_call(self.module, weights, (x,), strict=False)

    def _weights(self, params, x: torch.Tensor) -> tuple[Weights, torch.Tensor]:
        """The pass's weights (4-bit ones expanded) and rows (..., H) -> (N, H); both in autocast's
        dtype where it is on, as its own casts would make them for each product."""
        kind = x.device.type
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        it = iter(expanded(p) if is_quantized(p) else p for p in params)
        tensors = [next(it) if present else None for present in self.layout]
        if cast is not None:
            tensors = [t if t is None or not t.is_floating_point() else t.to(cast) for t in tensors]
            x = x.to(cast)
        return Weights.of(tensors, self.swiglu.scales), x.reshape(-1, x.shape[-1])

    def forward(self, x: torch.Tensor, tile: int) -> torch.Tensor:
        """The MLP's output, no autograd. x (B, S, H), or any (..., H) for a SwiGLU."""
        if self.swiglu is not None:
            w, rows = self._weights(self.params(), x)  # rows (N, H): row-wise, so tiles of rows
            compiled = self.compile and x.is_cuda
            out = [forward_rows(rows[s:s + tile], w, compiled=compiled) for s in range(0, rows.shape[0], tile)]
            return (out[0] if len(out) == 1 else torch.cat(out)).view(*x.shape[:-1], -1)
        weights = self.expand()
        return torch.cat([self._call(x[:, s:s + tile], weights) for s in range(0, x.shape[1], tile)], dim=1)

    def backward(self, x: torch.Tensor, grad: torch.Tensor, params, tile: int):
        """x's gradient and the parameters' (float32 sums over the tiles for 16-bit weights)."""
        wants = [p.requires_grad for p in params]
        sums: list[torch.Tensor | None] = [None] * len(params)
        if self.swiglu is not None:
            w, rows = self._weights(params, x)  # (N, H)
            drows, compiled = grad.reshape(-1, grad.shape[-1]).to(rows.dtype), self.compile and x.is_cuda
            present = [i for i, p in enumerate(self.layout) if p]  # each param's place among the twelve
            want12 = [False] * 12
            for i, want in zip(present, wants):
                want12[i] = want
            if rows.shape[0] <= tile:  # one tile: its gradients as they come, no float32 sums
                d, got = backward_rows(rows, drows, w, compiled=compiled, wants=want12)
                return d.to(x.dtype).view(x.shape), [None if got[i] is None else got[i].to(p.dtype)
                                                     for i, p in zip(present, params)]
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            dx_rows = dx.view(-1, x.shape[-1])
            for s in range(0, rows.shape[0], tile):
                d, got = backward_rows(rows[s:s + tile], drows[s:s + tile], w, compiled=compiled, wants=want12)
                dx_rows[s:s + tile] = d
                _accumulate(sums, [got[i] for i in present])
        else:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            with torch.no_grad():
                weights = self.expand()
            for s in range(0, x.shape[1], tile):
                with torch.enable_grad():
                    xt = x[:, s:s + tile].detach().requires_grad_(True)
                    yt = self._call(xt, weights)
                inputs = [xt] + [p for p, w in zip(params, wants) if w]
                got = iter(torch.autograd.grad(yt, inputs, grad[:, s:s + tile]))
                dx[:, s:s + tile] = next(got)
                _accumulate(sums, [next(got) if want else None for want in wants])
        return dx, [None if g is None else g.to(p.dtype) for g, p in zip(sums, params)]


def _accumulate(sums: list, grads: list) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            g = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
            sums[i] = g if sums[i] is None else sums[i].add_(g)


def _autocast_of(x: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    kind = x.device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class _Keep(torch.autograd.Function):
    """Keeps the MLP's input and parameters (its output: the input, as a view); its backward
    runs the tiles again, the MLP's output gradient in hand, under the forward's autocast."""

    @staticmethod
    def forward(ctx, run: _Tiles, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *params)
        ctx.run, ctx.tile, ctx.autocast = run, tile, _autocast_of(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled) if enabled else contextlib.nullcontext():
            dx, grads = ctx.run.backward(x, grad, params, ctx.tile)
        return (None, None, dx, *grads)


class _Rows(torch.autograd.Function):
    """The MLP's output tile by tile, without autograd and keeping nothing; its backward hands
    the output's gradient to ``_Keep`` (the MLP keeps its input's shape)."""

    @staticmethod
    def forward(ctx, run: _Tiles, tile: int, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return run.forward(x, tile)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, grad


class TiledMLP:
    """Attach to MLP modules (each applied row-wise to a (B, S, H) input; a SwiGLU's to any
    (..., H)); one per run. ``tile_tokens=None``: one tile of the whole sequence (for SwiGLU
    MLPs: how a recomputed MLP is made again without its down product); ``compile``: a SwiGLU's
    element-wise kernels through torch.compile on CUDA."""

    def __init__(self, *, tile_tokens: int | None, compile: bool = False) -> None:
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"tile_tokens must be at least 1, got {tile_tokens}")
        self.tile, self.compile = tile_tokens, compile
        self._inputs: dict[int, torch.Tensor] = {}  # id(module) -> the input held back from its own forward
        self._held: dict[int, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}  # 4-bit weights set aside
        self._swiglu: dict[int, bool] = {}

    def attach(self, modules: list[torch.nn.Module]) -> int:
        for module in modules:
            self._swiglu[id(module)] = is_swiglu(module)
            if self.tile is None and not self._swiglu[id(module)]:
                raise ValueError(f"{type(module).__name__}: one whole-sequence tile is for SwiGLU MLPs of plain "
                                 "linear layers (LoRA's too) only (strategies/memory/swiglu.py)")
            module.register_forward_pre_hook(self._before)
            # Registered first so that it runs first, and on an error too: _after sees the real weights.
            module.register_forward_hook(self._give_back, always_call=True)
            module.register_forward_hook(self._after)
        return len(modules)

    def _rows(self, x: torch.Tensor, swiglu: bool) -> int:
        """The tile's rows for this input, 0 where the module's own call takes it as it stands."""
        if swiglu:
            n = x.numel() // x.shape[-1] if x.dim() >= 2 else 0
            tile = n if self.tile is None else self.tile
            return tile if n > tile or (self.tile is None and n > 0) else 0
        return self.tile if self.tile is not None and x.dim() == 3 and x.shape[1] > self.tile else 0

    def _before(self, module: torch.nn.Module, args: tuple):
        x = args[0]
        # Read at each call, as PEFT's forward reads its adapters (switched off: the base alone). A
        # SwiGLU this file cannot run by hand at this call (nothing bundled makes one) takes the
        # generic tiles, or, in one whole tile, its own call: the same values, nothing recomputed.
        swiglu = parts(module) if self._swiglu[id(module)] else None
        tile = self._rows(x, swiglu is not None)
        if not tile:
            return None  # one tile or less: the module's own call as it stands
        self._inputs[id(module)] = (x, swiglu, tile)
        self._held[id(module)] = _stand_in(module)
        return (x[..., :0, :], *args[1:])  # the module's own forward runs on zero tokens

    def _give_back(self, module: torch.nn.Module, args: tuple, output) -> None:
        for owner, name, weight in self._held.pop(id(module), ()):
            owner._parameters[name] = weight

    def _after(self, module: torch.nn.Module, args: tuple, output: torch.Tensor):
        held = self._inputs.pop(id(module), None)
        if held is None:
            return None
        x, swiglu, tile = held
        run = _Tiles(module, swiglu=swiglu, compile=self.compile)
        # Two steps, so that a checkpointed layer's recomputation ends at _Keep: torch's
        # non-reentrant checkpoint stops once the last tensor the backward needs is saved
        # again (early stop, its default), and _Keep's are the layer's last; the tiles'
        # forward then runs twice in all (forward, this backward), not three times.
        return _Rows.apply(run, tile, _Keep.apply(run, tile, x, *run.params()))


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
