"""One optimizer step's forward and backward: what the core does to every micro-batch.

Batching yields whole-sequence micro-batches. Here each one is padded to the sequence
split's multiple, its labels are shifted on the whole sequence and cut like the
model's inputs (the family's hooks cut those after the vision merge), and a rank
without images is told to run the vision tower anyway when another rank has some.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.models import VISION_FLAG
from weft.core.registry import Objective
from weft.core.train.fused_loss import linear_cross_entropy_sum
from weft.core.train.loss import IGNORE as IGNORE_INDEX
from weft.core.train.loss import label_count, targets, token_loss_sum
from weft.core.train.timing import PhaseTimer

if TYPE_CHECKING:
    from weft.core.context import RunContext, StepState
    from weft.core.mesh import WeftMesh
    from weft.core.models import SequenceSplit
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe.rule_engine import Plan

#: Fill values for the sequence-long keys the core pads; other sequence-long keys are
#: the batching's to pad (an error names them). Pads sit at the right end, where
#: causal attention keeps real tokens from seeing them and the loss ignores them.
PAD_VALUES: dict[str, int] = {
    "input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX,
    "mm_token_type_ids": 0, "position_ids": 0,
}
#: Patch rows, not sequence positions (their width may happen to equal the length).
VISION_ROWS = ("pixel_values", "pixel_values_videos")
#: Packed documents' ids: padding becomes one more document that attends only to itself.
DOC_IDS = "weft_doc_ids"


def autocast_for(precision: str, device_type: str):
    """A run's own autocast: bf16 where it trains in bf16, none in float32. The loop, check,
    eval and generate all run the model under this one."""
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def pad_to_multiple(batch: dict[str, torch.Tensor], *, multiple: int,
                    zero_filled: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Right-pad every sequence-long tensor so the length divides by ``multiple``
    (``zero_filled``: an objective's own keys, read only where a label is)."""
    seq = batch["input_ids"].shape[1]
    pad = -seq % multiple
    if pad == 0:
        return batch
    out = dict(batch)
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != seq or key in VISION_ROWS:
            continue
        if key == DOC_IDS:
            fill = int(value.max()) + 1
        elif key in zero_filled:
            fill = 0
        elif key in PAD_VALUES:
            fill = PAD_VALUES[key]
        else:
            raise WeftError(f"micro-batch key {key!r} is {seq} long, which sequence parallelism needs padded to a "
                            f"multiple of {multiple}, and weft does not know its padding value; pad it in the "
                            f"batching strategy or leave it out. Keys weft pads: {', '.join(PAD_VALUES)}, {DOC_IDS}",
                            where="batching")
        out[key] = torch.nn.functional.pad(value, (0, pad), value=fill)  # (..., S + pad)
    return out


def _shifted(values: torch.Tensor) -> torch.Tensor:
    """(B, S) per-token values moved to the position that predicts their token, as the labels are."""
    return torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)


def shard_micro_batch(batch: dict[str, torch.Tensor], split: SequenceSplit | None, *,
                      token_keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Pad to the split's multiple, shift the labels (and the objective's ``token_keys``) on
    the whole sequence, keep this rank's part of them. The model's own inputs stay whole: the
    family's hooks cut them after the vision merge (the images and the 3-D position ids need
    the whole sequence)."""
    token_keys = tuple(k for k in token_keys if k in batch)
    # Aligned with the labels the micro-batch carries: shifted like ``labels``; beside a
    # packed row's ``shift_labels`` (shifted per document by the batching) as they are.
    shift = _shifted if "shift_labels" not in batch else (lambda values: values)
    if split is None:
        return dict(batch, **{k: shift(batch[k]) for k in token_keys}) if token_keys else batch
    out = pad_to_multiple(batch, multiple=split.multiple, zero_filled=token_keys)
    out["shift_labels"] = split.shard(targets(out), dim=1)  # (B, S_local)
    out.pop("labels", None)
    for key in token_keys:
        out[key] = split.shard(shift(out[key]), dim=1)  # (B, S_local), aligned with shift_labels
    return out


class NextToken(Objective):
    """The ``sft`` objective: cross-entropy of every labelled token, summed; the step divides by
    the global label count. ``fused``: from the hidden states and the head by chunks, else
    from the model's logits (whose storage their gradient may take: they live for the loss)."""

    def units(self, batch: dict, target: torch.Tensor) -> torch.Tensor:
        return label_count(target)

    def loss_sum(self, *, model: torch.nn.Module, batch: dict, target: torch.Tensor, fused: FusedHead | None,
                 extra: dict) -> torch.Tensor:
        if fused is not None:
            return fused.loss_sum(batch, target)
        logits = model(**batch, use_cache=False).logits  # (B, S_local, V)
        return token_loss_sum(logits, target, reuse_logits=True)


