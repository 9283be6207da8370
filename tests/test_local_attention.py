"""One rank's whole-sequence attention through weft's block kernels, and flash-attn-4's dispatch.

flash-attn-4 runs only on Hopper/Blackwell GPUs; here a stand-in module with the real
package's signatures (``flash_attn.cute.interface._flash_attn_fwd/_flash_attn_bwd``,
(B, S, H, D) tensors, native GQA, LSE (B, H, S)) computes exact attention in float64, so
the wrapper's layout, argument order and GQA handling are proven on the CPU; the GPU
check (benchmarks/attention/kernels_check.py) covers the real kernel's numbers.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from weft.strategies.attention.kernels import blocks as block_kernels
from weft.strategies.attention.kernels.blocks import KERNELS, select_kernel
from weft.strategies.attention.local import local_attention

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)


def _inputs(*, heads=4, kv_heads=2, seq=24, head_dim=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, seq, head_dim), (2, kv_heads, seq, head_dim), (2, kv_heads, seq, head_dim),
              (2, heads, seq, head_dim)]
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]  # q, k, v, dout: (B, H, S, D)


def _reference(q, k, v, dout, *, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ours(q, k, v, dout, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = local_attention(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _close(got, want, tol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert ((g - w).abs().max() / w.abs().max()).item() <= tol, name


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_local_attention_equals_sdpa(kernel, causal):
    """GQA included (4 query heads on 2 KV heads): kernels without native GQA get expanded K/V."""
    q, k, v, dout = _inputs()
    _close(_ours(q, k, v, dout, causal=causal, backend=kernel), _reference(q, k, v, dout, causal=causal), 1e-10)


# ---------------------------------------------------------------------------
# flash-attn-4, through a stand-in with the package's signatures
# ---------------------------------------------------------------------------


def _fake_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
              max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
              causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
              tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1,
              pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
              return_lse=False, **rest):
    if cu_seqlens_q is not None:  # variable length: (S, H, D) packed segments, LSE (H, S)
        outs = [_fake_fwd(q[None, a:b], k[None, a:b], v[None, a:b], softmax_scale=softmax_scale, causal=causal,
                          return_lse=True)[:2] for a, b in _bounds(cu_seqlens_q, max_seqlen_q)]
        _fake_fwd.calls -= len(outs) - 1
        return (torch.cat([o[0][0] for o in outs]), torch.cat([o[1][0] for o in outs], dim=1) if return_lse else None,
                None, None, None)
    # (B, S, H, D) in, like flash-attn-4; GQA natively.
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    groups = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    s = qh @ kh.transpose(-1, -2) * softmax_scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, S)
    out = (torch.softmax(s, dim=-1) @ vh).transpose(1, 2).contiguous()  # (B, S, H, D)
    _fake_fwd.calls += 1
    return out, (lse if return_lse else None), None, None, None


def _bounds(cu_seqlens, max_seqlen):
    assert cu_seqlens.dtype == torch.int32, "flash-attn-4 takes int32 cumulative lengths"
    bounds = cu_seqlens.tolist()
    assert max_seqlen == max(b - a for a, b in zip(bounds[:-1], bounds[1:])), "max_seqlen must be the longest"
    return list(zip(bounds[:-1], bounds[1:]))


def _fake_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, cu_seqlens_q=None,
              max_seqlen_q=None, **rest):
    if cu_seqlens_q is not None:
        grads = [_fake_bwd(q[None, a:b], k[None, a:b], v[None, a:b], out[None, a:b], dout[None, a:b],
                           lse[None, :, a:b], softmax_scale, causal) for a, b in _bounds(cu_seqlens_q, max_seqlen_q)]
        _fake_bwd.calls -= len(grads) - 1
        return tuple(torch.cat([g[i][0] for g in grads]) for i in range(3))
    qh, kh, vh, oh, doh = (t.transpose(1, 2) for t in (q, k, v, out, dout))
    groups = qh.shape[1] // kh.shape[1]
    ke, ve = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    s = qh @ ke.transpose(-1, -2) * softmax_scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))  # the true softmax, from the given LSE
    dv = p.transpose(-1, -2) @ doh
    ds = p * (doh @ ve.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True))
    dq, dk = ds @ ke * softmax_scale, ds.transpose(-1, -2) @ qh * softmax_scale

    def fold(x):  # (B, H, S, D) -> (B, S, KV, D): GQA gradients summed per KV head
        b, h, n, d = x.shape
        return x.view(b, h // groups, groups, n, d).sum(2).transpose(1, 2)

    _fake_bwd.calls += 1
    return dq.transpose(1, 2), fold(dk), fold(dv)


@pytest.fixture
def fake_fa4(monkeypatch):
    package, cute, interface = (types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute",
                                                              "flash_attn.cute.interface"))
    interface._flash_attn_fwd, interface._flash_attn_bwd = _fake_fwd, _fake_bwd
    _fake_fwd.calls = _fake_bwd.calls = 0
    package.cute, cute.interface = cute, interface
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers probes installed packages
        monkeypatch.setitem(sys.modules, name, module)
    block_kernels.fa4_importable.cache_clear()
    yield interface
    block_kernels.fa4_importable.cache_clear()


@pytest.fixture
def no_fa4(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    block_kernels.fa4_importable.cache_clear()
    yield
    block_kernels.fa4_importable.cache_clear()


@pytest.mark.parametrize("causal", [True, False])
def test_flash_kernel_layout_and_gqa(fake_fa4, causal):
    """The flash kernel's wrapper hands (B, S, H, D) views and the LSE through unchanged."""
    q, k, v, dout = _inputs(heads=6, kv_heads=2, head_dim=8)
    _close(_ours(q, k, v, dout, causal=causal, kernel=KERNELS["flash"]), _reference(q, k, v, dout, causal=causal),
           1e-10)
    assert fake_fa4._flash_attn_fwd.calls == 1 and fake_fa4._flash_attn_bwd.calls == 1


