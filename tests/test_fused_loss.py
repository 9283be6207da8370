"""The fused lm_head + cross-entropy equals the plain form over materialised logits, and keeps no logits."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from weft.core.train.fused_loss import IGNORE, linear_cross_entropy_sum


def plain(hidden, weight, target, bias=None):
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias  # (N, V)
    acc = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.flatten(0, -2).to(acc), target.flatten(), ignore_index=IGNORE, reduction="sum")


def _case(dtype, *, n=37, h=16, v=53, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[:5] = IGNORE  # prompt tokens
    target[-1] = IGNORE  # the last position predicts nothing
    return hidden, weight, b, target


def _both(hidden, weight, bias, target, **kw):
    """(loss, grads) of the fused form and of the plain one, on fresh leaves."""
    out = []
    for fn in (lambda *a: linear_cross_entropy_sum(*a[:3], bias=a[3], **kw), lambda *a: plain(*a[:3], a[3])):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight)] + (
            [bias.clone().requires_grad_()] if bias is not None else [])
        loss = fn(leaves[0], leaves[1], target, leaves[2] if bias is not None else None)
        (loss * 1.5).backward()  # an incoming gradient other than 1
        out.append((loss.detach(), [x.grad for x in leaves]))
    return out


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.quick
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [1, 7, 37, 1000])  # one row a chunk, ragged last chunk, exact, one chunk
@pytest.mark.parametrize("bias", [False, True])
def test_equals_plain_form(dtype, tol, rows, bias):
    hidden, weight, b, target = _case(dtype, bias=bias)
    (got, got_grads), (want, want_grads) = _both(hidden, weight, b, target, chunk_rows=rows)
    assert got.dtype == want.dtype
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    assert len(got_grads) == len(want_grads) == (3 if bias else 2)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert _rel(g, w) <= tol


@pytest.mark.quick
def test_rows_from_chunk_bytes():
    """chunk_bytes counts float32 logits: 4 * V * 7 bytes make 7-row chunks (ragged: 37 = 5 * 7 + 2)."""
    hidden, weight, b, target = _case(torch.float64)
    (got, got_grads), (want, want_grads) = _both(hidden, weight, b, target, chunk_bytes=4 * 53 * 7)
    assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    assert all(_rel(g, w) <= 1e-12 for g, w in zip(got_grads, want_grads))


@pytest.mark.quick
def test_three_d_input():
    hidden, weight, b, target = _case(torch.float64, n=2 * 19)
    hidden, target = hidden.view(2, 19, -1), target.view(2, 19)
    (got, got_grads), (want, want_grads) = _both(hidden, weight, b, target, chunk_rows=5)
    assert got_grads[0].shape == (2, 19, 16)
    assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    assert all(_rel(g, w) <= 1e-12 for g, w in zip(got_grads, want_grads))


@pytest.mark.quick
def test_all_rows_ignored():
    hidden, weight, b, target = _case(torch.float64)
    target[:] = IGNORE
    (got, got_grads), _ = _both(hidden, weight, b, target, chunk_rows=7)
    assert got.item() == 0.0
    assert all(not g.any() for g in got_grads)


@pytest.mark.quick
@pytest.mark.parametrize("kw", [
    {},  # float32 sum of grad_weight, one vocabulary slice
    {"chunk_bytes": 2 * 16 * 10},  # float32 sum, slices of 10 vocabulary rows (ragged: 53 = 5 * 10 + 3)
    {"weight_grad_dtype": torch.bfloat16},  # summed in place in bf16
])
def test_bf16_close_to_plain(kw):
    """bf16 inputs: float32 loss; gradients within a few bf16 steps of the plain form's."""
    hidden, weight, b, target = _case(torch.bfloat16, bias=False)
    (got, got_grads), (want, want_grads) = _both(hidden, weight, b, target, chunk_rows=4, **kw)
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    assert all(g.dtype == torch.bfloat16 and _rel(g.float(), w.float()) <= 2**-6 for g, w in zip(got_grads, want_grads))


