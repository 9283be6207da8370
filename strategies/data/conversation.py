"""Qwen-VL chat preprocessing: messages -> token ids, labels and image patches.

The conversation is rendered by the processor's chat template, or by weft's built-in
layout (Qwen2.5-VL's template) when the processor has none (strategies/data/chat_format.py),
and tokenized as ``apply_chat_template(tokenize=True)`` tokenizes it. Each image's
placeholder pad then becomes
`<|vision_start|>` + `<|image_pad|>` * n + `<|vision_end|>` with
n = grid_t * grid_h * grid_w // merge_size**2, the number of features the vision
tower's patch merger returns for it; each video likewise becomes
`<|vision_start|>` + `<|video_pad|>` * n + `<|vision_end|>` (strategies/data/video.py).

Labels are aligned with input_ids (not shifted; transformers' loss shifts) and are
-100 except on assistant content and the assistant's closing `<|im_end|>`, which the
model must learn to emit to stop.
"""

from __future__ import annotations

import importlib.resources
import io
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from PIL import Image

from weft.strategies.data.chat_format import Rendered, processor_chat_template, render_chat
from weft.strategies.data.images import open_allowed

IGNORE_INDEX = -100
# Values of mm_token_type_ids, as transformers' Qwen2.5-VL processor writes them.
TEXT_TYPE, IMAGE_TYPE, VIDEO_TYPE = 0, 1, 2

_RECIPES_PACKAGE = "weft.recipes"
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})


# eq=False: attrs' generated == would compare tensors elementwise and fail on bool().
@attrs.frozen(kw_only=True, eq=False)
class Sample:
    """One tokenized conversation; tensors are on CPU."""

    input_ids: torch.Tensor  # (S,) long
    labels: torch.Tensor  # (S,) long, IGNORE_INDEX where no loss
    pixel_values: torch.Tensor | None = None  # (N_patches, C*T*P*P) float
    image_grid_thw: torch.Tensor | None = None  # (n_images, 3) long
    pixel_values_videos: torch.Tensor | None = None  # (N_video_patches, C*T*P*P) float
    video_grid_thw: torch.Tensor | None = None  # (n_videos, 3) long
    second_per_grid_ts: torch.Tensor | None = None  # (n_videos,) float: seconds one temporal patch spans
    # (S,) long: 0 text, 1 image. Qwen2.5-VL only builds its 3D (mRoPE) position ids
    # when this is passed; without it image tokens silently get 1D text positions.
    # May be omitted only for text-only samples, where it is all zeros.
    mm_token_type_ids: torch.Tensor = attrs.field()
    #: A preference pair (strategies/data/pairs.py): its chosen and its rejected conversation end
    #: to end, (1,) long the chosen one's tokens; and (2,) float64 the reference model's summed
    #: log-probabilities of the two responses, where the record gave them.
    pair_split: torch.Tensor | None = None
    reference_logps: torch.Tensor | None = None

    @mm_token_type_ids.default
    def _text_only_types(self) -> torch.Tensor:
        if self.image_grid_thw is not None or self.video_grid_thw is not None:
            raise ValueError("a Sample with images or videos needs mm_token_type_ids")
        return torch.zeros_like(self.input_ids)

    def __attrs_post_init__(self) -> None:
        if self.input_ids.ndim != 1 or self.labels.shape != self.input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} / labels {tuple(self.labels.shape)} must be equal 1-D"
            )
        if self.mm_token_type_ids.shape != self.input_ids.shape:
            raise ValueError("mm_token_type_ids must have the shape of input_ids")
        if self.pair_split is not None and not 0 < int(self.pair_split[0]) < self.num_tokens:
            raise ValueError(f"pair_split {int(self.pair_split[0])} must fall inside the sample's "
                             f"{self.num_tokens} tokens")
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw come together")
        if self.image_grid_thw is not None:
            n_patches = int(self.image_grid_thw.prod(-1).sum())
            if self.pixel_values.shape[0] != n_patches:
                raise ValueError(f"pixel_values has {self.pixel_values.shape[0]} rows, grids say {n_patches}")
        video_keys = (self.pixel_values_videos, self.video_grid_thw, self.second_per_grid_ts)
        if len({value is None for value in video_keys}) != 1:
            raise ValueError("pixel_values_videos, video_grid_thw and second_per_grid_ts come together")
        if self.video_grid_thw is not None:
            n_patches = int(self.video_grid_thw.prod(-1).sum())
            if self.pixel_values_videos.shape[0] != n_patches:
                raise ValueError(f"pixel_values_videos has {self.pixel_values_videos.shape[0]} rows, "
                                 f"grids say {n_patches}")
            if self.second_per_grid_ts.shape != (self.video_grid_thw.shape[0],):
                raise ValueError("second_per_grid_ts needs one value per video")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


