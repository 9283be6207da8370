"""YaRN rotary scaling for the text decoder, and the factor a run's positions need.

YaRN (Peng et al., 2023) stretches a rotary embedding trained on ``original``
positions to ``original * factor``: low frequencies are interpolated, high ones
kept, and cos/sin are scaled by 0.1 * ln(factor) + 1. transformers computes it
(``rope_type = "yarn"`` in the text config's ``rope_parameters``), for 3-D mRoPE
too, so weft only writes the parameters; no rotary code of its own.

The factor a run needs follows from the largest *position id* it feeds, not from
its token count: under Qwen2-VL's mRoPE an image of t x h x w merged patches
advances the positions by max(t, h, w) (its tokens share a temporal index and
use their row and column as the other two), and packed documents restart at 0.
A 128K-token sample with images can therefore stay well inside a 32K context.
"""

from __future__ import annotations

import math
from typing import Any


def trained_positions(rope: dict[str, Any], *, max_position_embeddings: int, original: int = 0) -> int:
    """Positions the rotary embedding was trained on: ``original`` when given, else the
    config's own ``original_max_position_embeddings``, else ``max_position_embeddings``."""
    return original or int(rope.get("original_max_position_embeddings") or max_position_embeddings)


def yarn_parameters(rope: dict[str, Any], *, factor: float, original: int) -> dict[str, Any]:
    """The text config's ``rope_parameters`` with YaRN over ``original`` positions.

    Keeps ``rope_theta`` and ``mrope_section``; replaces an earlier scaling."""
    if not factor > 1.0:
        raise ValueError(f"a YaRN factor must be above 1, got {factor}")
    if original < 1:
        raise ValueError(f"original positions must be positive, got {original}")
    kept = {k: v for k, v in rope.items() if k in ("rope_theta", "mrope_section", "partial_rotary_factor")}
    return {**kept, "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}


def scaled_parameters(rope: dict[str, Any], *, kind: str, factor: float, original: int) -> dict[str, Any]:
    """``rope_parameters`` for ``kind``: yarn (above), linear (positions divided by ``factor``:
    position interpolation) or dynamic (NTK-aware: the base grows with the sequence past
    ``original``, computed by transformers at run time)."""
    if kind == "yarn":
        return yarn_parameters(rope, factor=factor, original=original)
    if kind not in ("linear", "dynamic"):
        raise ValueError(f"unknown rotary scaling {kind!r}; accepted: yarn, linear, dynamic")
    if not factor > 1.0:
        raise ValueError(f"a {kind} factor must be above 1, got {factor}")
    kept = {k: v for k, v in rope.items() if k in ("rope_theta", "mrope_section", "partial_rotary_factor")}
    return {**kept, "rope_type": kind, "factor": float(factor), "original_max_position_embeddings": int(original)}


def needed_factor(largest: int, *, trained: int) -> float:
    """The smallest YaRN factor whose stretched context holds position ``largest``
    (positions 0..largest, so largest + 1 of them), rounded up to a tenth; 1.0 when
    the trained context already holds it."""
    need = (largest + 1) / trained
    return 1.0 if need <= 1.0 else math.ceil(need * 10 - 1e-9) / 10