class FusedHead:
    """``train.loss = "fused"``: the loss straight from the text decoder's last hidden states
    and the lm_head weight, by chunks (core/train/fused_loss.py); the model computes the logits of
    one position only (``logits_to_keep=1``), so the (B, S, V) logits never exist.

    A forward hook on the text decoder keeps its output (post-norm, this rank's part under
    sequence parallelism). The head's weights sit in the root FSDP unit (plugins/shard/),
    which FSDP2 does not reshard after forward: after the model returns they are the
    gathered tensors, and their gradient reaches FSDP's reduce-scatter like any other.
    """

    def __init__(self, *, model: torch.nn.Module, decoder: torch.nn.Module) -> None:
        if hasattr(model.get_output_embeddings(), "base_layer"):  # PEFT's layer: its weight is the base's alone
            raise WeftError("train.loss = 'fused' computes the head from its weight, which would leave out the "
                            "adapter a rule puts on the head (lm_head); set train.loss = 'logits' or drop the head's "
                            "adapter", where="train.loss")
        self.model = model
        self.hidden: torch.Tensor | None = None
        self.handle = decoder.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.nn.Module]:
        """The model's forward with one position's logits: (the decoder's last hidden states
        (B, S_local, H), the head module, its weights gathered), for a loss of its own."""
        self.model(**batch, use_cache=False, logits_to_keep=1)
        hidden, self.hidden = self.hidden, None  # (B, S_local, H)
        head = self.model.get_output_embeddings()
        if hasattr(head.weight, "device_mesh"):
            raise WeftError("train.loss = 'fused' reads the lm_head weight after the forward, but it is sharded in an "
                            "FSDP unit of its own; leave the head to the root unit (the built-in shard plugin does "
                            "this when train.loss = 'fused')", where="train.loss")
        return hidden, head

    def loss_sum(self, batch: dict, target: torch.Tensor) -> torch.Tensor:
        hidden, head = self.forward(batch)
        return linear_cross_entropy_sum(hidden, head.weight, target, bias=head.bias)


def _tower_calls(batch: dict) -> list[bool]:
    """Which of the model's vision-tower calls this micro-batch makes: one for its images,
    one for its videos (Qwen2.5-VL encodes each modality in a call of its own)."""
    return [batch.get("pixel_values") is not None, batch.get("pixel_values_videos") is not None]


def _keep_alive(batch: dict, ranks_with: list[float]) -> dict:
    """The micro-batch marked with one blank tower call for each modality some rank of the
    round encodes and this one does not, so every rank calls the tower as often."""
    missing = sum(1 for others, mine in zip(ranks_with, _tower_calls(batch)) if others and not mine)
    if not missing:
        return batch
    return dict(batch, **{VISION_FLAG: torch.ones((missing,), dtype=torch.bool)})  # its length: the blank calls