#: The id of a special token the tokenizer lacks: no token has it, so nothing matches it.
ABSENT = -1


@attrs.frozen(kw_only=True)
class _SpecialIds:
    """The Qwen-VL family's vision tokens; a text-only model's tokenizer (Llama's, SmolLM2's) has
    none of them (ABSENT), and its conversations may hold no images or videos."""

    vision_start: int = ABSENT
    vision_end: int = ABSENT
    image_pad: int = ABSENT
    video_pad: int | None = None  # a tokenizer without one reads no videos

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> _SpecialIds:
        names = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image_pad": "<|image_pad|>"}
        found = {field: _token_id(tokenizer, token) for field, token in names.items()}
        if None in found.values() and any(v is not None for v in found.values()):
            missing = [names[f] for f, v in found.items() if v is None]
            raise ValueError(f"tokenizer has some of Qwen-VL's vision tokens but not {', '.join(missing)}")
        ids = {f: v for f, v in found.items() if v is not None}
        if (video := _token_id(tokenizer, "<|video_pad|>")) is not None and ids:
            ids["video_pad"] = video
        return cls(**ids)


def _token_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    return None if token_id is None or token_id == tokenizer.unk_token_id else int(token_id)


def encode_conversation(
    conversation_messages: Sequence[Mapping[str, Any]], *, tokenizer: Any, image_processor: Any,
    system: str | None = None, video_sizing: Any = None,
) -> Sample:
    """Tokenize one chat (transformers message format) into a training Sample.

    `conversation_messages` may also be an object with a `.messages` attribute
    (e.g. synthetic_vl.Conversation). `system` is the system message of a conversation
    that has none (the recipe's ``data.system``); None keeps the template's default.
    `video_sizing` (strategies.video_size.VideoSizing, from the processor folder's
    video_preprocessor_config.json) sizes video frames; None: the image processor does.
    """
    messages = getattr(conversation_messages, "messages", conversation_messages)
    special = _SpecialIds.from_tokenizer(tokenizer)
    rendered = render_chat(messages, tokenizer=tokenizer, system=system)
    sample, pads_per_image, pads_per_video = _tokenized(rendered, messages, tokenizer=tokenizer,
                                                        image_processor=image_processor, special=special,
                                                        video_sizing=video_sizing)
    _validate(sample.input_ids, sample.labels, special=special, pads_per_image=pads_per_image,
              pads_per_video=pads_per_video)
    return sample


def encode_prompt(messages: Sequence[Mapping[str, Any]], *, tokenizer: Any, image_processor: Any,
                  system: str | None = None, video_sizing: Any = None) -> Sample:
    """The conversation so far and the header the assistant's reply continues from (the
    template's generation prompt, ``<|im_start|>assistant\\n`` for Qwen), as `weft generate`
    feeds it; no labels."""
    special = _SpecialIds.from_tokenizer(tokenizer)
    rendered = render_chat(messages, tokenizer=tokenizer, system=system, generation_prompt=True)
    return _tokenized(rendered, messages, tokenizer=tokenizer, image_processor=image_processor, special=special,
                      video_sizing=video_sizing)[0]


