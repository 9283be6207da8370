"""Plain transformers on examples/long's passkey training lines: does a model of the passkey
preset's text shape (4 layers of 128, rotary base 10,000) leave the plateau where the key's
digits are at chance? The same question `weft run examples/long/passkey.toml` asks, without weft:
weft's encoding of the lines (labels on the replies), a Qwen2ForCausalLM, AdamW, nothing else.

    python benchmarks/learning/passkey_probe.py DATA/train.jsonl [--lr 3e-3] [--batch 8] [--steps 1500]
        [--passkey-only]

Prints the mean loss over the replies every 50 steps. A reply is "The pass key is NNNNN." (23
tokens): ~0.6 is every token right but the five digits at chance (5 ln 10 / 23 = 0.50, plus the
rest); a model that finds the key falls towards 0.1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from weft.strategies.data.conversation import encode_conversation, load_processor
from weft.strategies.data.formats import record_to_messages

DIGITS = (48, 57)  # the tiny tokenizer's '0'..'9'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train", type=pathlib.Path)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lines", type=int, default=6000)
    parser.add_argument("--passkey-only", action="store_true")
    args = parser.parse_args()
    tokenizer, image_processor = load_processor("tiny_vl")
    samples = []
    for line in args.train.read_text().splitlines()[: args.lines]:
        record = json.loads(line)
        if args.passkey_only and record["meta"]["task"] != "passkey":
            continue
        sample = encode_conversation(record_to_messages(record, base=args.train.parent), tokenizer=tokenizer,
                                     image_processor=image_processor)
        samples.append((sample.input_ids, sample.labels))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, start = random.Random(0), time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = rng.sample(samples, args.batch)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((args.batch, width), 306)  # (B, S) <|endoftext|> after each line
        labels = torch.full((args.batch, width), -100)
        mask = torch.zeros(args.batch, width, dtype=torch.long)
        for row, (line_ids, line_labels) in enumerate(batch):
            ids[row, : len(line_ids)], labels[row, : len(line_ids)], mask[row, : len(line_ids)] = \
                line_ids, line_labels, 1
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 20)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        loss = out.loss
        # The key's digits among the labels: chance is 10%; a model that copies what it was told
        # gets the said-again ones (the reply's, a text line's recalls) right.
        wanted = labels[:, 1:]
        digits = (wanted >= DIGITS[0]) & (wanted <= DIGITS[1])
        right = (out.logits[:, :-1].argmax(-1) == wanted) & digits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4),
                              "digits_right": round(right.sum().item() / max(1, digits.sum().item()), 3),
                              "s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
