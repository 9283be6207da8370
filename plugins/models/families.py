"""The built-in model families: which transformers class builds each, and what differs."""

from __future__ import annotations

from weft.plugins.models.base import TransformersFamily
from weft.plugins.models.qwen3_vl import QWEN3_VL

QWEN2_5_VL = TransformersFamily(
    name="qwen2_5_vl", model_types=("qwen2_5_vl",), auto_class="AutoModelForImageTextToText",
    summary="Qwen2.5-VL: windowed ViT with full-attention blocks, 2x2 merger, 3-D mRoPE text decoder",
)
QWEN2_VL = TransformersFamily(
    name="qwen2_vl", model_types=("qwen2_vl",), auto_class="AutoModelForImageTextToText",
    summary="Qwen2-VL: full-attention ViT, 2x2 merger, 3-D mRoPE text decoder",
)
TEXT = TransformersFamily(
    name="causal_lm", model_types=("qwen2", "qwen3", "llama", "mistral"), auto_class="AutoModelForCausalLM",
    summary="text-only decoders (Qwen2/Qwen3/Llama/Mistral): embed_tokens, layers, lm_head",
)

FAMILIES: tuple[TransformersFamily, ...] = (QWEN2_5_VL, QWEN2_VL, QWEN3_VL, TEXT)
