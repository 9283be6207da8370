"""Sampling on the device, the same draws on every path: nucleus sampling by the Gumbel-max
trick over uniform noise drawn outside the step (a captured graph draws nothing), and the
first token's choice made with the draws the step would make."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True)
class Sampling:
    """Nucleus sampling in the step (``nucleus_from_noise``): its temperature, top-p and the
    seeded generator (on the step's device) its uniform draws come from."""

    temperature: float
    top_p: float
    generator: torch.Generator


def choose_now(logits: torch.Tensor, *, sampling: Sampling | None) -> torch.Tensor:
    """(B,) tokens from (B, V) logits outside the step (a prompt's first token): the argmax, or
    ``sampling``'s nucleus over uniform draws made here from its generator: the draws the
    step makes, in the same order, so every path and world size draws alike."""
    if sampling is None:
        return logits.argmax(dim=-1)
    noise = torch.rand(logits.shape, generator=sampling.generator, device=logits.device)  # (B, V)
    return nucleus_from_noise(logits.float(), noise, temperature=sampling.temperature, top_p=sampling.top_p)


def nucleus_from_noise(logits: torch.Tensor, noise: torch.Tensor, *, temperature: float,
                       top_p: float) -> torch.Tensor:
    """Nucleus sampling on the device: each row of ``logits`` (B, V) draws one token from the
    smallest set of its most likely tokens whose probabilities (at ``temperature``) reach
    ``top_p``, renormalised, by the Gumbel-max trick over ``noise`` (B, V), uniform in (0, 1):
    argmax(log p + Gumbel) is a draw from p. No read-back and no random draw inside (the caller
    fills ``noise`` outside a captured graph), the same shapes every call. Returns (B,) long."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    ordered, order = probs.sort(dim=-1, descending=True)
    keep = ordered.cumsum(dim=-1) - ordered < top_p  # the smallest prefix reaching top_p (the first always)
    kept = torch.zeros_like(keep).scatter_(-1, order, keep)  # (B, V) in vocabulary order
    tiny = torch.finfo(noise.dtype).tiny
    gumbel = -torch.log(-torch.log(noise.clamp(min=tiny, max=1 - torch.finfo(noise.dtype).eps)))
    scores = torch.log(probs).masked_fill(~kept, float("-inf")) + gumbel
    return scores.argmax(dim=-1)
