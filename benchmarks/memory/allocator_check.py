"""Whether an import starts CUDA before weft sets the caching allocator, and whether the
allocator's segments are expandable after ``use_expandable_segments`` (issue 25).

    python3 benchmarks/memory/allocator_check.py
"""

import sys

import torch
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: F401 - the imports a run makes

started = torch.cuda.is_initialized()
print("torchao imported:", "torchao" in sys.modules, "cuda started by imports:", started)

from weft.core.run.process_group import use_expandable_segments  # noqa: E402

use_expandable_segments()
x = torch.empty(2**28, device="cuda")
print("segments expandable:", {s.get("is_expandable") for s in torch.cuda.memory_snapshot()})
