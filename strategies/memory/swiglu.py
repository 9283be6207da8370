"""A SwiGLU MLP, down(silu(gate(x)) * up(x)), computed by hand on rows: what a recomputed MLP runs.

Why by hand: a recomputed MLP's backward needs its down projection's input (h = silu(g) * u) and
weight, never its output. torch's non-reentrant checkpoint stops an eager recomputation before
the down product (its early stop), but a compiled MLP is one autograd function whose whole
forward runs before it saves anything: under ``compile = true`` every recomputed MLP ran its down
product again, a third of the MLP's forward (measured by kernel time on the CPU, 2026-12-06:
"mlp", "full" and "except_attention" alike). Here the backward makes g and u again (two
products), h, the down weight's gradient, then h's gradient, and writes g's and u's gradients
over g and u in place: three intermediates of the MLP's width at a time, where autograd's held
four.

The element-wise parts (SiLU and the product; their backward) run in float32 and round once,
as torch.compile's fused kernel does; on CUDA they are compiled (one kernel each), elsewhere
they run eagerly in chunks of rows (float32 temporaries of a few rows at a time).

Which modules: transformers' SwiGLU MLP classes (``SWIGLU_CLASSES``) whose three projections are
plain ``nn.Linear`` (a PEFT adapter, torchao's float8 or a parametrization changes the class and
keeps the module's own forward) with no hooks, and a SiLU activation. A 4-bit (NF4) weight is
expanded once a pass by the caller.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

#: transformers' MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
SWIGLU_CLASSES = frozenset({"Qwen2MLP", "Qwen2_5_VLMLP", "Qwen3MLP", "LlamaMLP", "MistralMLP"})
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: Rows an eager element-wise pass takes at a time: its float32 temporaries stay a few MB wide.
EAGER_ROWS = 1024


def is_swiglu(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes down(silu(gate(x)) * up(x)) through three plain linear layers."""
    if type(module).__name__ not in SWIGLU_CLASSES:
        return False
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    projections = [getattr(module, name, None) for name in PROJECTIONS]
    return all(type(p) is torch.nn.Linear and not (p._forward_hooks or p._forward_pre_hooks)
               for p in projections)


def weights_of(module: torch.nn.Module) -> tuple[torch.Tensor | None, ...]:
    """(gate, up, down) weights then their biases (None where a projection has none): the order
    ``Weights.of`` reads."""
    projections = [getattr(module, name) for name in PROJECTIONS]
    return (*(p.weight for p in projections), *(p.bias for p in projections))


@attrs.frozen
class Weights:
    """One pass's weights, 16-bit (a 4-bit one expanded by the caller); the biases may be None."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    @classmethod
    def of(cls, tensors) -> Weights:
        return cls(*tensors)


def forward_rows(x: torch.Tensor, w: Weights, *, compiled: bool) -> torch.Tensor:
    """The MLP's output rows, no autograd. x (N, H) -> (N, H)."""
    g = F.linear(x, w.gate, w.gate_bias)  # (N, I)
    u = F.linear(x, w.up, w.up_bias)  # (N, I)
    h = _act_mul(compiled)(g, u)  # (N, I)
    del g, u
    return F.linear(h, w.down, w.down_bias)


def backward_rows(x: torch.Tensor, dy: torch.Tensor, w: Weights, *, compiled: bool,
                  wants: tuple[bool, ...]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """x's gradient and the weights' (``wants``: which of Weights' six fields take one, in its
    order), from the rows' output gradient dy, no autograd. x, dy (N, H)."""
    g = F.linear(x, w.gate, w.gate_bias)  # (N, I)
    u = F.linear(x, w.up, w.up_bias)  # (N, I)
    h = _act_mul(compiled)(g, u)  # (N, I)
    grads: list[torch.Tensor | None] = [None] * 6
    if wants[2]:
        grads[2] = dy.t() @ h  # (H, I)
    del h
    dh = dy @ w.down  # (N, I)
    _act_mul_backward(compiled)(g, u, dh)  # g, u now hold their gradients
    del dh
    dg, du = g, u
    dx = (dg @ w.gate).addmm_(du, w.up)  # (N, H)
    if wants[0]:
        grads[0] = dg.t() @ x
    if wants[1]:
        grads[1] = du.t() @ x
    for i, rows in ((3, dg), (4, du), (5, dy)):
        if wants[i]:
            grads[i] = rows.sum(0)
    return dx, grads


def _act_mul_eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(g)
    for s in range(0, g.shape[0], EAGER_ROWS):
        out[s:s + EAGER_ROWS] = _act_mul_math(g[s:s + EAGER_ROWS], u[s:s + EAGER_ROWS])
    return out


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t  # float64 stays float64


def _act_mul_math(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (F.silu(_wide(g)) * _wide(u)).to(g.dtype)


def _act_mul_backward_eager(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> None:
    for s in range(0, g.shape[0], EAGER_ROWS):
        _act_mul_backward_math(g[s:s + EAGER_ROWS], u[s:s + EAGER_ROWS], dh[s:s + EAGER_ROWS])


def _act_mul_backward_math(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> None:
    """h = silu(g) * u: dg = dh * u * silu'(g), du = dh * silu(g), written over g and u."""
    gf, uf, dhf = _wide(g), _wide(u), _wide(dh)
    s = torch.sigmoid(gf)
    du, dg = dhf * gf * s, dhf * uf * s * (1 + gf * (1 - s))  # both before either write (float32 g is gf)
    u.copy_(du)
    g.copy_(dg)


def _compiled(fn):
    # Made on use: torch.compile imports dynamo (~2.5 s), which a CPU run never needs; dynamo
    # keeps what it compiled by the function's code, so a second wrapper compiles nothing again.
    return torch.compile(fn, dynamic=True)


def _act_mul(compiled: bool):
    return _compiled(_act_mul_math) if compiled else _act_mul_eager


def _act_mul_backward(compiled: bool):
    return _compiled(_act_mul_backward_math) if compiled else _act_mul_backward_eager
