"""Batching hook: this rank's optimizer steps, filled to the recipe's token budget.

Whole-sequence micro-batches only: under sequence parallelism the core pads them,
shifts the labels and cuts them (core/train/step.py), never this plugin.
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.errors import WeftError
from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, Strategy


@attrs.frozen(kw_only=True)
class TokenBudgetParams:
    bucket_size: int = attrs.field(default=256, validator=in_range(low=1),
                                   metadata={"doc": "samples sorted by length within buckets of this size"})
    pack: bool = attrs.field(default=False, metadata={
        "doc": "pack whole documents into one row per micro-batch; attention stays inside each document"})
    over_long: Literal["drop", "truncate"] = attrs.field(default="drop", metadata={
        "doc": "a sample longer than the limit: drop it, or keep its head (never cutting an image span)"})
    prefetch: int = attrs.field(default=2, validator=in_range(low=0),
                                metadata={"doc": "steps collated ahead in a background thread; 0 = none"})
    schedule: Literal["rounds", "global"] = attrs.field(default="rounds", metadata={
        "doc": "rounds: a step takes one micro-batch per data-parallel rank until train.step_tokens, no idle "
               "rank, but the steps depend on the dp size; global: the same steps at any dp size (the "
               "micro-batches one rank would take, dealt over the ranks; a rank short of one runs a copy "
               "that counts for nothing), so the losses and gradients do not change with dp"})


def _describe(params, *, recipe, plan, model, family, positions: bool) -> dict:
    from weft.plugins.batching.plan_reports import describe_positions, describe_vision_split

    vision = hasattr(model.config, "vision_config")
    report = {"vision_split": describe_vision_split(recipe, plan, family) if vision else []}
    if positions:
        report["positions"] = describe_positions(recipe, plan, model, family)
    return report


TOKEN_BUDGET = Strategy(point="batching", name="token_budget", params=TokenBudgetParams, describe=_describe,
                        impl=lambda params, **kw: TokenBudgetSteps(params, **kw),
                        summary="micro-batches up to train.micro_batch_tokens, steps up to train.step_tokens, "
                                "disjoint across DP ranks")
STRATEGIES = Declared(TOKEN_BUDGET)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_batching(decision, recipe, plan, mesh, model, ctx):
    return STRATEGIES.answer(decision, recipe=recipe, plan=plan, mesh=mesh, model=model, ctx=ctx)


class TokenBudgetSteps:
    """This rank's steps, from ``ctx.start_step`` on, collated ``prefetch`` steps ahead; under
    ``train.epochs`` they end after the last epoch, and ``len()`` counts them (the data is read
    for it, once). The schedule is a function of the lengths, the seed and the epoch, so every
    rank deals the same one and takes its own slots."""

    def __init__(self, params, *, recipe, plan, mesh, model, ctx) -> None:
        self.params, self.recipe, self.plan, self.mesh, self.model, self.ctx = params, recipe, plan, mesh, model, ctx
        self._data = None

    def __iter__(self):
        from weft.strategies.data.prefetch import prefetched

        return prefetched(self._steps(), self.params.prefetch)

    def __len__(self) -> int:
        epochs = self.recipe.train.epochs
        if not epochs:
            raise TypeError("the steps are counted under train.epochs only; else train.max_steps")
        return sum(sum(1 for _ in self._schedule(epoch)) for epoch in range(epochs))

    def _load(self):
        """(samples, lengths, make), read once: the checked samples, their lengths (over-long
        ones past the budget, counted), and the collation of a micro-batch's indices."""
        if self._data is not None:
            return self._data
        from weft.plugins.batching.sample_checks import truncate
        from weft.plugins.batching.samples import bad_sample_handler, pad_id_of, run_samples
        from weft.strategies.data.conversation import collate
        from weft.strategies.data.shards import token_counts
        from weft.strategies.data.token_budget import as_lengths, clipped

        recipe, ctx, params = self.recipe, self.ctx, self.params
        on_bad = bad_sample_handler(recipe, ctx)
        tokenizer, samples = run_samples(recipe, ctx.family, ctx=ctx, on_bad=on_bad)
        budget = recipe.train.micro_batch_tokens
        limit = min(budget, recipe.train.seq_len)
        if params.over_long == "truncate":
            samples = truncate(samples, limit=limit, tokenizer=tokenizer, ctx=ctx, on_bad=on_bad)
        # Over-long samples get a length past the budget, so packing leaves them out.
        lengths = clipped(token_counts(samples), limit=limit, over=budget + 1)
        too_long = int((as_lengths(lengths) > budget).sum())
        if too_long:
            ctx.count("skipped_samples", too_long)
            ctx.log.warning("data.too_long", samples=too_long, micro_batch_tokens=budget,
                            max_seq_len=recipe.train.seq_len)
        pad_id = pad_id_of(tokenizer, ctx.family.config(recipe)[0])
        if params.pack:
            from weft.strategies.data.packing import collate_packed

            positions = ctx.family.positions(self.model)

            def rows(chosen):
                return collate_packed(chosen, pad_id=pad_id, positions=positions)
        else:

            def rows(chosen):
                return collate(chosen, pad_id=pad_id)

        make = _pairs_or_rows(samples, rows, packed=params.pack)

        self._data = samples, lengths, make
        return self._data

    def _batches(self, epoch: int):
        """The epoch's micro-batches (sample indices), made as they are taken."""
        from weft.strategies.data.packing import pack_documents
        from weft.strategies.data.token_budget import pack_micro_batches

        _, lengths, _ = self._load()
        budget, seed = self.recipe.train.micro_batch_tokens, self.recipe.train.seed
        if self.params.pack:
            return pack_documents(lengths, budget=budget, seed=seed, epoch=epoch)
        return pack_micro_batches(lengths, budget=budget, seed=seed, epoch=epoch, bucket_size=self.params.bucket_size)

    def _schedule(self, epoch: int):
        """The epoch's steps (step -> round -> dp rank -> sample indices), made as they are taken."""
        from weft.strategies.data.token_budget import schedule_global_steps, schedule_steps

        samples, lengths, _ = self._load()
        schedule = schedule_global_steps if self.params.schedule == "global" else schedule_steps
        steps = schedule(self._batches(epoch), lengths, dp_size=self.plan.mesh.dp,
                         step_tokens=self.recipe.train.step_tokens, packed=self.params.pack,
                         whole=bool(self.recipe.train.epochs))
        first = next(steps, None)
        if first is None:
            raise WeftError(
                f"the data gives no full step: {len(samples)} usable samples for {self.plan.mesh.dp} data-parallel "
                "ranks; add samples or lower train.step_tokens", where=self.recipe.source)
        yield first
        yield from steps

    def _steps(self):
        ctx, me = self.ctx, self.mesh.dp_rank()
        samples, _, make = self._load()
        if ctx.one_pass:
            yield from one_pass_rounds(list(self._batches(0)), dp_size=self.plan.mesh.dp, me=me, make=make)
            return
        log = SampleLog(ctx, samples) if self.recipe.train.log_samples and ctx.rank == 0 else None
        step, epoch, epochs = 0, 0, self.recipe.train.epochs
        while not epochs or epoch < epochs:
            for rounds in self._schedule(epoch):
                step += 1
                if step <= ctx.start_step:
                    continue
                # Every rank deals the same schedule: each counts all ranks' fillers, so rank 0's summary has them.
                fillers = sum(slot is None for round_ in rounds for slot in round_)
                if fillers:
                    ctx.count("filler_micro_batches", fillers)
                if log is not None:
                    log.write(step, rounds)
                yield [make(round_[me]) if round_[me] is not None else filler(make(round_[0])) for round_ in rounds]
            epoch += 1
            ctx.log.info("data.epoch", epoch=epoch)


