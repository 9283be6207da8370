"""The recipe's ``[data]`` section: where samples come from and how they are read; and
``[eval]``: the held-out data a run evaluates every few steps."""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.recipe.convert import in_range


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen(kw_only=True)
class DataSource:
    """One dataset of a mixture (``[[data.sources]]``): its file and its part of the whole."""

    path: str = attrs.field(metadata=_doc(
        "the source's file, as data.path takes it (JSONL, or a .json array); relative to the recipe"))
    weight: float | None = attrs.field(default=None, validator=attrs.validators.optional(in_range(low=0.0)),
                                       metadata=_doc(
        "this source's share of the mixture (weights are normalised over the sources); the mixture holds "
        "data.mix_samples samples, or, without it, as many as the first source to run out allows"))
    samples: int | None = attrs.field(default=None, validator=attrs.validators.optional(in_range(low=1)),
                                      metadata=_doc(
        "exactly this many samples of the source (repeating it when it has fewer); neither key: all of it once"))

    def __attrs_post_init__(self) -> None:
        if self.weight is not None and self.samples is not None:
            raise ValueError(f"data.sources {self.path!r}: give weight or samples, not both")


@attrs.frozen(kw_only=True)
class DataSection:
    source: Literal["synthetic", "jsonl", "text"] = attrs.field(default="synthetic", metadata=_doc(
        "synthetic conversations, a JSONL chat file, or plain text files packed into samples of data.tokens tokens "
        "(real text for loss curves)"))
    path: str | None = attrs.field(default=None, metadata=_doc(
        "jsonl: the data file (chat, sharegpt, LLaVA or Alpaca records: .jsonl a record a line, .json one array of "
        "them, .csv a row each, .parquet), a folder a Hugging Face dataset was saved to (save_to_disk), or a folder "
        "of such files; "
        "text: a glob of plain text files (** recursive; \"<stdlib>/**/*.py\": "
        "the Python standard library's sources); relative to the recipe (with --set: to the current folder)"))
    split: str = attrs.field(default="train", metadata=_doc(
        "the split read of a saved Hugging Face DatasetDict (data.path a save_to_disk folder)"))
    sources: tuple[DataSource, ...] = attrs.field(default=(), metadata=_doc(
        "jsonl: several datasets mixed, [[data.sources]] tables of path and weight or samples (in place of "
        "data.path); the mixture is drawn once from train.seed, every epoch shuffles it"))
    mix_samples: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "samples in a weighted mixture of data.sources (an epoch); 0 = as many as the first source to run out "
        "allows, no weighted sample repeated"))
    num_samples: int = attrs.field(default=256, validator=in_range(low=1), metadata=_doc(
        "synthetic samples; text: the most samples taken from the files"))
    skip_samples: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "text: the stream's first N samples left out, the tokenizer unchanged (a held-out evaluation: "
        "weft eval --set data.skip_samples=<the run's data.num_samples>)"))
    min_side: int = attrs.field(default=28, validator=in_range(low=28),
                                metadata=_doc("smallest synthetic image side, px"))
    max_side: int = attrs.field(default=112, validator=in_range(low=28),
                                metadata=_doc("largest synthetic image side, px"))
    system: str | None = attrs.field(default=None, metadata=_doc(
        "default system prompt: the system message of every conversation that does not open with one (training, "
        "eval and weft generate), in place of the chat template's default (Qwen2.5-VL's: \"You are a helpful "
        "assistant.\"); unset: the template's own"))
    strict: bool = attrs.field(default=False, metadata=_doc("a bad sample stops the run instead of being skipped"))
    max_pixels: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "an image of more pixels (width x height) is resized to fit by the model's image processor (Qwen2.5-VL's "
        "smart_resize: sides multiples of patch x merge, the aspect kept), as its max_pixels does (training, eval, "
        "weft generate); 0 = the processor folder's own (its size.longest_edge)"))
    min_pixels: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "an image of fewer pixels is resized up to this many, as above; 0 = the processor folder's own "
        "(size.shortest_edge)"))
    skip_pixels: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "an image file of more pixels is skipped and counted before it is decoded (a guard against huge files); "
        "0 = PIL's decompression-bomb limit (~89M)"))
    allow_outside: bool = attrs.field(default=True, metadata=_doc(
        "jsonl: a record's image and video paths may leave the data file's folder (absolute paths, '..', symlinks "
        "to elsewhere), as LLaMA-Factory and ms-swift read local data; false: such a record is a bad sample, "
        "skipped and counted before its file is looked at (for a dataset from elsewhere: it reads no file beside "
        "it)"))
    workers: int = attrs.field(default=-1, validator=in_range(low=-1),
                               metadata=_doc("preprocessing processes; -1 = min(8, cores - 1), 0/1 = in-process"))
    cache: bool = attrs.field(default=True,
                              metadata=_doc(
        "jsonl: preprocess once into shards on disk beside the dataset (<file>.weft-cache/), which every rank maps "
        "and reads by sample; false: preprocess at every start, every sample held in memory"))
    tokens: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "synthetic: samples of exactly this many tokens, ids from the model's vocabulary, no tokenizer needed "
        "(0: short chat conversations through the model's processor); text: the length of every sample"))
    tokens_max: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "synthetic with tokens: each sample's length drawn from [tokens, tokens_max]; 0 = exactly tokens"))
    pair_response_tokens: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "synthetic with tokens: every sample a preference pair (objective dpo), two conversations of data.tokens "
        "tokens each that share all but their last pair_response_tokens (the responses, labelled; the prompt not)"))
    images: tuple[tuple[int, ...], ...] = attrs.field(default=(), metadata=_doc(
        "synthetic with tokens: the images of every sample as [height, width] pixels, e.g. [[448, 448]]"))
    videos: tuple[tuple[int, ...], ...] = attrs.field(default=(), metadata=_doc(
        "synthetic videos as [frames, height, width], e.g. [[4, 56, 56]]: without data.tokens, conversations about "
        "a moving shape (samples then mix images, videos and both); with data.tokens, every long sample opens with "
        "these videos (random frames, after data.images)"))
    video_fps: float | None = attrs.field(default=None, validator=attrs.validators.optional(in_range(low=0.01)),
                                          metadata=_doc(
        "frames per second (at least 0.01) sampled from a video file (a list of frames is taken to be at this rate); "
        "a video part's own 'fps' key overrides it; unset: the model folder's video_preprocessor_config.json "
        "'fps' when it has one, else 2 (Qwen2.5-VL's)"))
    max_frames: int = attrs.field(default=768, validator=in_range(low=2), metadata=_doc(
        "most frames kept of one video (sampled evenly); a video part's own 'max_frames' key overrides it"))

    @property
    def pixels(self) -> tuple[int, int]:
        """(min, max) pixels images are resized within; 0 = the processor's own bound."""
        return self.min_pixels, self.max_pixels

    def __attrs_post_init__(self) -> None:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"data.min_pixels ({self.min_pixels:,}) is over data.max_pixels ({self.max_pixels:,})")
        if self.source == "jsonl" and (self.path is None) == (not self.sources):
            raise ValueError("data.source = 'jsonl' needs data.path (one file) or [[data.sources]] (several mixed), "
                             "one of them")
        if self.sources and self.source != "jsonl":
            raise ValueError(f"[[data.sources]] mixes data files: data.source = 'jsonl' (it is {self.source!r})")
        if any(s.weight is not None for s in self.sources) and any(s.weight is None for s in self.sources):
            raise ValueError("[[data.sources]]: give every source a weight, or none (samples counts, or whole)")
        if self.mix_samples and not any(s.weight is not None for s in self.sources):
            raise ValueError("data.mix_samples sizes a weighted mixture: give the [[data.sources]] weights")
        if self.source == "text" and (self.path is None or not self.tokens):
            raise ValueError("data.source = 'text' packs the files of data.path (a glob, e.g. \"<stdlib>/**/*.py\") "
                             "into samples of data.tokens tokens: set both")
        if self.source == "text" and (self.images or self.videos or self.tokens_max):
            raise ValueError("data.source = 'text' makes text-only samples of exactly data.tokens tokens: drop "
                             "data.images, data.videos and data.tokens_max")
        if self.skip_samples and self.source != "text":
            raise ValueError(f"data.skip_samples = {self.skip_samples} holds out the first samples of a text corpus; "
                             f"data.source is {self.source!r}: set data.source = 'text' or drop data.skip_samples")
        if self.source == "synthetic" and self.path is not None:
            # Training on synthetic data while the user meant their file is the worst silent failure.
            raise ValueError(f"data.path = {self.path!r} is read only with data.source = 'jsonl'; "
                             "data.source is 'synthetic' (the default): set data.source = 'jsonl' or drop data.path")
        if self.pair_response_tokens and (self.source != "synthetic" or not self.tokens
                                          or self.pair_response_tokens >= self.tokens):
            raise ValueError(f"data.pair_response_tokens = {self.pair_response_tokens} makes synthetic pairs: it needs "
                             f"data.source = 'synthetic' and data.tokens above it (they are {self.source!r} and "
                             f"{self.tokens})")
        if self.tokens_max and self.tokens_max < self.tokens:
            raise ValueError(f"data.tokens_max ({self.tokens_max}) is below data.tokens ({self.tokens})")
        if self.images and not self.tokens:
            raise ValueError("data.images sizes the images of long synthetic samples: set data.tokens too")
        for size in self.images:
            if len(size) != 2 or min(size) < 28:
                raise ValueError(f"data.images takes [height, width] pairs of at least 28 px, got {list(size)}")
        for size in self.videos:
            if len(size) != 3 or size[0] < 1 or min(size[1:]) < 28:
                raise ValueError(f"data.videos takes [frames, height, width] of at least 1 frame and 28 px, got "
                                 f"{list(size)}")
        if self.videos and self.source != "synthetic":
            raise ValueError("data.videos makes synthetic samples with videos: data.source = 'synthetic'")
        if self.min_side > self.max_side:
            raise ValueError(f"data.min_side ({self.min_side}) is larger than data.max_side ({self.max_side})")