@pytest.mark.quick
def test_float32_sum_of_weight_grad_beats_bf16_sum():
    """Over 64 chunks, grad_weight summed in float32 and rounded once is nearer the exact
    gradient than one summed in bf16 (rounded at every chunk)."""
    hidden, weight, _, target = _case(torch.bfloat16, n=256, bias=False)
    exact = weight.double().requires_grad_()
    plain(hidden.double(), exact, target).backward()

    def error(dtype):
        w = weight.clone().requires_grad_()
        linear_cross_entropy_sum(hidden, w, target, chunk_rows=4, weight_grad_dtype=dtype).backward()
        return ((w.grad.double() - exact.grad).norm() / exact.grad.norm()).item()

    assert error(torch.float32) < 0.5 * error(torch.bfloat16)


@pytest.mark.quick
@pytest.mark.parametrize("chunk_bytes", [512 << 20, 5 * 4 * 256])  # one vocabulary slice; slices of 5 (53 = 10 x 5 + 3)
def test_bf16_weight_grad_is_the_float32_sum_rounded_once(chunk_bytes):
    """A bf16 weight's gradient by default: the float32 sum over row chunks, rounded once
    (narrowed in its own storage, a vocabulary slice at a time): bias and ignored rows
    included, bit for bit the float32 sum's .to(bf16), far nearer the exact gradient than a
    bf16 running sum."""
    hidden, weight, bias, target = _case(torch.bfloat16, n=256, bias=True)
    target[100:110] = IGNORE
    exact = [x.double().requires_grad_() for x in (weight, bias)]
    plain(hidden.double(), exact[0], target, exact[1]).backward()

    def grads(**kw):
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        linear_cross_entropy_sum(hidden, w, target, bias=b, chunk_rows=4, chunk_bytes=chunk_bytes, **kw).backward()
        return w.grad, b.grad

    def errors(got):
        return [((x.double() - e.grad).norm() / e.grad.norm()).item() for x, e in zip(got, exact)]

    default = grads()
    assert default[0].dtype == torch.bfloat16 and default[0].shape == weight.shape
    assert errors(default)[0] < 0.5 * errors(grads(weight_grad_dtype=torch.bfloat16))[0]
    # The same float32 sum, rounded by a plain .to(): equal bit for bit.
    from weft.core.train import fused_loss

    sums = []
    original = fused_loss._narrow
    fused_loss._narrow = lambda wide, dtype, rows: sums.append(wide.clone()) or original(wide, dtype, rows)
    try:
        again = grads()
    finally:
        fused_loss._narrow = original
    # (the last narrowing is the sum's; each chunk of logits gradients is narrowed before it)
    assert torch.equal(again[0], default[0]) and torch.equal(sums[-1].to(torch.bfloat16), default[0])


