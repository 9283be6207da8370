"""Deterministic synthetic image conversations for tests and smoke training.

Each sample draws one or two images (a coloured shape on a background) and asks a
question whose answer can only be read off the image, e.g. "What colour is the
square?" -> "The square is red.". A tiny model therefore has to use its vision tower
to push the loss down, which makes the data a real end-to-end check, not just a
shape check. Images go through a PNG encode/decode round trip so downstream code sees
the same objects (PngImageFile, real modes) as it would from files on disk.

With ``videos`` ([frames, height, width] each), samples mix the modalities: every third
is the image conversation above, the others show a video of a shape moving one way
("Which way does the red square move?" -> "It moves left."), one of them with an image
as well, so any batch of three or more holds images, videos and both.
"""

from __future__ import annotations

import io
import random
from typing import Any

import attrs
from PIL import Image, ImageDraw

# Saturated, well separated hues: after bicubic resizing and CLIP normalisation they
# stay distinguishable even for a 2-block ViT.
SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
}
# Neutral backgrounds, so a shape colour is never confused with the background.
BACKGROUND_COLOURS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
    "black": (15, 15, 15),
}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

# Every 4th sample has two images; every 3rd image is RGBA. Fixed periods (rather than
# random draws) guarantee both cases appear in any batch of >= 4 samples.
_TWO_IMAGE_PERIOD = 4
_RGBA_PERIOD = 3


@attrs.frozen(kw_only=True)
class Conversation:
    """One chat in transformers' multimodal message format (images as PIL objects)."""

    messages: list[dict[str, Any]]

    @property
    def images(self) -> list[Image.Image]:
        return [
            part["image"]
            for message in self.messages
            if isinstance(message["content"], list)
            for part in message["content"]
            if part.get("type") == "image"
        ]


@attrs.frozen(kw_only=True)
class _Scene:
    shape: str
    colour: str
    background: str


