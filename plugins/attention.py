"""Attention hook: which function each attention module calls, via transformers' AttentionInterface.

``sdpa``/``eager`` are names transformers already knows. ``ring``, ``ulysses``
and ``usp`` register a function bound to this run's process groups; ``local``
one that runs a weft block kernel (flash-attn-4) on the whole local sequence.
``auto`` picks from the mesh: ring when only ring > 1, ulysses when only
ulysses > 1, usp when both; without sequence parallelism ``local`` when the
backend asks for a kernel (or flash-attn-4 is installed), else ``sdpa``. A vision
tower's ``auto``: each block's windows in one flash-attn-4 varlen call where it is
installed (``vision_local``), else ``sdpa``.

``auto`` (and ``local`` on a vision tower) is resolved once, when the Plan is built
(each strategy's ``resolve``): the plan holds the strategy each module runs, its
head split is checked from it, and ``weft_attention`` installs what the decision
names. Vision or text is the module's declared modality, never its path.
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.errors import PlanError
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


def _refuse_packed_text(name: str):
    """``resolve`` of a strategy that reads no document ids: refused on packed text at plan time."""

    def resolve(params, *, info, plan):
        if plan.packed() and info.modality == "text":
            raise PlanError(f"{info.path}: packed documents need attention that keeps to each document; "
                            f"{name!r} does not read document ids (use auto, ring, ulysses or usp)")
        return None

    return resolve


def _resolve_local(params, *, info, plan):
    """``local`` on a vision tower is its varlen form; on text it runs as named."""
    if info.modality == "vision":
        return "vision_local", NoParams()
    return _refuse_packed_text("local")(params, info=info, plan=plan)


def _vision_only(params, *, info, plan):
    """``vision_local`` by rule: the tower's calling convention (one call per block with its
    segments) on a text module would attend across the whole sequence unmasked."""
    if info.modality != "vision":
        raise PlanError(f"{info.path}: attention 'vision_local' is for a vision tower; this module is "
                        f"{info.modality or 'not of a declared modality'} (use auto, local or sdpa)")
    return None


#: The parameter class of each strategy ``auto`` resolves to: it keeps the fields they share.
_RESOLVED_PARAMS: dict[str, type] = {"ring": RingParams, "usp": RingParams, "ulysses": KernelParams,
                                     "local": KernelParams, "sdpa": NoParams, "vision_local": NoParams}


def _resolve_auto(params, *, info, plan):
    if info.modality == "vision":
        name = resolve_vision("auto", backend=params.backend)
    else:
        name = resolve_auto("auto", ulysses=plan.mesh.ulysses, ring=plan.mesh.ring, packed=plan.packed(),
                            backend=params.backend)
    cls = _RESOLVED_PARAMS[name]
    fields = attrs.fields_dict(cls)
    return name, cls(**{k: v for k, v in attrs.asdict(params).items() if k in fields})


@hookimpl
def weft_strategies():
    return [
        Strategy(point="attention", name="sdpa", params=NoParams,
                 summary="torch SDPA on the whole local sequence (no sequence parallelism)",
                 resolve=_refuse_packed_text("sdpa")),
        Strategy(point="attention", name="eager", params=NoParams,
                 summary="transformers' eager attention (reference; slow)", resolve=_refuse_packed_text("eager")),
        Strategy(point="attention", name="ring", params=RingParams,
                 summary="ring attention over the ring ranks, async K/V rotation, exact backward",
                 sp_dims=("ring",), check=check_backend),
        Strategy(point="attention", name="local", params=KernelParams,
                 summary="a weft block kernel (flash-attn-4 where installed) on the whole local sequence; "
                         "no sequence parallelism; vision_local on a vision tower", check=check_backend,
                 resolve=_resolve_local),
        Strategy(point="attention", name="ulysses", params=KernelParams,
                 summary="head/sequence all-to-all over the Ulysses ranks; "
                         "KV heads replicated when fewer than the degree",
                 sp_dims=("ulysses",), head_split=("ulysses",), check=check_backend),
        Strategy(point="attention", name="usp", params=RingParams,
                 summary="Ulysses inside, ring outside (2-D)",
                 sp_dims=("ulysses", "ring"), head_split=("ulysses",), check=check_backend),
        # Its head split and checks are those of the strategy it resolves to; sp_dims says
        # which sequence splits it can serve (the planner's list of fitting strategies).
        Strategy(point="attention", name="auto", params=RingParams,
                 summary="resolved when planning: sdpa, local, ring, ulysses or usp from the mesh's ulysses and "
                         "ring degrees; on a vision tower vision_local (flash-attn-4 installed) or sdpa",
                 sp_dims=("ulysses", "ring"), resolve=_resolve_auto),
        Strategy(point="attention", name="vision_local", params=NoParams,
                 summary="vision tower: each block's windows and images as the segments of one flash-attn-4 "
                         "varlen call where it runs, else one SDPA call per segment; images whole on a rank",
                 resolve=_vision_only),
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
    those with collectives (ring, ulysses, usp) nor the vision tower's varlen call or window loop."""
    return plan.modality_of(module_path) != "vision" and decision.strategy in ("local", "sdpa")


@hookimpl
def weft_attention(decision, module_path, plan, mesh, ctx):
    # The decision names the strategy that runs: the Plan resolved ``auto`` (and a vision
    # tower's ``local``) once, for `weft plan` and this run alike.
    strategy, backend = decision.strategy, getattr(decision.params, "backend", "auto")
    if strategy == "auto":
        raise PlanError(f"{module_path}: attention 'auto' reached the run unresolved; a Plan from "
                        "weft.core.recipe.rules.build_plan resolves it to the strategy that runs")
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
