"""Attention hook: which function each attention module calls, via transformers' AttentionInterface.

``sdpa``/``eager`` are names transformers already knows. ``ring``, ``ulysses``
and ``usp`` register a function bound to this run's process groups; ``local``
one that runs a weft block kernel (flash-attn-4) on the whole local sequence.
``auto`` picks from the mesh: ring when only ring > 1, ulysses when only
ulysses > 1, usp when both; without sequence parallelism ``local`` when the
backend asks for a kernel (or flash-attn-4 is installed), else ``sdpa``. A vision
tower's ``auto``: each block's windows in one flash-attn-4 varlen call where it is
installed (``vision_local``), else ``sdpa``.
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import AttentionBinding, NoParams, Strategy

Layout = Literal["zigzag", "contiguous"]
Backend = Literal["auto", "math", "cpu_flash", "cudnn", "torch_flash", "flash", "triton"]


@attrs.frozen(kw_only=True)
class VisionUlyssesParams:
    min_patches: int = attrs.field(default=0, metadata={
        "doc": "an image with at least this many patches makes all SP ranks share the tower "
               "(Ulysses over patches); 0 = always; smaller images are spread over the ranks"})


@attrs.frozen(kw_only=True)
class RingParams:
    layout: Layout = attrs.field(default="zigzag", metadata={"doc": "how the sequence is split over the ring ranks"})
    backend: Backend = attrs.field(default="auto", metadata={
        "doc": "block kernel: auto = flash-attn-4 on GPU where installed, else cuDNN; torch's fused op on CPU; "
               "flash = flash-attn-4 (the flash-attn-4 package); torch_flash = torch's flash SDPA op; "
               "triton = cuDNN forward + a backward that keeps gradients in float32 across ring steps (GPU)"})


@attrs.frozen(kw_only=True)
class KernelParams:
    backend: Backend = attrs.field(default="auto", metadata={
        "doc": "kernel for the local attention: auto = flash-attn-4 on GPU where installed, else torch's SDPA; "
               "flash = flash-attn-4; cudnn, torch_flash, math, cpu_flash = that kernel"})


#: Block kernels that run only on CUDA with bf16 inputs (torch's CUDA SDPA ops, Triton).
_GPU_BACKENDS = ("cudnn", "torch_flash", "flash", "triton")


#: Block kernels that take a document mask (packed sequences).
_MASK_BACKENDS = ("auto", "math", "cudnn", "triton")


def check_backend(params, *, recipe, plan) -> str | None:
    """Plan time: a block kernel that cannot run this recipe (a GPU-only kernel on a
    CPU or float32 run, a kernel without document masks under packing) is refused
    here, with the keys to change, rather than failing inside the first forward."""
    backend = getattr(params, "backend", "auto")
    if plan.packed() and backend not in _MASK_BACKENDS:
        return (f"backend = {backend!r} takes no document mask, and batching packs documents (pack = true); "
                f"backends for packed sequences: {', '.join(_MASK_BACKENDS)}")
    if backend not in _GPU_BACKENDS:
        return None
    device = recipe.parallel.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and recipe.train.precision == "bf16":
        return None
    return (f"backend = {backend!r} runs on CUDA in bf16, but this run trains on {device} in {recipe.train.precision} "
            f"(parallel.device, train.precision); backends that run here: auto, math, cpu_flash")


@hookimpl
def weft_strategies():
    return [
        Strategy(point="attention", name="sdpa", params=NoParams,
                 summary="torch SDPA on the whole local sequence (no sequence parallelism)"),
        Strategy(point="attention", name="eager", params=NoParams,
                 summary="transformers' eager attention (reference; slow)"),
        Strategy(point="attention", name="ring", params=RingParams,
                 summary="ring attention over the ring ranks, async K/V rotation, exact backward",
                 sp_dims=("ring",), check=check_backend),
        Strategy(point="attention", name="local", params=KernelParams,
                 summary="a weft block kernel (flash-attn-4 where installed) on the whole local sequence; "
                         "no sequence parallelism", check=check_backend),
        Strategy(point="attention", name="ulysses", params=KernelParams,
                 summary="head/sequence all-to-all over the Ulysses ranks; "
                         "KV heads replicated when fewer than the degree",
                 sp_dims=("ulysses",), head_split=("ulysses",), check=check_backend),
        Strategy(point="attention", name="usp", params=RingParams,
                 summary="Ulysses inside, ring outside (2-D)",
                 sp_dims=("ulysses", "ring"), head_split=("ulysses",), check=check_backend),
        Strategy(point="attention", name="auto", params=RingParams,
                 summary="sdpa, ring, ulysses or usp from the mesh's ulysses and ring degrees",
                 sp_dims=("ulysses", "ring"), head_split=("ulysses",), check=check_backend),
        Strategy(point="attention", name="vision_ulysses", params=VisionUlyssesParams,
                 summary="vision tower: large images' patches split over all SP ranks, "
                         "Ulysses in every block (window and full)",
                 sp_dims=("ulysses", "ring"), head_split=("ring", "ulysses")),
    ]


def resolve_auto(strategy: str, *, ulysses: int, ring: int, packed: bool = False, backend: str = "auto") -> str:
    """``auto`` -> the strategy the mesh needs. Packed documents without sequence
    parallelism take ``ring`` on one rank: weft's kernels read the document ids.
    Without either, ``local`` when a kernel is asked for by name or flash-attn-4 is
    installed (it runs where it can, torch's SDPA elsewhere), else transformers' ``sdpa``."""
    if strategy != "auto":
        return strategy
    if ulysses > 1 and ring > 1:
        return "usp"
    if ulysses > 1 or ring > 1 or packed:
        return "ulysses" if ulysses > 1 else "ring"
    from weft.strategies.attention.kernels.blocks import fa4_importable

    return "local" if backend != "auto" or fa4_importable() else "sdpa"


def resolve_vision(strategy: str, *, backend: str = "auto") -> str:
    """A vision tower's ``auto`` (and ``local``): its windows and images as the segments of
    one flash-attn-4 call per block (``vision_local``) where flash-attn-4 is installed or a
    kernel is named, else transformers' ``sdpa`` (one call per window). Images stay whole
    on a rank either way; sharing one over the SP ranks is ``vision_ulysses``'s, by rule."""
    if strategy == "local" or (strategy == "auto" and backend != "auto"):
        return "vision_local"
    if strategy == "auto":
        from weft.strategies.attention.kernels.blocks import fa4_importable

        return "vision_local" if fa4_importable() else "sdpa"
    return strategy


def traceable(decision, module_path: str, plan) -> bool:
    """Whether torch.compile may trace this attention module whole: the functions that run
    one kernel on the local sequence (``local``: weft's operators; ``sdpa``: torch's), not
    those with collectives (ring, ulysses, usp) nor the vision tower's varlen call."""
    if plan.modality_of(module_path) == "vision":
        return False
    strategy = resolve_auto(decision.strategy, ulysses=plan.mesh.ulysses, ring=plan.mesh.ring,
                            packed=plan.packed(), backend=getattr(decision.params, "backend", "auto"))
    return strategy in ("local", "sdpa")


@hookimpl
def weft_attention(decision, module_path, plan, mesh, ctx):
    backend = getattr(decision.params, "backend", "auto")
    # The tower by its declared modality (the adapter's), as the planner knows it: not by its name.
    vision = plan.modality_of(module_path) == "vision"
    if vision:
        strategy = resolve_vision(decision.strategy, backend=backend)
    else:
        strategy = resolve_auto(decision.strategy, ulysses=plan.mesh.ulysses, ring=plan.mesh.ring,
                                packed=plan.packed(), backend=backend)
    if strategy in ("sdpa", "eager", "local") and plan.packed() and not vision:
        from weft.core.errors import PlanError

        raise PlanError(f"{module_path}: packed documents need attention that keeps to each document; "
                        f"{strategy!r} does not read document ids (use auto, ring, ulysses or usp)")
    if strategy in ("sdpa", "eager"):
        # Names transformers already registers: nothing to add to the interface.
        return AttentionBinding(name=strategy)
    if strategy in ("vision_ulysses", "vision_local"):
        from weft.strategies.attention.hf_adapter import make_vision_attention_function

        if strategy == "vision_local":
            fn = make_vision_attention_function(group=None, rank=0, world=1)
        else:
            fn = make_vision_attention_function(group=mesh.sp.get_group(), rank=mesh.sp.get_local_rank(),
                                                world=plan.mesh.sp)
        # "flash" in the name on purpose: transformers then hands the vision tower's whole
        # patch sequence and its cu_seqlens to one call instead of looping over windows.
        return AttentionBinding(name=f"weft_flash_{strategy}_{id(mesh):x}", fn=fn)
    if strategy not in ("ring", "ulysses", "usp", "local"):
        return None
    from weft.strategies.attention.hf_adapter import make_attention_function

    layout = getattr(decision.params, "layout", "zigzag")
    fn = make_attention_function(
        strategy=strategy, layout=layout, backend=backend,
        ulysses_group=mesh["ulysses"].get_group(), ring_group=mesh["ring"].get_group(),
    )
    # Never "flash" in the name: transformers would switch to its varlen calling convention.
    kernel = backend.replace("flash", "fl")
    return AttentionBinding(name=f"weft_{strategy}_{layout}_{kernel}_{id(mesh):x}", fn=fn)