class SampleLog:
    """``samples.jsonl`` in the run folder (``train.log_samples``): each step's samples by
    data-parallel rank, then micro-batch, as ids (strategies/data/mixture.py's ``sample_id``);
    a resumed run first drops the rows after the step it resumed from."""

    def __init__(self, ctx, samples) -> None:
        import json

        self.samples, self.path = samples, ctx.run_dir / "samples.jsonl"
        rows = self.path.read_text().splitlines() if self.path.exists() and ctx.start_step else []
        kept = [row for row in rows if json.loads(row)["step"] <= ctx.start_step]
        self.path.write_text("".join(row + "\n" for row in kept))

    def write(self, step: int, rounds) -> None:
        import json

        from weft.strategies.data.mixture import sample_id

        ranks = [[None if round_[rank] is None else [sample_id(self.samples, i) for i in round_[rank]]
                  for round_ in rounds] for rank in range(len(rounds[0]))]
        with self.path.open("a") as out:
            out.write(json.dumps({"step": step, "ranks": ranks}) + "\n")


def _pairs_or_rows(samples, rows, *, packed: bool):
    """The collation of a micro-batch's indices: preference pairs (strategies/data/pairs.py)
    where the data holds them, each pair two documents or rows; else the samples as they are."""
    if not len(samples) or samples[0].pair_split is None:
        return lambda indices: rows([samples[i] for i in indices])
    from weft.core.errors import WeftError
    from weft.strategies.data.pairs import collate_pairs

    def make(indices):
        chosen = [samples[i] for i in indices]
        if any(s.pair_split is None for s in chosen):
            raise WeftError("the data mixes preference pairs ('chosen' and 'rejected') with plain conversations; "
                            "a run trains on one kind", where="data")
        return collate_pairs(chosen, collate=rows, packed=packed)

    return make


def one_pass_rounds(batches, *, dp_size, me, make):
    """`weft eval`: every micro-batch once, one round per step. The last round's missing
    micro-batches (fewer left than data-parallel ranks) are a copy of one with no label
    kept, so every rank runs the same forwards (FSDP's and SP's collectives) and the
    copies add nothing to the loss."""
    for start in range(0, len(batches), dp_size):
        round_ = batches[start:start + dp_size]
        yield [make(round_[me])] if me < len(round_) else [filler(make(round_[0]))]


def filler(micro_batch: dict) -> dict:
    """A micro-batch with no label kept: the same forward and collectives, nothing to the loss."""
    import torch

    from weft.core.train.loss import IGNORE

    for key in ("labels", "shift_labels"):  # shift_labels: a packed row's targets, shifted per document
        if key in micro_batch:
            micro_batch[key] = torch.full_like(micro_batch[key], IGNORE)
    if "weft_pairs" in micro_batch:  # a preference micro-batch's copy counts no pair
        micro_batch["weft_pairs"] = torch.zeros_like(micro_batch["weft_pairs"])
    return micro_batch