@attrs.frozen(kw_only=True)
class EvalSection:
    """Held-out evaluation during a run: every ``every`` steps (and after the last) the loss over
    every sample of ``data`` once, forward only, as `weft eval` gives it on that step's weights."""

    every: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "steps between held-out evaluations during `weft run` (and after the last step), each row's eval_loss in "
        "metrics.jsonl; 0 = none"))
    data: DataSection | None = attrs.field(default=None, metadata=_doc(
        "[eval.data]: the [data] keys that differ for the held-out samples (e.g. path = \"val.jsonl\", or for text "
        "skip_samples = 0 and num_samples = N where [data] skips those N); the rest is [data]'s"))
    micro_batch_tokens: int = attrs.field(default=0, validator=in_range(low=0), metadata=_doc(
        "padded tokens per held-out micro-batch per rank, in a run's [eval] and in `weft eval` (a lever when the "
        "held-out pass runs out of memory); 0 = train.micro_batch_tokens; a held-out sample longer is skipped and "
        "counted"))
    task: str | None = attrs.field(default=None, metadata=_doc(
        "a task file (JSONL, `weft eval --task`'s questions; relative to the recipe) scored at every evaluation: "
        "eval_accuracy (and eval_accuracy_norm) in metrics.jsonl, each question's result in eval/task-step-N.jsonl; "
        "its lines need choices (scored by log-likelihood under the run's plan; generated answers are `weft eval "
        "--task`'s)"))
    best_by: Literal["loss", "accuracy"] = attrs.field(default="loss", metadata=_doc(
        "what eval.keep_best keeps: the lowest eval_loss, or the highest eval_accuracy (needs eval.task)"))
    keep_best: bool = attrs.field(default=False, metadata=_doc(
        "keep the checkpoint of the lowest eval_loss beside the newest train.keep_checkpoints (checkpoints/"
        "best.json names it; summary.json's best_checkpoint); every checkpoint step must be an evaluation step "
        "(train.checkpoint_every a multiple of eval.every)"))
