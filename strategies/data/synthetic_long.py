"""Long synthetic samples for any model shape, without a tokenizer: benchmarks at 32K-128K tokens.

Each sample is ``[<|vision_start|> <|image_pad|> * n <|vision_end|>] * images``, then
``[<|vision_start|> <|video_pad|> * m <|vision_end|>] * videos``, then text, with exactly
the requested number of tokens. A video is ``frames`` random frames (a multiple of the
temporal patch), ``second_per_grid_ts`` from ``video_fps``: long-video benchmarks at
128K without a decoder in the loop. Text ids are uniform over the vocabulary
minus every special id, so no stray image token can break the image-feature count; the
loss is on the text (plain next-token prediction), never on the image span. Pixel values
come from the model's image processor when one is given, or else are made directly in
its layout (CLIP-normalised patches of a rounded size), so no processor folder is needed
for a real-size model such as Qwen2.5-VL-7B.

Every sample is drawn from its own generator, seeded from (seed, sample index): sample i
is the same whatever ``num_samples``, so data-parallel ranks can take samples by index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from PIL import Image

from weft.strategies.data.conversation import IGNORE_INDEX, IMAGE_TYPE, TEXT_TYPE, VIDEO_TYPE, Sample

#: OpenAI CLIP's per-channel mean and std, which Qwen2-VL/2.5-VL/3-VL processors normalise with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: Config attributes -> keys of ``special``; text ids come from the text config.
_TOP_IDS = {"image": "image_token_id", "video": "video_token_id", "vision_start": "vision_start_token_id",
            "vision_end": "vision_end_token_id"}
_TEXT_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id"}


def special_ids(config: Any) -> dict[str, int | list[int]]:
    """The special ids of a transformers config, by the names ``long_samples`` reads
    (image, video, vision_start, vision_end, bos, eos, pad); unset ones are left out."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {key: getattr(config, attr, None) for key, attr in _TOP_IDS.items()}
    found |= {key: getattr(text, attr, None) if getattr(text, attr, None) is not None else getattr(config, attr, None)
              for key, attr in _TEXT_IDS.items()}
    return {key: value for key, value in found.items() if value is not None}


def long_samples(*, seed: int, num_samples: int, tokens: int | tuple[int, int], vocab_size: int,
                 special: dict[str, int | Sequence[int]], images: list[tuple[int, int]] | None,
                 image_processor: Any | None, patch_size: int, merge_size: int, temporal_patch_size: int,
                 in_channels: int = 3, videos: list[tuple[int, int, int]] | None = None,
                 video_fps: float = 2.0, pair_response: int = 0) -> Iterator[Sample]:
    """``num_samples`` Samples of exactly ``tokens`` tokens (or a length drawn uniformly
    from the inclusive range), each starting with one image of every (height, width) in
    ``images``. ``pair_response`` > 0: each a preference pair (strategies/data/pairs.py) of two
    such conversations, the same but for their last ``pair_response`` tokens, labelled there
    only (a prompt and two responses). ``special``: name -> id (or ids) to keep out of the text, e.g.
    ``special_ids(config)``; "image", "vision_start" and "vision_end" are needed with images.
    Arguments are checked at the call, not at the first sample."""
    lo, hi = (tokens, tokens) if isinstance(tokens, int) else tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"tokens must be >= 1 (a range low <= high), got {tokens}")
    if not 0 <= pair_response < lo:
        raise ValueError(f"pair_response must be >= 0 and below the sample's length, got {pair_response} of {lo}")
    if num_samples < 0 or min(patch_size, merge_size, temporal_patch_size, in_channels) < 1:
        raise ValueError("num_samples must be >= 0; patch, merge and temporal sizes and channels >= 1")
    sizes = list(images or [])
    if any(h < 1 or w < 1 for h, w in sizes):
        raise ValueError(f"image sizes must be positive (height, width), got {sizes}")
    clips = list(videos or [])
    if any(f < 1 or h < 1 or w < 1 for f, h, w in clips) or video_fps <= 0:
        raise ValueError(f"videos take positive (frames, height, width) and a positive fps, got {clips}, {video_fps}")
    if sizes:
        missing = [k for k in ("image", "vision_start", "vision_end") if not isinstance(special.get(k), int)]
        if missing:
            raise ValueError(f"images need the special ids {missing} (an int each)")
    if clips:
        missing = [k for k in ("video", "vision_start", "vision_end") if not isinstance(special.get(k), int)]
        if missing:
            raise ValueError(f"videos need the special ids {missing} (an int each)")
    if image_processor is not None:
        _check_processor(image_processor, patch_size=patch_size, merge_size=merge_size,
                         temporal_patch_size=temporal_patch_size, in_channels=in_channels)
    excluded = sorted({i for v in special.values() for i in ([v] if isinstance(v, int) else v) if 0 <= i < vocab_size})
    allowed = vocab_size - len(excluded)
    if allowed < 1:
        raise ValueError(f"no text id is left in a vocabulary of {vocab_size} without the special ids")
    # The k-th allowed id is k plus the number of special ids at or below it: with the
    # specials shifted down by their rank, a right-sided search counts exactly those.
    shifted = torch.tensor([e - rank for rank, e in enumerate(excluded)], dtype=torch.long)  # (E,)
    layout = dict(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                  in_channels=in_channels)

    def samples() -> Iterator[Sample]:
        for index in range(num_samples):
            generator = _generator(seed, index)
            length = lo if lo == hi else int(torch.randint(lo, hi + 1, (1,), generator=generator))
            sample = _sample(generator, length=length, sizes=sizes, special=special, allowed=allowed, shifted=shifted,
                             image_processor=image_processor, clips=clips, video_fps=video_fps, **layout)
            yield _pair(generator, sample, response=pair_response, allowed=allowed, shifted=shifted) \
                if pair_response else sample

    return samples()


