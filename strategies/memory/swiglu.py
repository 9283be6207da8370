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

Which modules: transformers' SwiGLU MLP classes (``SWIGLU_CLASSES``) with a SiLU activation whose
three projections are each a plain ``nn.Linear`` or PEFT's LoRA ``Linear`` over one (one active
plain adapter, no dropout, the base's dtype; switched off or merged: the base alone), no hooks.
torchao's float8 layers, DoRA and other variants keep the module's own forward. An adapter's
product is added into the base's by the same matrix product (``addmm_``, its scale as alpha),
not scaled and added apart; its gradients are the two small products each way. Adapters are
read at each call (``parts``), as PEFT's forward reads them: a reference pass with them
switched off (strategies/model/adapters_off.py) runs the base alone. A 4-bit (NF4) base weight
is expanded once a pass by the caller.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

#: transformers' MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
SWIGLU_CLASSES = frozenset({"Qwen2MLP", "Qwen2_5_VLMLP", "Qwen3MLP", "LlamaMLP", "MistralMLP"})
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: Rows an eager element-wise pass takes at a time: its float32 temporaries stay a few MB wide.
EAGER_ROWS = 1024


def is_swiglu(module: nn.Module) -> bool:
    """Whether ``module`` computes down(silu(gate(x)) * up(x)) through projections this file runs."""
    return parts(module) is not None


@attrs.frozen
class Parts:
    """A SwiGLU's tensors at one call: (weight, bias, A, B) of gate, up and down in turn (None
    where absent), and each projection's adapter scale (None: no adapter)."""

    tensors: tuple[torch.Tensor | None, ...]
    scales: tuple[float | None, ...]


def parts(module: nn.Module) -> Parts | None:
    """The module's SwiGLU as it computes now, or None where this file does not run it."""
    if type(module).__name__ not in SWIGLU_CLASSES or type(getattr(module, "act_fn", None)).__name__ not in (
            "SiLU", "SiLUActivation"):
        return None
    tensors, scales = [], []
    for name in PROJECTIONS:
        found = _projection(getattr(module, name, None))
        if found is None:
            return None
        base, adapter = found
        a, b, scale = adapter if adapter is not None else (None, None, None)
        tensors += [base.weight, base.bias, a, b]
        scales.append(scale)
    return Parts(tuple(tensors), tuple(scales))


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _projection(p) -> tuple[nn.Linear, tuple[torch.Tensor, torch.Tensor, float] | None] | None:
    """(base linear layer, (A, B, scale) of its one active adapter or None), or None where the
    projection is neither a plain linear layer nor PEFT's plain LoRA over one."""
    if type(p) is nn.Linear:
        return None if _hooked(p) else (p, None)
    if type(p).__module__ != "peft.tuners.lora.layer" or type(p).__name__ != "Linear" or _hooked(p):
        return None
    base = p.base_layer
    if type(base) is not nn.Linear or _hooked(base) or p.fan_in_fan_out:
        return None
    if p.disable_adapters or p.merged:
        return base, None  # PEFT's forward then runs the base alone
    names = [n for n in p.active_adapters if n in p.lora_A]
    if not names:
        return base, None
    name = names[0]
    a, b = p.lora_A[name], p.lora_B[name]
    if (len(names) > 1 or name in getattr(p, "lora_variant", {}) or p.use_dora.get(name)
            or getattr(p, "lora_bias", {}).get(name) or not isinstance(p.lora_dropout[name], nn.Identity)
            or a.bias is not None or b.bias is not None or not a.weight.dtype == b.weight.dtype == base.weight.dtype):
        return None
    return base, (a.weight, b.weight, float(p.scaling[name]))


@attrs.frozen
class Projection:
    """One projection's tensors for a pass (16-bit; a 4-bit weight expanded by the caller)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    a: torch.Tensor | None = None  # (r, in)
    b: torch.Tensor | None = None  # (out, r)
    scale: float = 1.0


@attrs.frozen
class Weights:
    gate: Projection
    up: Projection
    down: Projection

    @classmethod
    def of(cls, tensors, scales) -> Weights:
        """From ``Parts``' order: four tensors a projection, one scale."""
        return cls(*(Projection(*tensors[4 * i:4 * i + 4], scale=scales[i] or 1.0) for i in range(3)))


def _project(x: torch.Tensor, p: Projection) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, in) -> (N, out), the adapter's product added into the base's; and x A^T (N, r)."""
    out = F.linear(x, p.weight, p.bias)
    if p.a is None:
        return out, None
    xa = F.linear(x, p.a)  # (N, r)
    return out.addmm_(xa, p.b.t(), alpha=p.scale), xa


def forward_rows(x: torch.Tensor, w: Weights, *, compiled: bool) -> torch.Tensor:
    """The MLP's output rows, no autograd. x (N, H) -> (N, H)."""
    g, _ = _project(x, w.gate)  # (N, I)
    u, _ = _project(x, w.up)  # (N, I)
    h = _act_mul(compiled)(g, u)  # (N, I)
    del g, u
    return _project(h, w.down)[0]


def backward_rows(x: torch.Tensor, dy: torch.Tensor, w: Weights, *, compiled: bool,
                  wants: tuple[bool, ...]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """x's gradient and the twelve ``Parts`` tensors' (``wants``: which take one), from the
    rows' output gradient dy, no autograd. x, dy (N, H)."""
    grads: list[torch.Tensor | None] = [None] * 12
    g, xa_g = _project(x, w.gate)  # (N, I)
    u, xa_u = _project(x, w.up)  # (N, I)
    h = _act_mul(compiled)(g, u)  # (N, I)
    d_ha = _weight_grads(h, dy, w.down, None, grads, wants, 8)  # the down projection's, while h exists
    del h
    dh = dy @ w.down.weight  # (N, I)
    if d_ha is not None:
        dh.addmm_(d_ha, w.down.a)
    _act_mul_backward(compiled)(g, u, dh)  # g, u now hold their gradients
    del dh
    dx = g @ w.gate.weight  # (N, H)
    dx.addmm_(u, w.up.weight)
    for slot, (p, d, xa) in ((0, (w.gate, g, xa_g)), (4, (w.up, u, xa_u))):
        d_xa = _weight_grads(x, d, p, xa, grads, wants, slot)
        if d_xa is not None:
            dx.addmm_(d_xa, p.a)
    return dx, grads


def _weight_grads(x, d, p: Projection, xa, grads: list, wants, slot: int) -> torch.Tensor | None:
    """A projection's weight, bias and adapter gradients into ``grads[slot:slot + 4]``, from its
    input x (N, in) and output gradient d (N, out); returns d B scale (N, r), what the adapter
    adds to x's gradient through A, or None without an adapter."""
    if wants[slot]:
        grads[slot] = d.t() @ x  # (out, in)
    if wants[slot + 1]:
        grads[slot + 1] = d.sum(0)
    if p.a is None:
        return None
    xa = F.linear(x, p.a) if xa is None else xa  # (N, r)
    d_xa = (d @ p.b).mul_(p.scale)  # (N, r)
    if wants[slot + 2]:
        grads[slot + 2] = d_xa.t() @ x  # (r, in)
    if wants[slot + 3]:
        grads[slot + 3] = (d.t() @ xa).mul_(p.scale)  # (out, r)
    return d_xa


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
