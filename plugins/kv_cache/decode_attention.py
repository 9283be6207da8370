"""A KV cache's decode attention under a name of its own in transformers' AttentionInterface.

The core selects the name for the text model once the prefill is done (core/infer/
decode.py ``text_attention``). The registry is transformers' and lives as long as the
process, so it holds the cache weakly: an entry that held the cache's bound method kept the
whole cache alive after its ``weft generate`` returned (7 GB of GPU memory at 128K for the
7B, per call, in a process that generates more than once).
"""

from __future__ import annotations

import weakref

from transformers import AttentionInterface


def register_decode_attention(cache, attend) -> str:
    """Register ``attend`` (a method of ``cache``, called as ``attend(cache, module, query, ...)``)
    under a name of ``cache``; returns the name. The entry calls it while the cache lives, and
    refuses after. A plain weak reference (torch.compile traces its call: a compiled decoding
    step goes through this entry at every layer; a WeakMethod's is a graph break)."""
    name = f"weft_{type(cache).__name__.lower()}_decode_{id(cache):x}"
    owner = weakref.ref(cache)
    function = attend.__func__ if hasattr(attend, "__func__") else attend

    def decode(module, query, key, value, attention_mask, **kwargs):
        live = owner()
        if live is None:
            raise RuntimeError(f"the decode attention {name!r} outlived its cache")
        return function(live, module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, decode)
    return name