def _sample(generator: torch.Generator, *, length: int, sizes: list[tuple[int, int]], special: dict,
            allowed: int, shifted: torch.Tensor, image_processor: Any | None, patch_size: int, merge_size: int,
            temporal_patch_size: int, in_channels: int, clips: list[tuple[int, int, int]], video_fps: float) -> Sample:
    pixel_values = grid_thw = None
    prefix: list[int] = []
    types: list[int] = []
    if sizes:
        if image_processor is not None:
            # The requested sizes: the processor resizes them (its rounding and its min/max pixels).
            pixels = [_random_pixels(generator, height=h, width=w, channels=in_channels) for h, w in sizes]
            processed = image_processor(images=[Image.fromarray(p.numpy()) for p in pixels], return_tensors="pt")
            pixel_values = processed["pixel_values"].to(torch.float32)  # (N_patches, C*T*P*P)
            grid_thw = processed["image_grid_thw"].to(torch.long)  # (n_images, 3)
        else:
            rounded = [rounded_size(h, w, patch_size=patch_size, merge_size=merge_size) for h, w in sizes]
            pixels = [_random_pixels(generator, height=h, width=w, channels=in_channels) for h, w in rounded]
            parts = [patchify(p, patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size)
                     for p in pixels]
            pixel_values = torch.cat([values for values, _ in parts])  # (N_patches, C*T*P*P)
            grid_thw = torch.tensor([grid for _, grid in parts], dtype=torch.long)  # (n_images, 3)
        for grid in grid_thw.tolist():
            pads = grid[0] * grid[1] * grid[2] // merge_size**2
            prefix += [special["vision_start"], *[special["image"]] * pads, special["vision_end"]]
            types += [TEXT_TYPE, *[IMAGE_TYPE] * pads, TEXT_TYPE]
    video = _videos(generator, clips=clips, video_fps=video_fps, image_processor=image_processor,
                    patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                    in_channels=in_channels) if clips else {}
    for grid in video.get("video_grid_thw", torch.zeros(0, 3)).tolist():
        pads = int(grid[0] * grid[1] * grid[2]) // merge_size**2
        prefix += [special["vision_start"], *[special["video"]] * pads, special["vision_end"]]
        types += [TEXT_TYPE, *[VIDEO_TYPE] * pads, TEXT_TYPE]
    n_text = length - len(prefix)
    if n_text < 1:
        raise ValueError(f"the images and videos take {len(prefix)} tokens: no room for text in a sample of {length}")
    text = _text_ids(generator, n_text, allowed=allowed, shifted=shifted)  # (T,)
    input_ids = torch.cat([torch.tensor(prefix, dtype=torch.long), text])  # (S,)
    labels = torch.cat([torch.full((len(prefix),), IGNORE_INDEX, dtype=torch.long), text])  # (S,)
    mm_token_type_ids = torch.tensor(types + [TEXT_TYPE] * n_text, dtype=torch.long)  # (S,)
    return Sample(input_ids=input_ids, labels=labels, pixel_values=pixel_values, image_grid_thw=grid_thw,
                  mm_token_type_ids=mm_token_type_ids, **video)


def _text_ids(generator: torch.Generator, n: int, *, allowed: int, shifted: torch.Tensor) -> torch.Tensor:
    """(n,) text ids uniform over the vocabulary without its special ids."""
    draws = torch.randint(0, allowed, (n,), generator=generator)  # (n,) ranks among the allowed ids
    return draws + torch.searchsorted(shifted, draws, right=True)  # (n,) ids, no special among them


def _pair(generator: torch.Generator, sample: Sample, *, response: int, allowed: int, shifted: torch.Tensor) -> Sample:
    """``sample`` as a preference pair: its prompt (all but the last ``response`` tokens, which
    must be text) unlabelled, chosen = its own last tokens, rejected = other random ones."""
    from weft.strategies.data.pairs import join_pair

    cut = sample.num_tokens - response
    if bool((sample.mm_token_type_ids[cut:] != TEXT_TYPE).any()):
        raise ValueError(f"a pair's response of {response} tokens reaches into the images or videos")
    labels = sample.labels.clone()
    labels[:cut] = IGNORE_INDEX
    chosen = attrs.evolve(sample, labels=labels)
    other = _text_ids(generator, response, allowed=allowed, shifted=shifted)  # (R,)
    rejected = attrs.evolve(chosen, input_ids=torch.cat([sample.input_ids[:cut], other]),
                            labels=torch.cat([labels[:cut], other]))
    return join_pair(chosen, rejected, reference=None)


