"""The recipe's ``[train]`` section: steps or epochs, the optimizer's schedule, precision, loss,
checkpoints and logging."""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.recipe.convert import in_range
from weft.core.recipe.data import _doc

#: The most steps a run may ask for (train.max_steps, train.epochs): 2**40 = 1,099,511,627,776,
#: 35 years at 1,000 steps a second. Past that a run never ends: a typo (10**23), not a plan.
MAX_STEPS = 2**40
#: Seeds are 0 to 2**63 - 1, a signed 64-bit integer: what every generator weft seeds takes (10**20 would
#: reach torch.manual_seed in each rank and fail there, 'Overflow when unpacking long long').
MAX_SEED = 2**63 - 1


@attrs.frozen(kw_only=True)
class TrainSection:
    max_steps: int = attrs.field(default=20, validator=in_range(low=1, high=MAX_STEPS, high_text="2**40"),
                                 metadata=_doc("optimizer steps (unless train.epochs is set); at most 2**40, "
                                               "35 years at 1,000 steps a second: more is refused as a typo"))
    epochs: int = attrs.field(default=0, validator=in_range(low=0, high=MAX_STEPS, high_text="2**40"), metadata=_doc(
        "passes over the data in place of max_steps: every usable sample once an epoch (an epoch's last step "
        "may be shorter), the steps counted from the data before the first; 0 = train.max_steps decides"))
    seed: int = attrs.field(default=0, validator=in_range(low=0, high=MAX_SEED, high_text="2**63 - 1"),
                            metadata=_doc("seeds model init, data order, dropout; 0 to 2**63 - 1 (torch's "
                                          "generators take 64-bit seeds)"))
    checkpoint_every: int = attrs.field(default=0, validator=in_range(low=-1), metadata=_doc(
        "steps between checkpoints; 0 = only at the end; -1 = none at all (benchmarks, disks smaller than the model)"))
    keep_checkpoints: int = attrs.field(default=2, validator=in_range(low=1), metadata=_doc("newest checkpoints kept"))
    micro_batch_tokens: int = attrs.field(default=2048, validator=in_range(low=16),
                                          metadata=_doc("padded tokens per micro-batch per rank"))
    step_tokens: int = attrs.field(default=0, validator=in_range(low=0),
                                   metadata=_doc("accumulate micro-batches until this many tokens (all ranks); "
                                                 "0 = one round"))
    max_seq_len: int = attrs.field(default=0, validator=in_range(low=0),
                                   metadata=_doc("longest sample; 0 = micro_batch_tokens; the seq_len rule selector"))
    lr: float = attrs.field(default=1e-3, validator=in_range(low=0.0), metadata=_doc("peak learning rate"))
    min_lr_ratio: float = attrs.field(default=0.1, validator=in_range(low=0.0, high=1.0),
                                      metadata=_doc("cosine floor as a fraction of lr"))
    warmup_steps: int = attrs.field(default=2, validator=in_range(low=0), metadata=_doc(
        "linear warmup steps, then the cosine decay; as many as the run's steps or more (max_steps, or the "
        "steps of the epochs) and the learning rate only ramps up, never reaching train.lr nor decaying: "
        "a warning when the recipe sets it (`weft plan`, and the run's schedule.warmup_past_end), not an error"))
    weight_decay: float = attrs.field(default=0.0, validator=in_range(low=0.0), metadata=_doc("AdamW weight decay"))
    beta1: float = attrs.field(default=0.9, validator=in_range(low=0.0, high=1.0), metadata=_doc("AdamW beta1"))
    beta2: float = attrs.field(default=0.95, validator=in_range(low=0.0, high=1.0), metadata=_doc("AdamW beta2"))
    optimizer: str = attrs.field(default="adamw_sr", metadata=_doc(
        "the run's optimizer strategy (an optimizer rule's default): adamw_sr (float32 math, stochastic rounding of "
        "bf16 weights and moments: no update lost; torch's AdamW for float32 weights), adamw (torch's fused, "
        "round-to-nearest in the weights' dtype), adamw_8bit (torchao's 8-bit moments); `weft plugins` lists all"))
    precision: Literal["fp32", "bf16"] = attrs.field(default="fp32", metadata=_doc("fp32, or bf16 autocast"))
    loss: Literal["logits", "fused"] = attrs.field(default="logits", metadata=_doc(
        "logits: the model's logits, then a chunked float32 cross-entropy; fused: lm_head and the loss by chunks "
        "from the hidden states, the logits never exist (the head's weights join the root FSDP unit)"))
    log_every: int = attrs.field(default=1, validator=in_range(low=1), metadata=_doc("steps between console lines"))
    log_samples: bool = attrs.field(default=False, metadata=_doc(
        "samples.jsonl in the run folder: each step's sample ids by data-parallel rank and micro-batch (the "
        "sample's index among its file's usable ones; [source, index] in a mixture), to see which samples a "
        "step trained on"))

    @property
    def seq_len(self) -> int:
        return self.max_seq_len or self.micro_batch_tokens

    def warmup_warning(self, *, steps: int | None = None) -> str | None:
        """What is wrong with a warmup that does not end before the run does, or None.
        ``steps``: the run's steps (train.max_steps resolved from the epochs' data); without it,
        train.max_steps, and nothing under train.epochs (the steps are counted from the data later)."""
        if steps is None and self.epochs:
            return None
        steps = self.max_steps if steps is None else steps
        if self.warmup_steps < steps:
            return None
        return (f"train.warmup_steps = {self.warmup_steps} is not below the run's {steps} steps: the learning rate "
                f"only ramps up, to {steps / (self.warmup_steps + 1):.3g} x train.lr at the last step, and never "
                "decays; set train.warmup_steps below the steps (the run goes on as asked)")
