"""`weft generate`'s prompt (one user turn and the generation prompt) and `weft eval --task`'s
questions (a conversation, and each choice as its reply), rendered as training renders chats."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch


def prompt_inputs(*, processor: str | None, text: str, images: Sequence[str], videos: Sequence[str] = (),
                  video_limits: Any = None, system: str | None = None,
                  pixels: tuple[int, int] = (0, 0)) -> dict[str, torch.Tensor]:
    """(B = 1) input_ids, attention_mask, mm_token_type_ids and the image and video inputs of one
    user turn ([images][videos]text) rendered as training renders conversations (the processor's
    chat template, else weft's layout), with ``system`` (``data.system``) as its system message
    when given, and ending with the template's generation prompt (``<|im_start|>assistant\\n``
    for Qwen); videos sampled by ``video_limits`` (strategies.video.VideoLimits) as training
    samples them."""
    from weft.core.errors import WeftError
    from weft.strategies.data.conversation import collate, encode_prompt, load_processor, load_video_sizing

    if processor is None:
        raise WeftError("this recipe's model has no processor folder (model.processor), so a text prompt cannot be "
                        "encoded", where="model.processor")
    tokenizer, image_processor = load_processor(processor, pixels=pixels)
    content = [{"type": "image", "image": path} for path in images] + _video_parts(videos, video_limits) \
        + [{"type": "text", "text": text}]
    try:
        sample = encode_prompt([{"role": "user", "content": content}], tokenizer=tokenizer,
                               image_processor=image_processor, system=system,
                               video_sizing=load_video_sizing(processor) if videos else None)
    except (OSError, ValueError) as error:
        where = "--image" if images else "--video" if videos else "--prompt"
        raise WeftError(f"cannot encode the prompt: {error}", where=where) from error
    return _model_inputs(collate([sample], pad_id=0))


#: A prompt's model inputs: the collated batch without its labels.
_INPUT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
               "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in _INPUT_KEYS if k in batch}


def task_inputs(*, processor: str | None, record: dict, base: Any, choices: Sequence[str] | None, pad_id: int,
                video_limits: Any = None, system: str | None = None,
                skip_pixels: int = 0, pixels: tuple[int, int] = (0, 0), reply_end: bool = False,
                allow_outside: bool = True) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(the question's prompt inputs (B = 1) for generation, one micro-batch per choice with the
    choice's tokens as its only labels; ``reply_end``: the reply's closing token labelled too).
    ValueError or OSError when the line cannot be read (``allow_outside`` false: a file outside
    ``base``, as data.allow_outside reads a data file)."""
    from weft.core.errors import WeftError
    from weft.strategies.data.conversation import collate, load_processor
    from weft.strategies.data.task_encode import choice_samples, continuation_samples, question, text_question
    from weft.strategies.data.text_corpus import tokenizer_encode
    from weft.strategies.data.video import VideoLimits

    if processor is None:
        raise WeftError("this recipe's model has no processor folder (model.processor) to read the questions with",
                        where="model.processor")
    tokenizer, image_processor = load_processor(processor, pixels=pixels)
    if "messages" not in record and "conversations" not in record:  # a plain-text "context" (text-only models),
        # tokenized as data.source = "text" reads text; a conversation's own "context" key stays its data
        encode = tokenizer_encode(tokenizer)
        prompt = text_question(record["context"], encode=encode)
        scored = continuation_samples(choices or (), prompt, encode=encode)
        return _model_inputs(collate([prompt], pad_id=0)), [collate([s], pad_id=pad_id) for s in scored]
    messages, prompt = question(record, base=base, tokenizer=tokenizer, image_processor=image_processor,
                                system=system, skip_pixels=skip_pixels, videos=video_limits or VideoLimits(),
                                allow_outside=allow_outside)
    scored = choice_samples(choices or (), messages, prompt, tokenizer=tokenizer, image_processor=image_processor,
                            system=system, reply_end=reply_end)
    return _model_inputs(collate([prompt], pad_id=0)), [collate([s], pad_id=pad_id) for s in scored]


def _video_parts(videos: Sequence[str], limits: Any) -> list[dict]:
    """Each video file (an absolute path) decoded and sampled as training samples videos."""
    import pathlib

    from weft.core.errors import WeftError
    from weft.strategies.data.video import VideoLimits, load_video

    parts = []
    for path in videos:
        try:
            frames, fps = load_video(path, base=pathlib.Path("/"), limits=limits or VideoLimits())
        except ValueError as error:
            raise WeftError(f"cannot read the video: {error}", where="--video") from error
        parts.append({"type": "video", "video": frames, "fps": fps})
    return parts


def decode_tokens(*, processor: str | None, ids: Sequence[int]) -> str:
    """Generated ids as text (special tokens kept: a random model emits them too)."""
    return "" if processor is None else _tokenizer(processor).decode(list(ids))


@functools.lru_cache(maxsize=4)
def _tokenizer(processor: str):
    """Loaded once per process: streaming decodes after every token."""
    from weft.strategies.data.conversation import load_processor

    return load_processor(processor)[0]