def run_micro_batches(*, model: torch.nn.Module, micro_batches: list[dict], split: SequenceSplit | None,
                      keep_vision: bool, autocast: Any, ctx: RunContext, fused: FusedHead | None = None,
                      objective: Objective | None = None, timer: PhaseTimer | None = None,
                      backward: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every micro-batch's forward and backward (``backward=False``: forward only, for
    `weft eval` under torch.no_grad). Returns (this rank's loss sum, the global counts
    (the objective's units, tokens)), both on the device, without a host sync unless
    ``keep_vision`` (then one, at the start, to learn which rounds have images).
    ``objective``: the run's (``weft_objective``); None, the next-token loss."""
    objective = objective if objective is not None else NextToken()
    objective.begin_step()
    local = [shard_micro_batch(mb, split, token_keys=objective.token_keys) for mb in micro_batches]
    # One collective for the step's divisor: the objective's units (label tokens) over every
    # rank, so the loss equals the unsharded model's mean over the global batch. Tokens are
    # this rank's positions (its part of the sequence under SP). With keep_vision, one count
    # per micro-batch of the ranks with images, and of those with videos, rides along.
    counts = [sum(objective.units(mb, targets(mb)) for mb in local),
              torch.tensor(sum(targets(mb).numel() for mb in local))]
    if keep_vision:
        counts += [torch.tensor(float(call)) for mb in local for call in _tower_calls(mb)]
    totals = torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in counts]).to(ctx.device)
    dist.all_reduce(totals)
    if keep_vision:
        with_vision = totals[2:].tolist()  # host sync: which rounds need the tower on every rank, how often
        local = [_keep_alive(mb, with_vision[2 * i : 2 * i + 2]) for i, mb in enumerate(local)]
    global_units = totals[0].clamp(min=1)
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float32)
    # FSDP2: reduce-scatter gradients once, after the last micro-batch; earlier ones
    # accumulate unsharded gradients locally (less communication, more memory).
    sync = getattr(model, "set_requires_gradient_sync", None) if backward else None
    for index, mb in enumerate(local):
        if sync is not None:
            sync(index == len(local) - 1)
        batch = {k: v.to(ctx.device, non_blocking=True) for k, v in mb.items()}
        target = targets(batch)
        batch.pop("labels", None)
        batch.pop("shift_labels", None)
        extra = {key: batch.pop(key) for key in (*objective.token_keys, *objective.batch_keys) if key in batch}
        if timer is not None:
            timer.start("forward")
        with autocast, warnings.catch_warnings():
            # FSDP2 warns that the root returned a view (transformers slices
            # logits); the loss only reads it, never updates it in place.
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            part = objective.loss_sum(model=model, batch=batch, target=target, fused=fused, extra=extra)
        # Gradient reductions average over all world_size ranks (FSDP and
        # grad_sync alike); scaling by world_size turns that mean into the
        # sum of every rank's share of (global loss sum / global label count).
        if timer is not None:
            timer.stop("forward")
        if backward:
            if timer is not None:
                timer.start("backward")
            (part * (ctx.world_size / global_units)).backward()
            if timer is not None:
                timer.stop("backward")
        loss_sum = loss_sum + part.detach()  # float64 parts (a float64 model) keep their digits
    return loss_sum, totals[:2]


def finish_step(*, pm: WeftPluginManager, model: torch.nn.Module, plan: Plan, mesh: WeftMesh, ctx: RunContext,
                state: StepState, loss_sum: torch.Tensor, totals: torch.Tensor,
                objective: Objective | None = None) -> None:
    """weft_grad_sync, then the step's global loss: fills state.loss/grad_norm/tokens (and
    state.stats, the objective's values beside the loss, reduced with it)."""
    grad_results = pm.grad_sync(model=model, plan=plan, mesh=mesh, ctx=ctx)
    grad_norm = dict(item for result in grad_results if result for item in result).get("grad_norm")
    stats = objective.step_stats() if objective is not None else {}
    sums = torch.stack([loss_sum.double(), *(v.detach().double().to(loss_sum.device) for v in stats.values())])
    dist.all_reduce(sums)
    means = (sums / totals[0].clamp(min=1)).tolist()  # the step's one host sync
    state.loss = means[0]
    state.stats = dict(zip(stats, means[1:]))
    state.grad_norm = float(grad_norm) if grad_norm is not None else None
    state.tokens = int(totals[1])