def test_the_gpus_one_pass_chunk_gradient_is_the_in_place_one():
    """On CUDA the backward makes each chunk's gradient with core/train/loss.py's compiled
    ``chunk_backward`` (float32 logits in, the matmuls' bf16 out): eager, it equals the CPU's
    in-place passes bit for bit; compiled (Inductor's CPU code here), within one bf16 rounding."""
    from torch._inductor.utils import run_and_get_code

    from weft.core.train.fused_loss import softmax_grad_in_place
    from weft.core.train.loss import chunk_backward, chunk_forward

    g = torch.Generator().manual_seed(3)
    x = torch.randn(23, 301, generator=g) * 4  # (C, V) float32 logits
    t = torch.randint(0, 301, (23,), generator=g)
    t[:4] = IGNORE
    lse, _ = chunk_forward(x, t, torch.float32)
    grad = torch.tensor(1.7)
    want = softmax_grad_in_place(x.clone(), t, lse, grad, torch.bfloat16)
    assert want.dtype == torch.bfloat16 and torch.all(want[:4] == 0) and want.abs().max() > 0.1
    assert torch.equal(chunk_backward(x, t, lse, grad, torch.bfloat16), want)
    got, code = run_and_get_code(torch.compile(chunk_backward), x, t, lse, grad, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.all(got[:4] == 0)
    assert (got.float() - want.float()).abs().max() <= 2**-8 * want.float().abs().max()
    # One pass: one kernel, whose one buffer is the bf16 gradient (no float32 softmax written between).
    kernels, buffers = re.findall(r"\bcpp_fused\w* = ", code[0]), re.findall(r"\bbuf\d+ = empty_strided", code[0])
    assert len(kernels) == 1 and len(buffers) == 1


@pytest.mark.quick
@pytest.mark.parametrize(("rows", "vocab_rows"), [(53, 5), (53, 53), (53, 1), (7, 100), (1, 1)])
def test_narrowing_in_place_equals_to(rows, vocab_rows):
    """float32 -> bf16 into the float32 tensor's own storage, slice by slice (ragged and
    single-slice cases, the self-overlapping first slice), equals .to(bf16); no new storage."""
    from weft.core.train.fused_loss import _narrow

    wide = torch.randn(rows, 12, generator=torch.Generator().manual_seed(rows), dtype=torch.float32) * 1e3
    want = wide.to(torch.bfloat16)
    storage = wide.untyped_storage().data_ptr()
    got = _narrow(wide, torch.bfloat16, vocab_rows)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and torch.equal(got, want)
    assert got.untyped_storage().data_ptr() == storage


@pytest.mark.quick
def test_autocast_matches_plain_form_under_autocast():
    """float32 leaves under bf16 autocast: logits from a bf16 matmul, as F.linear would make them."""
    hidden, weight, _, target = _case(torch.float32, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (got, got_grads), (want, want_grads) = _both(hidden, weight, None, target, chunk_rows=7)
    assert got.dtype == torch.float32 and abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    assert all(g.dtype == torch.float32 and _rel(g, w) <= 2**-6 for g, w in zip(got_grads, want_grads))


@pytest.mark.quick
def test_float32_weight_with_bf16_hidden():
    """A float32 lm_head over bf16 hidden states: the matmul in float32, as hidden.float() @ weight.T."""
    hidden, weight, _, target = _case(torch.float32, bias=False)
    hidden = hidden.bfloat16()
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = linear_cross_entropy_sum(x, w, target, chunk_rows=7)
    got.backward()
    y, v = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = plain(y.float(), v, target)
    want.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    assert x.grad.dtype == torch.bfloat16 and _rel(x.grad.float(), y.grad.float()) <= 2**-7
    assert _rel(w.grad, v.grad) <= 1e-5


@pytest.mark.quick
def test_frozen_weight_gets_no_gradient():
    hidden, weight, _, target = _case(torch.float64, bias=False)
    x = hidden.clone().requires_grad_()
    linear_cross_entropy_sum(x, weight, target, chunk_rows=7).backward()
    y = hidden.clone().requires_grad_()
    plain(y, weight, target).backward()
    assert weight.grad is None and _rel(x.grad, y.grad) <= 1e-12


def test_gradcheck():
    hidden, weight, b, target = _case(torch.float64, n=6, h=3, v=5)
    target[:2] = IGNORE
    args = [x.clone().requires_grad_() for x in (hidden, weight, b)]
    assert torch.autograd.gradcheck(
        lambda x, w, bb: linear_cross_entropy_sum(x, w, target, bias=bb, chunk_rows=4), args)


@pytest.mark.quick
def test_keeps_no_logits_for_backward():
    """Everything autograd keeps between forward and backward, caught by a saved-tensors hook:
    no tensor of N * V elements (the plain form keeps its log-softmax, which is)."""
    n, v = 37, 53
    hidden, weight, b, target = _case(torch.float64, n=n, v=v)

    def saved(fn):
        sizes = []

        def pack(x):
            sizes.append(x.numel())
            return x

        leaves = [x.clone().requires_grad_() for x in (hidden, weight, b)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = fn(*leaves)
        loss.backward()
        return sizes

    fused = saved(lambda x, w, bb: linear_cross_entropy_sum(x, w, target, bias=bb, chunk_rows=7))
    assert sorted(fused) == sorted([hidden.numel(), weight.numel(), v, n, n])  # inputs, bias, target, LSE
    assert n * v not in fused and max(fused) < n * v
    assert n * v in saved(lambda x, w, bb: plain(x, w, target, bb))  # the hook does see logits-sized tensors
