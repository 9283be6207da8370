"""Sibling linears computed as one product (strategies/model/fused_linears.py): the same
outputs as each module's own, the parameters' names and values untouched and sharing one
storage, gradients through each module's own forward, and decoding with them gives
transformers' greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from test_decode_graph import _buffered, tiny  # noqa: F401 - tiny: the fixture, by its name
from weft.strategies.model.fused_linears import FusedLinears, fusable, fuse_siblings

pytestmark = pytest.mark.quick

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Attention(torch.nn.Module):
    def __init__(self, width=12, heads=(12, 4, 4), bias=True):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(width, n, bias=bias, dtype=torch.float64)
                                                 for n in heads)

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


@pytest.mark.parametrize("bias", [True, False])
def test_one_product_gives_each_modules_own_output(bias):
    torch.manual_seed(0)
    plain = _Attention(bias=bias)
    fused = copy.deepcopy(plain)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    group = FusedLinears([fused.q_proj, fused.k_proj, fused.v_proj])
    after = fused.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert fused.k_proj.weight.data_ptr() == group.weight[12:16].data_ptr()  # one storage, no copy
    calls = []
    fused.k_proj.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[-2]))
    x = torch.randn(2, 5, 12, dtype=torch.float64)  # (B, S, K)
    with torch.no_grad():
        assert torch.allclose(fused(x), plain(x), rtol=0, atol=1e-12)
        assert fused(x[:, :1]).shape == (2, 1, 20)  # one token (decoding), twice over
    assert calls == [0, 0]  # the key projection's own forward ran on zero tokens
    assert group._input is None and group._parts == []  # nothing kept past the group


def test_with_gradients_each_module_runs_its_own_forward():
    torch.manual_seed(1)
    plain = _Attention()
    fused = copy.deepcopy(plain)
    FusedLinears([fused.q_proj, fused.k_proj, fused.v_proj])
    x = torch.randn(3, 4, 12, dtype=torch.float64)
    plain(x).square().sum().backward()
    fused(x).square().sum().backward()
    for name, p in plain.named_parameters():
        assert torch.allclose(dict(fused.named_parameters())[name].grad, p.grad, rtol=0, atol=1e-12), name


def test_another_input_or_order_runs_the_modules_own_forward():
    torch.manual_seed(2)
    plain = _Attention()
    fused = copy.deepcopy(plain)
    FusedLinears([fused.q_proj, fused.k_proj, fused.v_proj])
    x, y = torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 3, 12, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(fused.q_proj(x), plain.q_proj(x), atol=1e-12)
        assert torch.allclose(fused.k_proj(y), plain.k_proj(y), atol=1e-12)  # not x's kept part
        assert torch.allclose(fused.v_proj(x), plain.v_proj(x), atol=1e-12)
        assert torch.allclose(fused.v_proj(y), plain.v_proj(y), atol=1e-12)  # taken once only
        assert torch.allclose(fused.k_proj(x), plain.k_proj(x), atol=1e-12)  # out of order


def test_a_longer_input_runs_each_modules_own_forward():
    """Over ``MAX_ROWS`` rows (a prefill) each module computes its own product."""
    plain = _Attention()
    fused = copy.deepcopy(plain)
    FusedLinears([fused.q_proj, fused.k_proj, fused.v_proj], max_rows=8)
    rows = []
    fused.k_proj.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[-2]))
    with torch.no_grad():
        for tokens in (9, 4):  # 2 x 9 rows: its own; 2 x 4: fused
            x = torch.randn(2, tokens, 12, dtype=torch.float64)
            assert torch.allclose(fused(x), plain(x), rtol=0, atol=1e-12)
    assert rows == [9, 0]


def test_compiled_the_group_is_one_product():
    """Inductor's code for a fused group: one product (the zero-token ones vanish), three unfused."""
    from torch._inductor.utils import run_and_get_code

    plain = _Attention(width=64, heads=(64, 16, 16))
    fused = copy.deepcopy(plain)
    FusedLinears([fused.q_proj, fused.k_proj, fused.v_proj])
    x = torch.randn(1, 1, 64, dtype=torch.float64)
    products = []
    for module in (plain, fused):
        torch._dynamo.reset()
        with torch.no_grad():
            out, code = run_and_get_code(torch.compile(module), x)
        assert torch.allclose(out, plain(x), rtol=0, atol=1e-12)
        products.append(sum(c.count("extern_kernels.addmm") + c.count("extern_kernels.mm(") for c in code))
    torch._dynamo.reset()
    assert products == [3, 1]


def test_what_cannot_share_a_storage_is_left_alone():
    a = _Attention()
    assert not fusable([a.q_proj])
    assert not fusable([a.q_proj, torch.nn.Linear(7, 4, dtype=torch.float64)])  # another input width
    assert not fusable([a.q_proj, torch.nn.Linear(12, 4)])  # another dtype
    assert not fusable([a.q_proj, torch.nn.Linear(12, 4, bias=False, dtype=torch.float64)])  # bias and none
    with torch.device("meta"):
        meta = _Attention()
    assert not fusable([meta.q_proj, meta.k_proj])
    with pytest.raises(ValueError, match="plain nn.Linear"):
        FusedLinears([a.q_proj, torch.nn.Linear(7, 4)])


def test_decoding_with_fused_siblings_gives_transformers_tokens(tiny):  # noqa: F811 - the fixture
    """The tiny Qwen2.5-VL: every text layer's q/k/v and every MLP's gate/up fused (the vision
    tower's MLPs too); decoding gives transformers' greedy tokens (compiled, one graph:
    tests/test_decode_compiled.py)."""
    model = copy.deepcopy(tiny["model"])
    layers = model.config.get_text_config().num_hidden_layers
    vision = model.config.vision_config.depth
    assert fuse_siblings(model, groups=GROUPS) == 2 * layers + vision
    tokens, logprobs, _ = _buffered({**tiny, "model": model})
    assert tokens == tiny["tokens"] and logprobs == pytest.approx(tiny["logprobs"], abs=1e-5)