def _tokenized(rendered: Rendered, messages: Sequence[Mapping[str, Any]], *, tokenizer: Any, image_processor: Any,
               special: _SpecialIds, video_sizing: Any = None) -> tuple[Sample, list[int], list[int]]:
    """(Sample, pads per image, pads per video) of rendered text: tokenized as transformers'
    ``apply_chat_template(tokenize=True)`` tokenizes it, then each image and video placeholder
    pad widened to the n = grid_t * grid_h * grid_w // merge_size**2 features the vision tower
    returns for it (what the processor does to the text before tokenizing; the pads are special
    tokens, so widening after gives the same ids). Labels on tokens that overlap a reply span,
    never on vision tokens: the model cannot fill an image it emits."""
    images = [_to_rgb(_open_image(part)) for m in messages for part in _parts(m) if part["type"] == "image"]
    if images and (image_processor is None or special.image_pad == ABSENT):
        raise ValueError("an image, but this model reads none (a text-only model: its folder has no image processor "
                         "or its tokenizer no <|image_pad|>)")
    pixel_values = image_grid_thw = None
    pads_per_image: list[int] = []
    merge = int(getattr(image_processor, "merge_size", 2))
    if images:
        processed = image_processor(images=images, return_tensors="pt")
        pixel_values = processed["pixel_values"].to(torch.float32)  # (N_patches, C*T*P*P)
        image_grid_thw = processed["image_grid_thw"].to(torch.long)  # (n_images, 3)
        pads_per_image = [int(n) // merge**2 for n in image_grid_thw.prod(-1)]
    videos = _encode_videos([p for m in messages for p in _parts(m) if p["type"] == "video"],
                            image_processor=image_processor, special=special, video_sizing=video_sizing)
    pads_per_video = [int(n) // merge**2 for n in videos["video_grid_thw"].prod(-1)] if videos else []

    enc = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    vision = {special.vision_start, special.vision_end, special.image_pad, special.video_pad} - {ABSENT, None}
    widths = {special.image_pad: (pads_per_image, IMAGE_TYPE, "image")} if special.image_pad != ABSENT else {}
    if special.video_pad is not None:
        widths[special.video_pad] = (pads_per_video, VIDEO_TYPE, "video")
    for token_id, (pads, _, kind) in widths.items():
        if (rendered_count := enc["input_ids"].count(token_id)) != len(pads):
            hint = ("a special token in the text?" if rendered_count > len(pads)
                    else f"the chat template leaves out {kind}s outside user turns?")
            raise ValueError(f"{kind}-token count: the chat text holds {rendered_count} {kind} placeholders for "
                             f"{len(pads)} {kind}s ({hint})")
    queues = {token_id: iter(pads) for token_id, (pads, _, _) in widths.items()}
    ids: list[int] = []
    train: list[bool] = []
    types: list[int] = []
    for token_id, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        if token_id in widths:
            count = next(queues[token_id])
            ids += [token_id] * count
            train += [False] * count
            types += [widths[token_id][1]] * count
            continue
        ids.append(token_id)
        # A token that overlaps a reply (even one that starts in its header) carries trained text.
        train.append(token_id not in vision and any(start < b and end > a for a, b in rendered.trained))
        types.append(TEXT_TYPE)

    input_ids = torch.tensor(ids, dtype=torch.long)  # (S,)
    labels = torch.where(torch.tensor(train, dtype=torch.bool), input_ids, IGNORE_INDEX)  # (S,)
    sample = Sample(input_ids=input_ids, labels=labels, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                    mm_token_type_ids=torch.tensor(types, dtype=torch.long), **videos)
    return sample, pads_per_image, pads_per_video


def _encode_videos(parts: list, *, image_processor: Any, special: _SpecialIds,
                   video_sizing: Any = None) -> dict[str, torch.Tensor]:
    """The Sample's video tensors for video parts (``{"type": "video", "video": [frames],
    "fps": sampled frames per second}``), or {} when there are none."""
    from weft.strategies.data.video import DEFAULT_FPS, sample_indices, seconds_per_patch, video_patches

    if not parts:
        return {}
    if special.video_pad is None or image_processor is None:
        raise ValueError("a video, but this model reads none (its tokenizer has no <|video_pad|> or its folder no "
                         "image processor)")
    temporal = int(image_processor.temporal_patch_size)
    pixels, grids, seconds = [], [], []
    for part in parts:
        frames = part.get("video")
        if not isinstance(frames, (list, tuple)) or not frames:
            raise TypeError("a video part holds its frames (a list of PIL images); data_formats loads files")
        count = max(temporal, -(-len(frames) // temporal) * temporal)  # whole temporal patches
        frames = [_to_rgb(_open_image({"image": frames[i]})) for i in sample_indices(len(frames), count)]
        values, grid = video_patches(frames, image_processor=image_processor, sizing=video_sizing)
        pixels.append(values)
        grids.append(grid)
        seconds.append(seconds_per_patch(temporal=temporal, sampled_fps=float(part.get("fps") or DEFAULT_FPS)))
    return {"pixel_values_videos": torch.cat(pixels),  # (N_video_patches, C*T*P*P)
            "video_grid_thw": torch.cat(grids),  # (n_videos, 3)
            "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}  # (n_videos,)


def _validate(
    input_ids: torch.Tensor, labels: torch.Tensor, *, special: "_SpecialIds", pads_per_image: list[int],
    pads_per_video: list[int] = (),
) -> None:
    """Refuse a sample the model would fail on mid-run, or learn nothing from.

    A literal special token in the text (``<|image_pad|>``, ``<|vision_start|>``) would
    break the image-token count: transformers raises "Image features and image tokens
    do not match" at the forward. Checked here, the sample is skipped instead.
    """
    pads = int((input_ids == special.image_pad).sum())
    if pads != sum(pads_per_image):
        raise ValueError(
            f"image-token count {pads} does not match the images' {sum(pads_per_image)} features "
            "(a special token in the text?)"
        )

    if special.video_pad is not None and int((input_ids == special.video_pad).sum()) != sum(pads_per_video):
        raise ValueError(f"video-token count {int((input_ids == special.video_pad).sum())} does not match the "
                         f"videos' {sum(pads_per_video)} features (a special token in the text?)")
    starts = int((input_ids == special.vision_start).sum())
    if starts != len(pads_per_image) + len(pads_per_video):
        raise ValueError(f"{starts} <|vision_start|> tokens for {len(pads_per_image)} images "
                         f"and {len(pads_per_video)} videos")
    if not bool((labels != IGNORE_INDEX).any()):
        raise ValueError("no assistant reply: nothing to learn")


def collate(samples: Sequence[Sample], *, pad_id: int, pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad a batch. Keys: input_ids, attention_mask, labels (B, S); only if some
    sample has images also mm_token_type_ids (B, S), pixel_values (sum N_patches, D) and
    image_grid_thw (n_images, 3), so a text-only batch also suits text-only models.
    `pad_to_multiple_of` rounds S up (e.g. for sequence-parallel sharding)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    longest = max(s.num_tokens for s in samples)
    seq_len = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(samples)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)  # (B, S)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)  # (B, S)
    labels = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.long)  # (B, S)
    mm_token_type_ids = torch.zeros((batch, seq_len), dtype=torch.long)  # (B, S)
    for row, s in enumerate(samples):
        n = s.num_tokens
        input_ids[row, :n] = s.input_ids
        attention_mask[row, :n] = 1
        labels[row, :n] = s.labels
        mm_token_type_ids[row, :n] = s.mm_token_type_ids
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    # Images are concatenated in sample order: the model scatters image features into
    # the image-pad positions in row-major (batch, sequence) order, which matches.
    out.update(vision_keys(samples, mm_token_type_ids=mm_token_type_ids))
    return out


def vision_keys(samples: Sequence[Sample], *, mm_token_type_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch's vision inputs, each modality concatenated in sample order (the order in
    which the model scatters features into the pad tokens, and in which its rope index
    reads grids and ``second_per_grid_ts``); {} for a text-only batch."""
    out = {}
    with_images = [s for s in samples if s.pixel_values is not None]
    with_videos = [s for s in samples if s.pixel_values_videos is not None]
    if with_images or with_videos:
        out["mm_token_type_ids"] = mm_token_type_ids
    if with_images:
        out["pixel_values"] = torch.cat([s.pixel_values for s in with_images])  # (sum N_patches, D)
        out["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])  # (n_images, 3)
    if with_videos:
        out["pixel_values_videos"] = torch.cat([s.pixel_values_videos for s in with_videos])  # (sum N, D)
        out["video_grid_thw"] = torch.cat([s.video_grid_thw for s in with_videos])  # (n_videos, 3)
        out["second_per_grid_ts"] = torch.cat([s.second_per_grid_ts for s in with_videos])  # (n_videos,)
    return out


def processor_dir(path_or_bundled_name: str | os.PathLike[str]) -> pathlib.Path:
    """The folder a processor name points at: a bundled name ("tiny_vl") or a path."""
    text = os.fspath(path_or_bundled_name)
    if not isinstance(path_or_bundled_name, os.PathLike) and os.sep not in text and "/" not in text:
        resource = importlib.resources.files(_RECIPES_PACKAGE) / text
        if resource.is_dir():
            return pathlib.Path(str(resource))
    return pathlib.Path(text)


def load_processor(path_or_bundled_name: str | os.PathLike[str], *, backend: str | None = "pil",
                   pixels: tuple[int, int] = (0, 0)) -> tuple[Any, Any]:
    """(tokenizer, image_processor) from a processor folder; image_processor None where the folder
    has no preprocessor_config.json (a text-only model's).

    A bare name such as "tiny_vl" means the folder shipped in `weft.recipes`; a path
    (anything with a separator, or a PathLike) is used as is. `backend="pil"` by default
    so pixel values do not depend on whether torchvision happens to be installed. The
    tokenizer carries the folder's chat template (``chat_template.jinja``, else
    ``chat_template.json``, else its own), which encode_conversation renders with. ``pixels``:
    (min, max) pixels an image is resized within by the image processor itself (``data.min_pixels``,
    ``data.max_pixels``; 0 keeps the folder's own bound).
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    text = os.fspath(path_or_bundled_name)
    is_bare_name = not isinstance(path_or_bundled_name, os.PathLike) and os.sep not in text and "/" not in text
    if is_bare_name:
        resource = importlib.resources.files(_RECIPES_PACKAGE) / text
        if resource.is_dir():
            # as_file gives a real directory even if the package is zipped.
            with importlib.resources.as_file(resource) as folder:
                return _load_from(folder, backend, AutoTokenizer, AutoImageProcessor, pixels)
    folder = pathlib.Path(text)
    if not folder.is_dir():
        raise FileNotFoundError(f"no processor folder {text!r} (neither bundled in {_RECIPES_PACKAGE} nor on disk)")
    return _load_from(folder, backend, AutoTokenizer, AutoImageProcessor, pixels)


def load_video_sizing(path_or_bundled_name: str | os.PathLike[str]) -> Any:
    """The processor folder's video sizing (strategies.video_size.VideoSizing), or None when
    it has no video_preprocessor_config.json (frames are then sized as images are)."""
    from weft.strategies.data.video_size import VideoSizing

    return VideoSizing.from_folder(processor_dir(path_or_bundled_name))


def _load_from(folder: pathlib.Path, backend: str | None, auto_tok: Any, auto_image: Any,
               pixels: tuple[int, int] = (0, 0)) -> tuple[Any, Any]:
    # The folder's files as data: never its own code (an auto_map), nothing fetched.
    tokenizer = auto_tok.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    template = processor_chat_template(folder)
    if template is not None:  # the processor's template is the one the model is served with
        tokenizer.chat_template = template
    if not (folder / "preprocessor_config.json").is_file():
        return tokenizer, None  # a text-only model's folder: its conversations hold no images
    kwargs = {} if backend is None else {"backend": backend}
    image_processor = auto_image.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False, **kwargs)
    if any(pixels):
        # The processor's own resize (Qwen2.5-VL's smart_resize), within the recipe's budget: its
        # size in pixels, shortest_edge the least and longest_edge the most.
        own = image_processor.size
        low, high = (getattr(own, name, None) if not isinstance(own, dict) else own.get(name)
                     for name in ("shortest_edge", "longest_edge"))
        if low is None or high is None:
            raise ValueError(f"data.min_pixels / data.max_pixels resize within a pixel budget; the image processor "
                             f"of {folder} sizes images otherwise (size = {dict(own) if own else own!r})")
        size = {"shortest_edge": pixels[0] or low, "longest_edge": pixels[1] or high}
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(f"data.min_pixels = {size['shortest_edge']:,} is over the image budget's most, "
                             f"{size['longest_edge']:,} pixels (data.max_pixels, else the processor's own)")
        given = json.loads((folder / "preprocessor_config.json").read_text())
        if "min_pixels" in given or "max_pixels" in given:  # the older keys, which win over size when read
            kwargs.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        image_processor = auto_image.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                                     size=size, **kwargs)
        now = image_processor.size
        if (getattr(now, "shortest_edge", None), getattr(now, "longest_edge", None)) != tuple(size.values()):
            raise ValueError(f"the image processor of {folder} did not take the pixel budget {size} (its size: {now})")
    return tokenizer, image_processor


def _parts(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = message["content"]
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _open_image(part: Mapping[str, Any]) -> Image.Image:
    """A part's image: decoded already (a data file's, strategies/data/images.py), or bytes or a path
    (`weft generate --image`) opened in the allowed formats only, as a data file's are."""
    source = part.get("image", part.get("path"))
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray)):
        return open_allowed(io.BytesIO(source))
    if isinstance(source, (str, os.PathLike)):
        return open_allowed(source)
    raise TypeError(f"image part needs a PIL image, bytes or a path, got {type(source).__name__}")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB for the image processor; transparent pixels become white (as a viewer shows
    them), rather than whatever colour happens to sit under alpha 0."""
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        return image.convert("RGB")  # L, P, CMYK, YCbCr, 1, ...
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def truncate_sample(sample: Sample, max_len: int, *, tokenizer: Any) -> Sample:
    """A sample of at most ``max_len`` tokens: its videos subsampled first, then its head.

    Videos keep every s-th whole temporal patch (the smallest stride s that fits; their
    ``second_per_grid_ts`` times s, so each kept patch keeps its time), and the text after
    them stays. When that is not enough (or there is no video), the first ``max_len``
    tokens are kept, never cutting inside a vision span: a cut that would fall inside
    ``<|vision_start|> ... <|vision_end|>`` moves to just before it, and images and videos
    past the cut leave with their patches. Raises ValueError when nothing to learn is left.
    """
    if sample.num_tokens <= max_len:
        return sample
    special = _SpecialIds.from_tokenizer(tokenizer)
    if sample.video_grid_thw is not None:
        longest = int(sample.video_grid_thw[:, 0].max())
        for stride in range(2, longest + 1):
            thinner = subsample_videos(sample, stride=stride)
            if thinner.num_tokens <= max_len:
                return thinner
        sample = subsample_videos(sample, stride=longest)
    ids = sample.input_ids
    starts = (ids == special.vision_start).nonzero().flatten().tolist()
    ends = (ids == special.vision_end).nonzero().flatten().tolist()
    cut = max_len
    kept = {IMAGE_TYPE: 0, VIDEO_TYPE: 0}
    for start, end in zip(starts, ends):
        if end < cut:
            kept[int(sample.mm_token_type_ids[start + 1])] += 1
        elif start < cut:
            cut = start  # the span would be cut: stop before it
            break
        else:
            break
    labels = sample.labels[:cut]
    if not bool((labels != IGNORE_INDEX).any()):
        raise ValueError(f"truncated to {cut} tokens (limit {max_len}), no assistant reply is left")
    media: dict[str, torch.Tensor] = {}
    if kept[IMAGE_TYPE]:
        grid = sample.image_grid_thw[: kept[IMAGE_TYPE]]
        media.update(pixel_values=sample.pixel_values[: int(grid.prod(-1).sum())], image_grid_thw=grid)
    if kept[VIDEO_TYPE]:
        grid = sample.video_grid_thw[: kept[VIDEO_TYPE]]
        media.update(pixel_values_videos=sample.pixel_values_videos[: int(grid.prod(-1).sum())], video_grid_thw=grid,
                     second_per_grid_ts=sample.second_per_grid_ts[: kept[VIDEO_TYPE]])
    return Sample(input_ids=ids[:cut], labels=labels, mm_token_type_ids=sample.mm_token_type_ids[:cut], **media)


def subsample_videos(sample: Sample, *, stride: int) -> Sample:
    """Every video of the sample keeping temporal patches 0, stride, 2 x stride, ...: their
    pad tokens and pixel rows together, whole patches only."""
    is_video = sample.mm_token_type_ids == VIDEO_TYPE  # (S,)
    starts = (is_video & ~torch.cat([is_video.new_zeros(1), is_video[:-1]])).nonzero().flatten().tolist()
    keep_token = torch.ones_like(is_video)  # (S,)
    keep_rows, grids = [], []
    for (t, h, w), start in zip(sample.video_grid_thw.tolist(), starts):
        kept = torch.arange(t) % stride == 0  # (t,) whole temporal patches
        pads = int(is_video[start:].long().cumprod(0).sum())  # this span's pad tokens: t groups of equal size
        keep_token[start : start + pads] = kept.repeat_interleave(pads // t)
        keep_rows.append(kept.repeat_interleave(h * w))  # rows run temporal patch outermost
        grids.append([int(kept.sum()), h, w])
    return Sample(
        input_ids=sample.input_ids[keep_token], labels=sample.labels[keep_token],
        mm_token_type_ids=sample.mm_token_type_ids[keep_token], pixel_values=sample.pixel_values,
        image_grid_thw=sample.image_grid_thw, pixel_values_videos=sample.pixel_values_videos[torch.cat(keep_rows)],
        video_grid_thw=torch.tensor(grids, dtype=torch.long), second_per_grid_ts=sample.second_per_grid_ts * stride,
    )