@pytest.mark.parametrize("head_dim", [80, 36])
def test_flash_kernel_pads_unchecked_head_dims(fake_fa4, monkeypatch, head_dim):
    """flash-attn-4 is called only at head dims checked on the GPU (32, 64, 128): others are
    zero-padded to the next, the scale staying the true head_dim's; results exact."""
    widths = []
    real_fwd, real_bwd = fake_fa4._flash_attn_fwd, fake_fa4._flash_attn_bwd

    def fwd(q, k, v, **kw):
        widths.append(q.shape[-1])
        return real_fwd(q, k, v, **kw)

    def bwd(q, *args, **kw):
        widths.append(q.shape[-1])
        return real_bwd(q, *args, **kw)

    monkeypatch.setattr(fake_fa4, "_flash_attn_fwd", fwd)
    monkeypatch.setattr(fake_fa4, "_flash_attn_bwd", bwd)
    q, k, v, dout = _inputs(heads=4, kv_heads=2, head_dim=head_dim)
    _close(_ours(q, k, v, dout, causal=True, kernel=KERNELS["flash"]), _reference(q, k, v, dout, causal=True), 1e-10)
    assert widths == [128 if head_dim > 64 else 64] * 2


def test_flash_kernel_as_ring_block(fake_fa4):
    """Ring of 4 (emulated) with the flash kernel: LSE merges and per-block backward are exact."""
    from weft.strategies.attention.emulate import emulate_ring
    from weft.strategies.sequence.layout import shard_sequence, unshard_sequence

    q, k, v, dout = _inputs(heads=4, kv_heads=2, seq=32, head_dim=8)

    def parts(t):
        return [shard_sequence(t, dim=2, rank=r, world=4, layout="zigzag") for r in range(4)]

    outs, grads = emulate_ring(parts(q), parts(k), parts(v), parts(dout), causal=True, scale=8**-0.5,
                               layout="zigzag", kernel=KERNELS["flash"])
    got = [unshard_sequence(outs, dim=2, layout="zigzag")] + [
        unshard_sequence([g[i] for g in grads], dim=2, layout="zigzag") for i in range(3)]
    _close(got, _reference(q, k, v, dout, causal=True), 1e-10)


