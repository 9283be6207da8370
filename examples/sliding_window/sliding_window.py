"""A complete attention strategy as a weft plugin: causal attention over a sliding window,
in plain torch. Each token attends to itself and the ``window - 1`` tokens before it.

    [[rules]]
    when = { modality = "text" }
    attention = { strategy = "sliding_window", window = 4096 }

This module is the plugin: register it with
``build_plugin_manager(extra=[("sliding_window", sliding_window)])`` or through an entry
point of the group ``weft`` (docs/plugins.md). What an attention function receives and must
return is docs/attention.md; tests/test_docs_attention.py runs this strategy on the tiny
Qwen2.5-VL model against SDPA.
"""

from __future__ import annotations

import attrs

from weft.core.errors import PlanError
from weft.core.hookspecs import hookimpl
from weft.core.registry import AttentionBinding, Strategy
from weft.core.schema import in_range

NAME = "sliding_window"


@attrs.frozen(kw_only=True)
class SlidingWindowParams:
    window: int = attrs.field(default=4096, validator=in_range(low=1), metadata={
        "doc": "tokens each token attends to: itself and the window - 1 before it"})


def text_only(params, *, info, plan):
    """Plan time: a causal window means nothing to a vision tower, whose patches see each other."""
    if info.modality != "text":
        raise PlanError(f"{info.path}: attention {NAME!r} is causal, for text modules; this one is "
                        f"{info.modality or 'of no declared modality'} (add when = {{ modality = \"text\" }})")
    return None


@hookimpl
def weft_strategies():
    # No sp_dims: the planner refuses this strategy on a mesh that splits the sequence.
    return [Strategy(point="attention", name=NAME, params=SlidingWindowParams,
                     summary="causal attention over a sliding window (plain torch)", resolve=text_only)]


def sliding_window_attention(module, query, key, value, attention_mask, *, window: int,
                             scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: query (B, Hq, S, D), key and value (B, Hkv, S, D)
    -> ((B, S, Hq, D), None). ``attention_mask`` is None under weft: causality and the
    packed documents (``weft_doc_ids``) are this function's to apply."""
    import torch
    import torch.nn.functional as F

    if dropout:
        raise ValueError(f"{NAME} attention has no dropout (module {type(module).__name__}, dropout={dropout})")
    heads, kv_heads, seq = query.shape[1], key.shape[1], query.shape[2]
    if kv_heads != heads:  # grouped-query attention: each KV head serves heads // kv_heads query heads
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    i = torch.arange(seq, device=query.device)
    back = i[:, None] - i[None, :]  # (S, S): how far back each key is from each query
    allowed = ((back >= 0) & (back < window))[None, None]  # (1, 1, S, S)
    docs = kwargs.get("weft_doc_ids")  # (B, S) when batching packs documents: none sees another
    if docs is not None:
        allowed = allowed & (docs[:, :, None] == docs[:, None, :])[:, None]  # (B, 1, S, S)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)  # (B, Hq, S, D)
    return out.transpose(1, 2).contiguous(), None  # (B, S, Hq, D), as transformers expects


@hookimpl
def weft_attention(decision, module_path):
    if decision.strategy != NAME:
        return None  # not ours
    window = decision.params.window

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sliding_window_attention(module, query, key, value, attention_mask, window=window, **kwargs)

    # One name per window: the interface is global, two windows must not overwrite each other.
    # No "flash" in it: transformers would call the function the varlen way.
    return AttentionBinding(name=f"sliding_window_{window}", fn=attention)
