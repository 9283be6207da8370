"""Model FLOPs for MFU: the one count that reports, the planner and the benchmarks use.

Training FLOPs of one sequence of L tokens: ``6 N L + 6 layers hidden L^2`` — N the text
model's parameters without the embedding, the head included (a tied head, which shares
the embedding's weight, counted once as the head), the second term causal attention's
score and value products (forward and backward). A frozen weight (``trainable = false``, an
adapter run's base) counts the FLOPs it runs: 4 per token (forward, the input's gradient),
not 6 (no weight gradient); adapters are trained weights (6). The vision tower is left out: it sees
only the image patches, not every token (as BENCHMARKS.md counts). MFU
divides by the GPU's dense bf16 peak.
"""

from __future__ import annotations

from typing import Any

#: Dense bf16 peak TFLOP/s by GPU name fragment (NVIDIA's datasheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(gpu: str | None) -> float | None:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``), or None."""
    return next((value for fragment, value in PEAK_TFLOPS.items() if fragment in (gpu or "")), None)


def text_parameters(model: Any) -> tuple[int, int, int]:
    """(N, layers, hidden) of a model (the meta device will do): N as the module docstring says."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name and "visual" not in name)
    if getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        n += model.get_output_embeddings().weight.numel()  # the head shares the embedding's weight
    return n, text.num_hidden_layers, text.hidden_size


def sequence_flops(*, params: float, layers: int, hidden: int, length: float, frozen: float = 0) -> float:
    """Training FLOPs of one sequence of ``length`` tokens; ``frozen`` of the ``params`` run 4 per
    token, not 6 (forward and the input's gradient: a frozen weight has no weight gradient)."""
    return (6 * params - 2 * frozen) * length + 6 * layers * hidden * length**2


def frozen_text_parameters(model: Any) -> int:
    """Of N (``text_parameters``), those that want no gradient: a frozen unit's, an adapter's base."""
    n = sum(p.numel() for name, p in model.named_parameters()
            if not p.requires_grad and "embed_tokens" not in name and "visual" not in name)
    head = model.get_output_embeddings().weight if hasattr(model, "get_output_embeddings") else None
    config = model.config
    if head is not None and not head.requires_grad and (getattr(config, "tie_word_embeddings", False) or getattr(
            config.get_text_config() if hasattr(config, "get_text_config") else config, "tie_word_embeddings", False)):
        n += head.numel()
    return n
