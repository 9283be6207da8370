"""Plain transformers' `generate` at a long prompt: the anchor weft's decoding is compared with.

Qwen2.5-VL at a bundled preset's shapes (random init, bf16, SDPA), one prompt of TOKENS tokens
holding one HxW image, greedy decoding of NEW tokens with the library's default (dynamic)
cache or its static one. Prefill is timed as a one-token `generate`; decoding as the rest of a
NEW-token `generate`, per token. Prints one JSON object (the keys of `weft generate --json`
that apply). Usage on the GPU machine:
    python3 benchmarks/decode/hf_generate.py --preset qwen2_5_vl_7b --tokens 131072 --new 100
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForImageTextToText

from weft.core.recipe.presets import build_config, load_preset


def _prompt(*, config, tokens: int, height: int, width: int, device: str):
    """(1, tokens) ids with one image's placeholder tokens, its patches and grid."""
    vision = config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    grid = torch.tensor([[1, height // patch, width // patch]], device=device)
    patches = int(grid.prod())
    image_tokens = patches // merge**2
    ids = torch.randint(0, min(config.get_text_config().vocab_size, 150_000) - 8, (1, tokens), device=device)
    ids[0, 10] = config.vision_start_token_id
    ids[0, 11:11 + image_tokens] = config.image_token_id
    ids[0, 11 + image_tokens] = config.vision_end_token_id
    channels = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * patch * patch
    pixels = torch.randn(patches, channels, device=device, dtype=torch.bfloat16)
    return ids, pixels, grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2_5_vl_7b")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--new", type=int, default=100)
    parser.add_argument("--image", default="448x448", help="HxW of the prompt's one image")
    parser.add_argument("--cache", default="dynamic", choices=("dynamic", "static"))
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script with a tiny preset")
    args = parser.parse_args()
    model_type, kwargs, _ = load_preset(args.preset)
    config = build_config(model_type, kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).eval()
    height, width = (int(v) for v in args.image.split("x"))
    ids, pixels, grid = _prompt(config=config, tokens=args.tokens, height=height, width=width, device=args.device)
    # Greedy, exactly NEW tokens (random weights may choose an end token early), the library's
    # own cache: what a user of plain transformers gets.
    options = dict(do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation=args.cache)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def run(new: int) -> tuple[float, torch.Tensor]:
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, max_new_tokens=new,
                                 min_new_tokens=new, **options)
        sync()
        return time.perf_counter() - start, out[0, ids.shape[1]:]

    run(1)  # warm-up: kernels chosen and loaded outside the figures
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prefill_s, _ = run(1)
    total_s, tokens = run(args.new)
    decode_ms = 1e3 * (total_s - prefill_s) / max(args.new - 1, 1)
    print(json.dumps({
        "runner": "transformers.generate", "cache": args.cache, "preset": args.preset, "world_size": 1,
        "prompt_tokens": args.tokens, "prefill_s": prefill_s, "prefill_tokens_per_s": args.tokens / prefill_s,
        "decode_ms_per_token": decode_ms,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0,
        "tokens": tokens.tolist(), "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
