"""`weft generate RECIPE --prompt TEXT [--image PATH]...`: greedy or sampled decoding under
the recipe's plan. The options are checked here, before any rank starts; the ranks run the
decoding engine (core/infer/generate.py)."""

from __future__ import annotations

import pathlib

from weft.core.errors import WeftError
from weft.core.recipe import Recipe


def run_generate(*, nproc: int, args: list[str]) -> dict:
    """Start ``nproc`` ranks of the hidden ``_generate-worker`` command; rank 0's result."""
    from weft.core.run.rank_job import launch_job

    return launch_job("generate", nproc=nproc, args=args)


def worker(recipe: Recipe, *, out: pathlib.Path, **options) -> None:
    from weft.core.infer.generate import generate_on_rank
    from weft.core.run.rank_job import run_on_rank

    run_on_rank(recipe, out=out, job=generate_on_rank, **options)


def check_options(*, max_new_tokens: int, temperature: float, top_p: float,
                  profile: pathlib.Path | None = None) -> None:
    if profile is not None and profile.exists() and not profile.is_dir():
        raise WeftError(f"--profile names a folder to write decode_profile.json into; {profile} is a file",
                        where="--profile")
    if max_new_tokens < 1:
        raise WeftError(f"--max-new-tokens must be at least 1, got {max_new_tokens}", where="--max-new-tokens")
    if temperature < 0:
        raise WeftError(f"--temperature must be 0 (greedy) or above, got {temperature:g}", where="--temperature")
    if not 0 < top_p <= 1:
        raise WeftError(f"--top-p takes a value in (0, 1], got {top_p:g}", where="--top-p")
