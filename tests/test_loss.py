"""The chunked float32 cross-entropy equals torch's whole-tensor one, and keeps less for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weft.core.train.loss import IGNORE, token_loss_sum


def reference(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.flatten(0, 1).to(acc), target.flatten(), ignore_index=IGNORE, reduction="sum")


def _case(dtype, *, seed=0, b=2, s=37, v=53):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, v, generator=g, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, v, (b, s), generator=g)
    target[0, :5] = IGNORE  # prompt tokens
    target[1, -1] = IGNORE  # the last position predicts nothing
    return logits, target


# bf16 gradients: both forms round a float32 gradient to bf16 once; the two float32
# values may differ in their last bits, so an element may land one bf16 step apart.
@pytest.mark.quick
@pytest.mark.parametrize(
    "dtype, tol, grad_tol",
    [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-6, 1e-6), (torch.bfloat16, 1e-6, 2**-8)],
)

@pytest.mark.parametrize("rows", [1, 7, 74, 1000])  # one row per chunk, ragged last chunk, exact split, one chunk
def test_equals_torch_cross_entropy(dtype, tol, grad_tol, rows):
    logits, target = _case(dtype)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = token_loss_sum(a, target, chunk_bytes=4 * logits.shape[-1] * rows)
    want = reference(b, target)
    assert got.dtype == want.dtype
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    got.backward(torch.tensor(0.37, dtype=got.dtype))
    want.backward(torch.tensor(0.37, dtype=want.dtype))
    assert a.grad.dtype == dtype
    scale = b.grad.double().abs().max()
    assert (a.grad.double() - b.grad.double()).abs().max() <= grad_tol * scale
    assert torch.all(a.grad[0, :5] == 0)  # ignored rows get no gradient


def test_gradcheck_float64():
    logits, target = _case(torch.float64, b=3, s=5, v=11)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_loss_sum(x, target, chunk_bytes=4 * 11 * 4), (logits,))


@pytest.mark.quick
def test_everything_ignored_is_zero_with_zero_gradient():
    logits, target = _case(torch.float32)
    target[:] = IGNORE
    x = logits.clone().requires_grad_()
    loss = token_loss_sum(x, target, chunk_bytes=4 * 53 * 3)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(x.grad == 0)


def _saved_bytes(fn, logits, target) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t)] = t.numel() * t.element_size()  # by identity: the same tensor saved twice counts once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, target)
    return sum(seen.values())


@pytest.mark.quick
def test_keeps_no_float32_copy_of_the_logits_for_backward():
    logits, target = _case(torch.bfloat16, s=64, v=512)
    logits.requires_grad_()
    mine = _saved_bytes(lambda x, t: token_loss_sum(x, t, chunk_bytes=4 * 512 * 16), logits, target)
    whole = _saved_bytes(reference, logits, target)
    size = logits.numel() * logits.element_size()
    assert mine <= size + logits.shape[0] * logits.shape[1] * 4 + target.numel() * 8  # logits, one lse per row, targets
    assert whole >= 2 * size  # torch's form keeps its float32 log-softmax


def _head_case(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 19, 16, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(53, 16, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, 53, (2, 19), generator=g)
    target[0, :4] = IGNORE
    return hidden, weight, target


def _head_grads(hidden, weight, target, *, reuse, cap=None):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = torch.nn.functional.linear(h, w)  # (B, S, V): a product, as a model's head makes them
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap  # tanh's backward reads its output
    seen = {}
    logits.register_hook(lambda grad: seen.update(grad_ptr=grad.data_ptr()))
    loss = token_loss_sum(logits, target, chunk_bytes=4 * 53 * 5, reuse_logits=reuse)
    loss.backward()
    return loss.detach(), h.grad, w.grad, seen["grad_ptr"] == logits.data_ptr()


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_logits_take_their_gradient_with_the_same_values(dtype):
    hidden, weight, target = _head_case(dtype)
    loss, gh, gw, in_place = _head_grads(hidden, weight, target, reuse=True)
    ref_loss, ref_gh, ref_gw, ref_in_place = _head_grads(hidden, weight, target, reuse=False)
    assert in_place and not ref_in_place  # the gradient lives in the logits' own storage only when asked
    assert torch.equal(loss, ref_loss) and torch.equal(gh, ref_gh) and torch.equal(gw, ref_gw)


@pytest.mark.quick
def test_logits_whose_producer_reads_them_are_not_reused():
    hidden, weight, target = _head_case()
    loss, gh, gw, in_place = _head_grads(hidden, weight, target, reuse=True, cap=3.0)
    ref_loss, ref_gh, ref_gw, _ = _head_grads(hidden, weight, target, reuse=False, cap=3.0)
    assert not in_place  # a soft-cap's tanh keeps its output for backward: overwriting it would be wrong
    assert torch.equal(gh, ref_gh) and torch.equal(gw, ref_gw)


def test_compiled_chunk_kernels_equal_the_eager_ones():
    from weft.core.train.loss import chunk_backward, chunk_forward

    logits, target = _case(torch.bfloat16, s=40, v=97)
    x, t = logits.flatten(0, 1), target.flatten()
    grad = torch.tensor(0.37)
    lse, part = chunk_forward(x, t, torch.float32)
    c_lse, c_part = torch.compile(chunk_forward)(x, t, torch.float32)
    assert torch.allclose(c_lse, lse, rtol=1e-6) and torch.allclose(c_part, part, rtol=1e-6)
    g = chunk_backward(x, t, lse, grad)
    c_g = torch.compile(chunk_backward)(x, t, lse, grad)
    assert c_g.dtype == torch.bfloat16 and (c_g.float() - g.float()).abs().max() <= 2**-8 * g.float().abs().max()
    assert torch.all(c_g[:5] == 0)  # ignored rows