@pytest.mark.parametrize(
    ("capability", "head_dim", "masked", "want"),
    [((9, 0), 128, False, "flash"), ((9, 0), 80, False, "flash"), ((10, 0), 128, False, "flash"),
     ((10, 0), 256, False, "torch_flash"), ((8, 0), 128, False, "cudnn"), ((9, 0), 128, True, "cudnn"),
     ((9, 0), 36, False, "flash"), ((9, 0), 160, False, "torch_flash")],
)
def test_auto_picks_flash_where_it_runs(fake_fa4, monkeypatch, capability, head_dim, masked, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = select_kernel("auto", device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=head_dim, masked=masked)
    assert got.name == want


def test_auto_without_the_package_is_cudnn(no_fa4):
    assert select_kernel("auto", device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128).name == "cudnn"
    with pytest.raises(ValueError, match="backend 'flash' needs the flash-attn-4 package"):
        select_kernel("flash", device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128)


def test_auto_strategy_without_sp(fake_fa4):
    """No sequence parallelism: the local kernel path when flash-attn-4 is installed or a kernel is named."""
    from weft.plugins.attention import resolve_auto

    assert resolve_auto("auto", ulysses=1, ring=1) == "local"
    assert resolve_auto("auto", ulysses=2, ring=1) == "ulysses"
    assert resolve_auto("auto", ulysses=1, ring=1, packed=True) == "ring"
    assert resolve_auto("sdpa", ulysses=1, ring=1) == "sdpa"
    # A vision tower: its windows in one varlen call, whatever the mesh (images stay whole).
    from weft.plugins.attention import resolve_vision

    assert resolve_vision("auto") == resolve_vision("local") == "vision_local"
    assert resolve_vision("sdpa") == "sdpa" and resolve_vision("vision_ulysses") == "vision_ulysses"


def test_auto_strategy_without_the_package_stays_sdpa(no_fa4):
    from weft.plugins.attention import resolve_auto

    assert resolve_auto("auto", ulysses=1, ring=1) == "sdpa"
    from weft.plugins.attention import resolve_vision

    assert resolve_vision("auto") == "sdpa" and resolve_vision("auto", backend="cudnn") == "vision_local"
    assert resolve_auto("auto", ulysses=1, ring=1, backend="cudnn") == "local"


def test_local_binding_keeps_flash_out_of_its_name(fake_fa4):
    """transformers switches to its varlen calling convention for any name holding "flash"."""
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe.rule_engine import Decision, ModuleInfo
    from weft.plugins.attention import RingParams, weft_attention

    class _Mesh(dict):
        def __getitem__(self, key):
            return types.SimpleNamespace(get_group=lambda: None)

    plan = types.SimpleNamespace(mesh=types.SimpleNamespace(ulysses=1, ring=1), packed=lambda: False)
    auto = build_plugin_manager(entry_points=False).registry.get("attention", "auto")

    def install(path, modality):
        # As the Plan resolves 'auto' for the module, then as the run installs the result.
        info = ModuleInfo(path=path, class_name="A", kind="attention", modality=modality)
        name, params = auto.resolve(RingParams(backend="flash"), info=info, plan=plan)
        decision = Decision(point="attention", strategy=name, params=params, source="t:1", rule="test",
                            resolved_from="auto")
        return weft_attention(decision=decision, module_path=path, plan=plan, mesh=_Mesh(), ctx=None)

    binding = install("model.language_model.layers.0.self_attn", "text")
    assert binding.name.startswith("weft_local_") and "flash" not in binding.name
    vision = install("model.visual.blocks.0.attn", "vision")
    # The vision tower, on the contrary, wants transformers' varlen convention: one call per block.
    assert vision.name.startswith("weft_flash_vision_local_")


# ---------------------------------------------------------------------------
# the vision tower's windows in one variable-length call
# ---------------------------------------------------------------------------


@pytest.fixture
def varlen_on_cpu(fake_fa4, monkeypatch):
    """The stand-in's variable-length path, taken on the CPU in float64 (the real kernel: GPU, 16-bit)."""
    from weft.strategies.attention import segment as segment_attention

    monkeypatch.setattr(segment_attention, "varlen_runs", lambda q: True)
    return fake_fa4


def test_segments_in_one_varlen_call_equal_the_loop(varlen_on_cpu):
    from weft.strategies.attention.segment import segment_attention, segment_loop

    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 12, 13, 28], dtype=torch.int64)  # the loop needs no int32; the kernel gets it
    base = [torch.randn(28, 3, 8, generator=g, dtype=torch.float64) for _ in range(4)]  # (S, H, D) memory
    views = [t.transpose(0, 1).unsqueeze(0) for t in base]  # (1, H, S, D) views, as transformers hands them
    got = _ours_segments(segment_attention, views, cu, max_seqlen=15)
    want = _ours_segments(segment_loop, views, cu)
    _close(got, want, 1e-12)
    assert varlen_on_cpu._flash_attn_fwd.calls == 1 and varlen_on_cpu._flash_attn_bwd.calls == 1
    # Without max_seqlen it is found from the lengths (one host sync).
    _close(_ours_segments(segment_attention, views, cu), want, 1e-12)


