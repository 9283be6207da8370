"""Test fixture: a tiny Llama GGUF file, written with the ``gguf`` package's own ``GGUFWriter``.

``write_tiny_gguf(path, seed=0)`` writes (no download, no other model) a float32 GGUF of
architecture ``llama``: 2 blocks, hidden 64, 4 attention heads, 2 KV heads, head dim 16,
FFN 128, context 256, rope base 10000, rms eps 1e-5, tied embeddings (no ``output.weight``),
weights N(0, 0.02) from ``numpy.random.default_rng(seed)``, norms ones. Its metadata carries a
GPT-2-style byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``, like SmolLM2's GGUF):
the special tokens ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2), the 256
byte-level tokens, then the tokens of a few merges; bos 1, eos 2, pad 0; no BOS added on encode;
and a ChatML chat template. About 300 tokens, so the file is ~0.4 MB.

transformers reads it with ``from_pretrained(path.parent, gguf_file=path.name)`` (model and
tokenizer alike). Deterministic: the same seed gives the same bytes.
"""

from __future__ import annotations

import pathlib

import numpy as np

ARCH = "llama"
N_LAYERS = 2
HIDDEN = 64
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
CONTEXT = 256
ROPE_BASE = 10000.0
RMS_EPS = 1e-5
INIT_STD = 0.02

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# words whose left-to-right merges make up the merge table (leading space = GPT-2's "Ġ")
_MERGE_WORDS = ("hello", " world", " hello", "hi", " hi", "user", "assistant", "system", " the", " and")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (as ``transformers``' ``bytes_to_unicode``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _vocab_and_merges() -> tuple[list[str], list[str]]:
    """(tokens, merges): specials, the 256 byte-level tokens in byte order, then merge results."""
    spelling = _bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [spelling[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    for word in _MERGE_WORDS:
        pieces = [spelling[b] for b in word.encode("utf-8")]
        left = pieces[0]
        for right in pieces[1:]:
            merged = left + right
            if merged not in known:
                merges.append(f"{left} {right}")
                tokens.append(merged)
                known.add(merged)
            left = merged
    return tokens, merges


def _tensors(vocab_size: int, seed: int) -> list[tuple[str, np.ndarray]]:
    """GGUF-named float32 tensors, in torch (out, in) order; the writer reverses dims for ggml."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)).astype(np.float32)

    ones = np.ones(HIDDEN, dtype=np.float32)
    out = [("token_embd.weight", normal(vocab_size, HIDDEN))]
    for i in range(N_LAYERS):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", ones.copy()),
            (b + "attn_q.weight", normal(N_HEADS * HEAD_DIM, HIDDEN)),
            (b + "attn_k.weight", normal(N_KV_HEADS * HEAD_DIM, HIDDEN)),
            (b + "attn_v.weight", normal(N_KV_HEADS * HEAD_DIM, HIDDEN)),
            (b + "attn_output.weight", normal(HIDDEN, N_HEADS * HEAD_DIM)),
            (b + "ffn_norm.weight", ones.copy()),
            (b + "ffn_gate.weight", normal(FFN, HIDDEN)),
            (b + "ffn_up.weight", normal(FFN, HIDDEN)),
            (b + "ffn_down.weight", normal(HIDDEN, FFN)),
        ]
    out.append(("output_norm.weight", ones.copy()))  # no output.weight: tied embeddings
    return out


def write_tiny_gguf(path: pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write the tiny Llama GGUF (see the module docstring) to ``path``; return ``path``."""
    import gguf

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges = _vocab_and_merges()
    token_types = [int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS) \
        + [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(SPECIAL_TOKENS))

    writer = gguf.GGUFWriter(str(path), ARCH)  # adds general.architecture itself
    try:
        writer.add_name("weft-tiny-llama")
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        writer.add_context_length(CONTEXT)
        writer.add_embedding_length(HIDDEN)
        writer.add_block_count(N_LAYERS)
        writer.add_feed_forward_length(FFN)
        writer.add_head_count(N_HEADS)
        writer.add_head_count_kv(N_KV_HEADS)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_rope_freq_base(ROPE_BASE)
        writer.add_layer_norm_rms_eps(RMS_EPS)
        writer.add_vocab_size(len(tokens))

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")  # no split regex of its own in transformers: GPT-2's default
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_pad_token_id(PAD_ID)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

        for name, array in _tensors(len(tokens), seed):
            writer.add_tensor(name, array)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


if __name__ == "__main__":  # quick self-test: python tests/gguf_fixture.py
    import hashlib
    import tempfile
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        t0 = time.perf_counter()
        a = write_tiny_gguf(tmp / "a" / "tiny.gguf", seed=0)
        took = time.perf_counter() - t0
        b = write_tiny_gguf(tmp / "b" / "tiny.gguf", seed=0)
        c = write_tiny_gguf(tmp / "c" / "tiny.gguf", seed=1)
        digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
        assert digest(a) == digest(b) and digest(a) != digest(c)
        size = a.stat().st_size
        print(f"wrote {size} bytes in {took * 1000:.1f} ms; deterministic per seed")
        assert size < 1_000_000 and took < 1.0

        model = AutoModelForCausalLM.from_pretrained(a.parent, gguf_file=a.name, dtype=torch.float32)
        cfg = model.config
        assert type(model).__name__ == "LlamaForCausalLM", type(model)
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (2, 64, 4, 2, 16, 128, 256)
        assert cfg.tie_word_embeddings is True and "lm_head.weight" not in dict(model.named_parameters())
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
        assert theta == 10000.0, theta
        assert abs(cfg.rms_norm_eps - 1e-5) < 1e-12
        assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()

        tok = AutoTokenizer.from_pretrained(a.parent, gguf_file=a.name)
        ids = tok("hello world")["input_ids"]
        assert tok.decode(ids) == "hello world", (ids, tok.decode(ids))
        assert len(ids) == 2, ids  # "hello" + "Ġworld" from the merges
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(chat)
        assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
        assert tok("<|im_end|>")["input_ids"] == [EOS_ID]

        x = torch.tensor([tok(chat)["input_ids"]])
        with torch.no_grad():
            logits = model(x).logits
        assert logits.shape == (1, x.shape[1], len(tok)) and torch.isfinite(logits).all()

        # save the way weft does, and reload
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = tmp / "saved"
        model.save_pretrained(out)
        tok.save_pretrained(out)
        model2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        tok2 = AutoTokenizer.from_pretrained(out)
        with torch.no_grad():
            assert torch.equal(model2(x).logits, logits)
        assert tok2("hello world")["input_ids"] == ids and tok2.decode(ids) == "hello world"
        assert tok2.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=False) == chat
        print("files:", sorted(p.name for p in out.iterdir()))
        print("ok: model", type(model).__name__, "vocab", len(tok), "logits", tuple(logits.shape))
