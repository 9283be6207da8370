"""Ask an exported SmolLM2 the held-out questions through transformers alone, and compare its
answers one by one with `weft eval --task`'s.

    weft export runs/smollm2-lora runs/smollm2-lora-hf --merge
    python examples/smollm2/answer_with_transformers.py runs/smollm2-lora-hf \
        examples/smollm2/data/held_out.jsonl --weft-results runs/smollm2-lora/held_out.results.jsonl

Nothing of weft is imported: the model and its tokenizer come from the exported directory
(``from_pretrained``, local files only, no remote code), each question goes through the
directory's own chat template (its default system prompt, the generation prompt), and the
answer is transformers' greedy ``generate`` until the template's ``<|im_end|>``. Prints the
exact-match accuracy and the number of answers that differ from weft's; exit 1 if any does
(or a question is missing from weft's results).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def ask(model, tokenizer, messages: list[dict], *, max_new_tokens: int) -> str:
    """The greedy reply to a conversation that ends with a user turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=pathlib.Path, help="a directory written by weft export (--merge for LoRA)")
    parser.add_argument("task", type=pathlib.Path, help="the held-out task file (make_data.py's held_out.jsonl)")
    parser.add_argument("--weft-results", type=pathlib.Path, required=True,
                        help="the per-question JSONL of `weft eval --task ... --results`")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="as weft eval's (default 32)")
    args = parser.parse_args(argv)

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, trust_remote_code=False,
                                                 local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=False, local_files_only=True)
    weft = {row["id"]: row for row in map(json.loads, args.weft_results.read_text().splitlines())}

    right = differ = 0
    lines = [json.loads(line) for line in args.task.read_text().splitlines() if line.strip()]
    for line in lines:
        messages = line["messages"]
        answer = ask(model, tokenizer, messages, max_new_tokens=args.max_new_tokens)
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
