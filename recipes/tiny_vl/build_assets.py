"""Regenerate the tiny Qwen2.5-VL-style processor files in this folder.

Run from anywhere:  python recipes/tiny_vl/build_assets.py
Writes tokenizer.json, tokenizer_config.json, preprocessor_config.json and
chat_template.jinja next to this script. The output is deterministic: the BPE merges are learnt by a small pure-Python
loop over a fixed corpus (ties broken by symbol order), not by a trainer whose internal
hash maps could reorder equal-count merges. This script is not imported at runtime.
"""

from __future__ import annotations

import collections
import json
import pathlib

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HERE = pathlib.Path(__file__).resolve().parent

# 256 byte symbols + NUM_MERGES merges + 14 specials = 320 = 5 * 64, so the tiny preset's
# vocab_size needs no padding rows and every id the tokenizer can emit has an embedding.
NUM_MERGES = 50

# Same names and same relative order as Qwen2.5-VL (real ids 151643..151656), so code
# that looks tokens up by name behaves the same on the tiny and the real tokenizer.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Words the chat layout and the synthetic data use most, so the merges are useful.
# Changing this text changes the token ids of every merged symbol: keep it fixed.
CORPUS = (
    "system\nuser\nassistant\nYou are a helpful assistant.\n"
    "What colour is the square? The square is red. What colour is the circle? "
    "The circle is green. What colour is the triangle? The triangle is blue. "
    "What shape is in the picture? It is a yellow square. It is a purple circle. "
    "It is an orange triangle. What colour is the background? The background is white. "
    "The background is gray. The background is black. What colours are the two shapes? "
    "The first shape is red and the second shape is blue. Describe the image. "
    "the the the is is is a an and of in on to it this that with shape colour"
)

# Qwen2.5-VL's image processor defaults, except the pixel budget: 56*56 .. 140*140 keeps
# a synthetic image between 16 and 100 patches (4..25 merged tokens), not thousands.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 140 * 140
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen2.5-VL's chat template (Qwen/Qwen2.5-VL-7B-Instruct's chat_template.json, the same text
# as Qwen2-VL's; tests/data/chat_templates.json says where it was read), so the bundled
# processor takes the template path that downloaded Qwen2.5-VL folders take. Data, not code:
# it opens every conversation without a system message with "You are a helpful assistant.".
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def _learn_merges(words: collections.Counter[tuple[str, ...]], num_merges: int) -> list[tuple[str, str]]:
    """Classic BPE: repeatedly fuse the most frequent adjacent pair (ties: smallest pair)."""
    merges: list[tuple[str, str]] = []
    words = collections.Counter(words)
    for _ in range(num_merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        fused: collections.Counter[tuple[str, ...]] = collections.Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            fused[tuple(out)] += count
        words = fused
    return merges


def build_tokenizer() -> Tokenizer:
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # ids 0..255 are the byte-level symbols in byte order (alphabet() is unordered).
    byte_of = _byte_table()
    assert set(byte_of) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(sorted(byte_of, key=byte_of.__getitem__))}

    words: collections.Counter[tuple[str, ...]] = collections.Counter()
    for piece, _ in pre.pre_tokenize_str(CORPUS):
        words[tuple(piece)] += 1
    merges = _learn_merges(words, NUM_MERGES)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    # normalized=False: the specials must match the raw text, never a normalised form.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _byte_table() -> dict[str, int]:
    """Symbol -> byte for the byte-level alphabet: printable Latin-1 bytes stand for
    themselves, the other bytes map in order onto code points 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def tokenizer_config() -> dict:
    return {
        # The generic fast class loads tokenizer.json as-is; Qwen2Tokenizer in
        # transformers 5 would rebuild its own pre-tokenizer around our vocab.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "extra_special_tokens": list(SPECIAL_TOKENS[1:]),
        "padding_side": "right",
    }


def preprocessor_config() -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "resample": 3,  # bicubic, as Qwen2.5-VL
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "do_convert_rgb": True,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def render_assets() -> dict[str, str]:
    """File name -> exact file text; tests compare this with the shipped files."""
    tok = build_tokenizer()
    return {
        # Keep the library's key order (vocab by id) but our indentation and newline.
        "tokenizer.json": _json_text(json.loads(tok.to_str()), sort_keys=False),
        "tokenizer_config.json": _json_text(tokenizer_config()),
        "preprocessor_config.json": _json_text(preprocessor_config()),
        # The file transformers 5 saves a template in; AutoTokenizer and AutoProcessor read it.
        "chat_template.jinja": QWEN2_5_VL_CHAT_TEMPLATE,
    }


def _json_text(data: dict, *, sort_keys: bool = True) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n"


def main(out_dir: pathlib.Path = HERE) -> None:
    for name, text in render_assets().items():
        (out_dir / name).write_text(text, encoding="utf-8")
    tok = build_tokenizer()
    print(f"vocab size {tok.get_vocab_size(with_added_tokens=True)}")
    for t in SPECIAL_TOKENS:
        print(f"{t} = {tok.token_to_id(t)}")


if __name__ == "__main__":
    main()