def _ours_segments(fn, views, cu, **kw):
    q, k, v = (t.clone().requires_grad_() for t in views[:3])
    out = fn(q, k, v, cu_seqlens=cu, scale=0.3, **kw)
    out.backward(views[3])
    return out.detach(), q.grad, k.grad, v.grad


def test_vision_tower_through_the_varlen_binding_equals_sdpa(varlen_on_cpu):
    """transformers' own Qwen2.5-VL vision tower (window blocks and a full-attention block,
    two images): the flash-named binding gets cu_seqlens and max_seqlen, one call per block,
    and gives SDPA's outputs and gradients."""
    import transformers
    from transformers import AttentionInterface

    from weft.core.recipe.presets import build_config, load_preset
    from weft.core.train.attention_install import set_attention_names
    from weft.strategies.attention.hf_bridge import make_vision_attention_function

    config = build_config(*load_preset("qwen2_5_vl_tiny")[:2])
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).double()
    vc = config.vision_config
    grid = torch.tensor([[1, 8, 8], [1, 4, 12]])  # two images: several windows of 4x4 merged patches each
    pixels = torch.randn(int(grid.prod(-1).sum()), vc.in_channels * vc.temporal_patch_size * vc.patch_size**2,
                         dtype=torch.float64)
    AttentionInterface.register("weft_flash_vision_test", make_vision_attention_function(group=None, rank=0, world=1))
    results = []
    for name in ("sdpa", "weft_flash_vision_test"):
        model.zero_grad()
        set_attention_names(model, {"vision_config": name, "text_config": "sdpa"})
        out = model.model.visual(pixels, grid_thw=grid).pooler_output  # (merged patches, hidden)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out))
        results.append((out.detach(), [p.grad.clone() for p in model.model.visual.parameters()]))
    (out_sdpa, grads_sdpa), (out_ours, grads_ours) = results
    assert torch.allclose(out_ours, out_sdpa, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_ours, grads_sdpa):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    blocks = len(model.model.visual.blocks)
    assert varlen_on_cpu._flash_attn_fwd.calls == blocks and varlen_on_cpu._flash_attn_bwd.calls == blocks