def synthetic_conversations(
    *, seed: int, num_samples: int, min_side: int = 28, max_side: int = 112,
    videos: tuple[tuple[int, int, int], ...] = (),
) -> list[Conversation]:
    """`num_samples` conversations; the same arguments always give equal output."""
    # 8 px is the least that still fits a recognisable shape (at least 4 px wide).
    if not 8 <= min_side <= max_side:
        raise ValueError(f"need 8 <= min_side <= max_side, got {min_side=}, {max_side=}")
    # A private generator: no global random state is read or changed.
    rng = random.Random(seed)
    out: list[Conversation] = []
    image_index = 0
    for sample_index in range(num_samples):
        n_images = 2 if sample_index % _TWO_IMAGE_PERIOD == _TWO_IMAGE_PERIOD - 1 else 1
        scenes, images = [], []
        for _ in range(n_images):
            scene = _Scene(
                shape=rng.choice(SHAPES),
                colour=rng.choice(sorted(SHAPE_COLOURS)),
                background=rng.choice(sorted(BACKGROUND_COLOURS)),
            )
            rgba = image_index % _RGBA_PERIOD == _RGBA_PERIOD - 1
            size = (rng.randint(min_side, max_side), rng.randint(min_side, max_side))  # (W, H)
            images.append(_png_roundtrip(_draw(scene, size=size, rgba=rgba, rng=rng)))
            scenes.append(scene)
            image_index += 1
        question, answer = _question_answer(scenes, rgba_last=images[-1].mode == "RGBA", rng=rng)
        user_content: list[dict[str, Any]] = [{"type": "image", "image": im} for im in images]
        if videos and sample_index % 3:
            clips, question, answer = _video_question(videos, rng=rng)
            user_content = user_content[: sample_index % 3 - 1] + clips  # % 3 == 2: an image, then the videos
        user_content.append({"type": "text", "text": question})
        messages = [
            {"role": "user", "content": user_content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        out.append(Conversation(messages=messages))
    return out


def _video_question(videos: tuple[tuple[int, int, int], ...], *, rng: random.Random
                    ) -> tuple[list[dict[str, Any]], str, str]:
    """Video parts (frames as RGB images, 2 frames per second) of one shape moving one way, and
    a question about the last video that only its motion answers."""
    parts, scene, direction = [], None, None
    for frames, height, width in videos:
        scene = _Scene(shape=rng.choice(SHAPES), colour=rng.choice(sorted(SHAPE_COLOURS)),
                       background=rng.choice(sorted(BACKGROUND_COLOURS)))
        direction = rng.choice(sorted(DIRECTIONS))
        parts.append({"type": "video", "video": _moving(scene, frames=frames, size=(width, height),
                                                        step=DIRECTIONS[direction]), "fps": 2.0})
    return parts, f"Which way does the {scene.colour} {scene.shape} move?", f"It moves {direction}."


def _moving(scene: _Scene, *, frames: int, size: tuple[int, int], step: tuple[int, int]) -> list[Image.Image]:
    """``frames`` RGB frames of a shape (a third of the short side) crossing the picture along ``step``."""
    width, height = size
    side = max(4, min(width, height) // 3)
    out = []
    for index in range(frames):
        share = index / max(frames - 1, 1)  # 0 -> 1 over the clip
        # Along the motion's axis the shape travels from one edge to the other; across it, it stays centred.
        x = (width - side) * (share if step[0] > 0 else 1 - share if step[0] < 0 else 0.5)
        y = (height - side) * (share if step[1] > 0 else 1 - share if step[1] < 0 else 0.5)
        image = Image.new("RGB", size, BACKGROUND_COLOURS[scene.background])
        box = (int(x), int(y), int(x) + side - 1, int(y) + side - 1)
        draw = ImageDraw.Draw(image)
        fill = SHAPE_COLOURS[scene.colour]
        if scene.shape == "square":
            draw.rectangle(box, fill=fill)
        elif scene.shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(box[0] + side // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
        out.append(image)
    return out


def _question_answer(scenes: list[_Scene], *, rgba_last: bool, rng: random.Random) -> tuple[str, str]:
    if len(scenes) == 2:
        a, b = scenes
        return (
            "What colours are the two shapes?",
            f"The first shape is {a.colour} and the second shape is {b.colour}.",
        )
    (s,) = scenes
    kinds = ["colour", "shape"]
    # An RGBA background is translucent, so its colour after flattening is not one of
    # the named ones: only ask about it for opaque images.
    if not rgba_last:
        kinds.append("background")
    kind = rng.choice(kinds)
    if kind == "colour":
        return f"What colour is the {s.shape}?", f"The {s.shape} is {s.colour}."
    if kind == "shape":
        return "What shape is in the picture?", f"It is a {s.colour} {s.shape}."
    return "What colour is the background?", f"The background is {s.background}."


def _draw(scene: _Scene, *, size: tuple[int, int], rgba: bool, rng: random.Random) -> Image.Image:
    width, height = size
    background = BACKGROUND_COLOURS[scene.background]
    if rgba:
        # Translucent background, opaque shape: exercises alpha flattening downstream.
        image = Image.new("RGBA", size, (*background, rng.randint(64, 192)))
    else:
        image = Image.new("RGB", size, background)
    # The shape covers 50-80% of the short side so it spans several 14 px patches.
    side = max(4, int(min(width, height) * rng.uniform(0.5, 0.8)))
    x0 = rng.randint(0, width - side)
    y0 = rng.randint(0, height - side)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    fill = SHAPE_COLOURS[scene.colour] + ((255,) if rgba else ())
    draw = ImageDraw.Draw(image)
    if scene.shape == "square":
        draw.rectangle(box, fill=fill)
    elif scene.shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([(x0 + side // 2, y0), (box[2], box[3]), (x0, box[3])], fill=fill)
    return image


def _png_roundtrip(image: Image.Image) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    decoded = Image.open(io.BytesIO(buffer.getvalue()))
    decoded.load()  # decode now, so a corrupt encode fails here and not in a data loader
    return decoded
