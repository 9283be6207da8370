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
from weft.core.registry import AttentionBinding, Declared, NoParams, Strategy

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


def _resolve_auto(params, *, info, plan):
    if info.modality == "vision":
        name = resolve_vision(AUTO.name, backend=params.backend)
    else:
        name = resolve_auto(AUTO.name, ulysses=plan.mesh.ulysses, ring=plan.mesh.ring, packed=plan.packed(),
                            backend=params.backend)
    # The resolved strategy's own parameter class, keeping the fields it shares with auto's.
    cls = STRATEGIES.get("attention", name).params
    fields = attrs.fields_dict(cls)
    return name, cls(**{k: v for k, v in attrs.asdict(params).items() if k in fields})


def resolve_auto(strategy: str, *, ulysses: int, ring: int, packed: bool = False, backend: str = "auto") -> str:
    """``auto`` -> the strategy the mesh needs. Packed documents without sequence
    parallelism take ``ring`` on one rank: weft's kernels read the document ids.
    Without either, ``local`` when a kernel is asked for by name or flash-attn-4 is
    installed (it runs where it can, torch's SDPA elsewhere), else transformers' ``sdpa``."""
    if strategy != AUTO.name:
        return strategy
    if ulysses > 1 and ring > 1:
        return USP.name
    if ulysses > 1 or ring > 1 or packed:
        return ULYSSES.name if ulysses > 1 else RING.name
    from weft.strategies.attention.kernels.blocks import fa4_importable

    return LOCAL.name if backend != "auto" or fa4_importable() else SDPA.name


def resolve_vision(strategy: str, *, backend: str = "auto") -> str:
    """A vision tower's ``auto`` (and ``local``): its windows and images as the segments of
    one flash-attn-4 call per block (``vision_local``) where flash-attn-4 is installed or a
    kernel is named, else transformers' ``sdpa`` (one call per window). Images stay whole
    on a rank either way; sharing one over the SP ranks is ``vision_ulysses``'s, by rule."""
    if strategy == LOCAL.name or (strategy == AUTO.name and backend != "auto"):
        return VISION_LOCAL.name
    if strategy == AUTO.name:
        from weft.strategies.attention.kernels.blocks import fa4_importable

        return VISION_LOCAL.name if fa4_importable() else SDPA.name
    return strategy


def traceable(decision, module_path: str, plan) -> bool:
    """Whether torch.compile may trace this attention module whole: the functions that run
    one kernel on the local sequence (``local``: weft's operators; ``sdpa``: torch's), not
    those with collectives (ring, ulysses, usp) nor the vision tower's varlen call or window loop."""
    return plan.modality_of(module_path) != "vision" and decision.strategy in (LOCAL.name, SDPA.name)


# Each strategy's ``impl(params, *, module_path, plan, mesh) -> AttentionBinding``.

def _named(name: str):
    """A name transformers already registers ("sdpa", "eager"): nothing to add to the interface."""
    return lambda params, **_: AttentionBinding(name=name)


def _unresolved(params, *, module_path, plan, mesh):
    raise PlanError(f"{module_path}: attention 'auto' reached the run unresolved; a Plan from "
                    "weft.core.recipe.rule_engine.build_plan resolves it to the strategy that runs")


def _vision(name: str, *, shared: bool):
    """The vision tower's varlen function; ``shared``: large images' patches over the SP ranks."""

    def impl(params, *, module_path, plan, mesh):
        from weft.strategies.attention.hf_bridge import make_vision_attention_function

        fn = (make_vision_attention_function(group=mesh.sp.get_group(), rank=mesh.sp.get_local_rank(),
                                             world=plan.mesh.sp) if shared
              else make_vision_attention_function(group=None, rank=0, world=1))
        # "flash" in the name on purpose: transformers then hands the vision tower's whole
        # patch sequence and its cu_seqlens to one call instead of looping over windows.
        return AttentionBinding(name=f"weft_flash_{name}_{id(mesh):x}", fn=fn)

    return impl


def _weft_kernel(name: str, attend):
    """weft's attention on the local sequence, ``attend(params, mesh)`` its per-call function
    (strategies/attention/hf_bridge.py), chosen here once for the binding."""

    def impl(params, *, module_path, plan, mesh):
        from weft.strategies.attention.hf_bridge import make_attention_function

        layout = getattr(params, "layout", "zigzag")
        fn = make_attention_function(name=name, attend=attend(params, mesh))
        # Never "flash" in the name: transformers would switch to its varlen calling convention.
        kernel = params.backend.replace("flash", "fl")
        return AttentionBinding(name=f"weft_{name}_{layout}_{kernel}_{id(mesh):x}", fn=fn)

    return impl