def _videos(generator: torch.Generator, *, clips: list[tuple[int, int, int]], video_fps: float,
            image_processor: Any | None, patch_size: int, merge_size: int, temporal_patch_size: int,
            in_channels: int) -> dict[str, torch.Tensor]:
    """Random videos in the model's layout: pixel_values_videos (N, C*T*P*P), video_grid_thw
    (n, 3) and second_per_grid_ts (n,); each video's frames rounded down to whole temporal
    patches (at least one)."""
    values, grids = [], []
    for frames, height, width in clips:
        count = max(temporal_patch_size, frames // temporal_patch_size * temporal_patch_size)
        h, w = rounded_size(height, width, patch_size=patch_size, merge_size=merge_size)
        shape = (count, h, w, in_channels)  # (F, H, W, C)
        pixels = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        if image_processor is not None:
            from weft.strategies.data.video import video_patches

            rows, grid = video_patches([Image.fromarray(f.numpy()) for f in pixels], image_processor=image_processor)
            grid = tuple(grid[0].tolist())
        else:
            rows, grid = patchify_frames(pixels, patch_size=patch_size, merge_size=merge_size,
                                         temporal_patch_size=temporal_patch_size)
        values.append(rows)
        grids.append(grid)
    return {"pixel_values_videos": torch.cat(values), "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            "second_per_grid_ts": torch.full((len(clips),), temporal_patch_size / video_fps, dtype=torch.float32)}


def rounded_size(height: int, width: int, *, patch_size: int, merge_size: int) -> tuple[int, int]:
    """The nearest multiples of patch*merge (at least one each), as the processor's
    smart_resize rounds before its min/max pixel limits."""
    factor = patch_size * merge_size
    return max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)


def patchify(pixels: torch.Tensor, *, patch_size: int, merge_size: int,
             temporal_patch_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One (H, W, C) uint8 image, H and W multiples of patch*merge -> (pixel_values
    (h*w, C*T*P*P), grid (1, h, w)), as Qwen2-VL's image processor makes them (which
    would first resize to such a size): a still image is its own frame T times."""
    frames = pixels[None].expand(temporal_patch_size, -1, -1, -1)  # (T, H, W, C)
    return patchify_frames(frames, patch_size=patch_size, merge_size=merge_size,
                           temporal_patch_size=temporal_patch_size)


def patchify_frames(frames: torch.Tensor, *, patch_size: int, merge_size: int,
                    temporal_patch_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(F, H, W, C) uint8 frames, F a multiple of T and H, W of patch*merge -> (pixel_values
    (G*h*w, C*T*P*P), grid (G, h, w)) with G = F / T, in the processor's row order."""
    count, height, width, channels = frames.shape
    if height % (patch_size * merge_size) or width % (patch_size * merge_size):
        raise ValueError(f"image {height}x{width} is not in multiples of {patch_size * merge_size}: see rounded_size")
    if count % temporal_patch_size:
        raise ValueError(f"{count} frames is not a multiple of the temporal patch size {temporal_patch_size}")
    video = frames.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # (F, C, H, W) in [0, 1]
    mean, std = (CLIP_MEAN, CLIP_STD) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)
    video = (video - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    groups, grid_h, grid_w = count // temporal_patch_size, height // patch_size, width // patch_size
    patches = video.reshape(groups, temporal_patch_size, channels, grid_h // merge_size, merge_size, patch_size,
                            grid_w // merge_size, merge_size, patch_size)
    # Rows in the processor's order: temporal groups outermost, then merge windows (2x2
    # patches) together, so the vision tower's merger sees the neighbours it expects; each
    # row is (C, T, P, P) flattened.
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (G, h/m, w/m, m, m, C, T, P, P)
    values = patches.reshape(groups * grid_h * grid_w, channels * temporal_patch_size * patch_size**2)
    return values, (groups, grid_h, grid_w)


def _random_pixels(generator: torch.Generator, *, height: int, width: int, channels: int) -> torch.Tensor:
    return torch.randint(0, 256, (height, width, channels), dtype=torch.uint8, generator=generator)  # (H, W, C)


def _check_processor(processor: Any, **expected: int) -> None:
    """The processor must cut patches the way the model's vision config says, or the model
    gets rows of the wrong width (or another feature count than the image tokens)."""
    if expected["in_channels"] != 3:
        raise ValueError(f"an image processor takes RGB images; in_channels is {expected['in_channels']}")
    for name in ("patch_size", "merge_size", "temporal_patch_size"):
        if getattr(processor, name, expected[name]) != expected[name]:
            raise ValueError(f"image processor's {name} {getattr(processor, name)} is not the model's {expected[name]}")


def _generator(seed: int, index: int) -> torch.Generator:
    digest = hashlib.sha256(f"synthetic_long\0{seed}\0{index}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
