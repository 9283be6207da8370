"""parallel.expandable_segments reaches the caching allocator itself: the environment alone
is read once, when CUDA starts, and an import (transformers importing torchao) may start it
before weft runs — the 32K recipe then fragmented and ran out of memory (issue 25)."""

import os

import pytest
import torch

from weft.core.run.process_group import use_expandable_segments

pytestmark = pytest.mark.quick

def test_sets_the_allocator_and_the_environment(monkeypatch):
    calls = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    use_expandable_segments()
    assert calls == ["expandable_segments:True"]

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"

def test_the_users_own_setting_wins(monkeypatch):
    calls = []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    use_expandable_segments()
    assert calls == []
