"""Ask the exported digits model the held-out questions through transformers alone, and
compare its answers one by one with `weft eval --task`'s.

    weft export runs/digits runs/digits-hf
    python examples/digits/answer_with_transformers.py runs/digits-hf \
        examples/digits/data/held_out.jsonl --weft-results runs/digits.results.jsonl

Nothing of weft is imported: the model and its processor come from the exported
directory (`from_pretrained`), each question goes through the exported chat
template with its image, and the answer is transformers' greedy `generate`. So it shows
that what weft trained, saved and scored is a plain transformers model that answers the
same. Prints the accuracy and the number of answers that differ from weft's; exit 1 if
any does (or a question is missing from weft's results).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer


def ask(model, tokenizer, image_processor, *, question: str, image: Image.Image, max_new_tokens: int) -> str:
    """The greedy reply to one user turn holding one image.

    What Qwen2.5-VL's processor does, from its two halves: AutoProcessor would also build
    the video processor, which needs torchvision (not installed with weft's CPU torch).
    The chat template renders one <|image_pad|>; the processor repeats it once per merged
    patch (grid t x h x w / merge_size^2), and so does this.
    """
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = image_processor(images=[image], return_tensors="pt")
    pads = int(pixels["image_grid_thw"][0].prod()) // image_processor.merge_size ** 2
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * pads)
    inputs = dict(tokenizer([prompt], return_tensors="pt"), **pixels)
    # Which tokens are an image's, as the processor marks them (1 = image): without it transformers
    # (5.2x) gives the image plain 1-D positions instead of its mRoPE grid, silently, and 4 of the
    # 359 answers change.
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token).int()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=pathlib.Path, help="a directory written by weft export")
    parser.add_argument("task", type=pathlib.Path, help="the held-out task file (make_digits.py's held_out.jsonl)")
    parser.add_argument("--weft-results", type=pathlib.Path, required=True,
                        help="the per-question JSONL of `weft eval --task ... --results`")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    args = parser.parse_args(argv)

    # Local files only, and the directory's own code never runs: the export is plain data.
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, dtype=torch.float32, trust_remote_code=False,
                                                        local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=False, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(args.model_dir, backend="pil", local_files_only=True)
    weft = {row["id"]: row for row in map(json.loads, args.weft_results.read_text().splitlines())}

    right = differ = 0
    lines = [json.loads(line) for line in args.task.read_text().splitlines() if line.strip()]
    for line in lines:
        user = line["messages"][0]["content"]
        image = Image.open(args.task.parent / line["images"][0]).convert("RGB")
        answer = ask(model, tokenizer, image_processor, question=user.replace("<image>", ""), image=image,
                     max_new_tokens=args.max_new_tokens)
        right += answer.strip() == line["answer"]
        theirs = weft.get(line["id"], {}).get("prediction")
        if theirs is None or theirs.strip() != answer.strip():
            differ += 1
            print(f"{line['id']}: transformers says {answer!r}, weft eval said {theirs!r}", file=sys.stderr)
    print(json.dumps({"questions": len(lines), "right": right, "accuracy": round(right / len(lines), 4),
                      "answers_differing_from_weft": differ}))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