def _ring(params, mesh):
    from weft.strategies.attention.hf_bridge import ring_attend

    return ring_attend(layout=params.layout, backend=params.backend, ring_group=mesh["ring"].get_group())


def _local(params, mesh):
    from weft.strategies.attention.hf_bridge import local_attend

    return local_attend(backend=params.backend)


def _ulysses(params, mesh):
    from weft.strategies.attention.hf_bridge import ulysses_attend

    return ulysses_attend(backend=params.backend, ulysses_group=mesh["ulysses"].get_group())


def _usp(params, mesh):
    from weft.strategies.attention.hf_bridge import usp_attend

    return usp_attend(layout=params.layout, backend=params.backend, ulysses_group=mesh["ulysses"].get_group(),
                      ring_group=mesh["ring"].get_group())


SDPA = Strategy(point="attention", name="sdpa", params=NoParams, impl=_named("sdpa"),
                summary="torch SDPA on the whole local sequence (no sequence parallelism)",
                resolve=_refuse_packed_text("sdpa"))
EAGER = Strategy(point="attention", name="eager", params=NoParams, impl=_named("eager"),
                 summary="transformers' eager attention (reference; slow)", resolve=_refuse_packed_text("eager"))
RING = Strategy(point="attention", name="ring", params=RingParams, impl=_weft_kernel("ring", _ring),
                summary="ring attention over the ring ranks, async K/V rotation, exact backward",
                sp_dims=("ring",), check=check_backend)
LOCAL = Strategy(point="attention", name="local", params=KernelParams, impl=_weft_kernel("local", _local),
                 summary="a weft block kernel (flash-attn-4 where installed) on the whole local sequence; "
                         "no sequence parallelism; vision_local on a vision tower", check=check_backend,
                 resolve=_resolve_local)
ULYSSES = Strategy(point="attention", name="ulysses", params=KernelParams, impl=_weft_kernel("ulysses", _ulysses),
                   summary="head/sequence all-to-all over the Ulysses ranks; "
                           "KV heads replicated when fewer than the degree",
                   sp_dims=("ulysses",), head_split=("ulysses",), check=check_backend)
USP = Strategy(point="attention", name="usp", params=RingParams, impl=_weft_kernel("usp", _usp),
               summary="Ulysses inside, ring outside (2-D)",
               sp_dims=("ulysses", "ring"), head_split=("ulysses",), check=check_backend)
# Its head split and checks are those of the strategy it resolves to; sp_dims says
# which sequence splits it can serve (the planner's list of fitting strategies).
AUTO = Strategy(point="attention", name="auto", params=RingParams, impl=_unresolved,
                summary="resolved when planning: sdpa, local, ring, ulysses or usp from the mesh's ulysses and "
                        "ring degrees; on a vision tower vision_local (flash-attn-4 installed) or sdpa",
                sp_dims=("ulysses", "ring"), resolve=_resolve_auto)
VISION_LOCAL = Strategy(point="attention", name="vision_local", params=NoParams,
                        impl=_vision("vision_local", shared=False),
                        summary="vision tower: each block's windows and images as the segments of one flash-attn-4 "
                                "varlen call where it runs, else one SDPA call per segment; images whole on a rank",
                        resolve=_vision_only)
VISION_ULYSSES = Strategy(point="attention", name="vision_ulysses", params=VisionUlyssesParams,
                          impl=_vision("vision_ulysses", shared=True),
                          summary="vision tower: large images' patches split over all SP ranks, "
                                  "Ulysses in every block (window and full)",
                          sp_dims=("ulysses", "ring"), head_split=("ring", "ulysses"))
STRATEGIES = Declared(SDPA, EAGER, RING, LOCAL, ULYSSES, USP, AUTO, VISION_LOCAL, VISION_ULYSSES)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_attention(decision, module_path, plan, mesh, ctx):
    # The decision names the strategy that runs: the Plan resolved ``auto`` (and a vision
    # tower's ``local``) once, for `weft plan` and this run alike.
    return STRATEGIES.answer(decision, module_path=module_path, plan=plan, mesh=mesh)
