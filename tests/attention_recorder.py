"""Test-only plugin: attention strategy ``record_ring``, weft's ring attention over the ring
ranks that keeps what each call received (tests/test_docs_attention.py, under sequence parallelism)."""

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import AttentionBinding, Strategy

#: What each call received, in this rank's process: (module class, query, key, mask, kwargs).
CALLS: list[dict] = []


@attrs.frozen(kw_only=True)
class RecordParams:
    layout: str = "zigzag"  # the sequence's layout over the ring ranks: the planner reads this parameter


@hookimpl
def weft_strategies():
    return [Strategy(point="attention", name="record_ring", params=RecordParams, sp_dims=("ring",),
                     summary="ring attention, recorded")]


@hookimpl
def weft_attention(decision, mesh):
    if decision.strategy != "record_ring":
        return None
    from weft.strategies.attention.hf_bridge import make_attention_function, ring_attend

    ring = make_attention_function(name="ring", attend=ring_attend(layout=decision.params.layout, backend="auto",
                                                                   ring_group=mesh["ring"].get_group()))

    def attention(module, query, key, value, attention_mask, **kwargs):
        CALLS.append({"module": type(module).__name__, "query": tuple(query.shape), "key": tuple(key.shape),
                      "mask": attention_mask, "kwargs": dict(kwargs)})
        return ring(module, query, key, value, attention_mask, **kwargs)

    return AttentionBinding(name=f"record_ring_{id(mesh):x}", fn=attention)
