"""The compiled decoding step under whatever torch and transformers are on the path, on a CPU:
its graphs and graph breaks, and its log-probabilities against the eager step's.

The CPU's venv has torch 2.13; the GPU machine has torch 2.11 and transformers 5.17, whose
dynamo traces less (2026-12-01: ``torch.amp.is_autocast_available`` broke the step in every
layer there and not here). Put the device's versions first on the path to see what it sees,
without a lease (DEVELOPERS.md, "The device's torch on the CPU"):

    PYTHONPATH=/tmp/t211:/tmp/tf517 python3 benchmarks/decode/step_trace_check.py --kernel triton

The tiny Qwen2.5-VL with more layers (``--layers``), its decoder layers' children compiled as a
rule's ``compile = true`` does (the attention with them, as on the GPU), a static cache, a
random 300-token prompt, 12 greedy tokens eagerly and through the compiled step. ``--kernel
triton`` runs the static cache's Triton path with the operator's CPU kernel stood in by the
plain-torch split-KV attention (the trace is what is checked, not Triton's numerics).
"""

from __future__ import annotations

import argparse
import tomllib

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from weft.core.infer import decode
from weft.core.infer.decode_graph import decode_buffered
from weft.plugins.kv_cache import static as static_cache
from weft.strategies.attention.decode_split import split_decode_attention
from weft.strategies.memory.activation_checkpoint import MODES, apply_checkpointing
from weft.strategies.memory.compile_units import compile_unit


def tiny_model(*, preset: str, layers: int, dtype: torch.dtype, checkpoint: str) -> torch.nn.Module:
    with open(preset, "rb") as handle:
        fields = tomllib.load(handle)
    fields.pop("processor", None)
    fields["text_config"]["num_hidden_layers"] = layers
    fields["vision_config"]["depth"] = 1  # no image in the prompt: the tower is never run
    fields["vision_config"]["fullatt_block_indexes"] = [0]
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**fields)).eval().to(dtype)
    model.set_attn_implementation("sdpa")
    for layer in model.model.language_model.layers:
        apply_checkpointing(layer, mode=checkpoint)  # torch's order: recomputation, then compile
        compile_unit(layer, attention=True)
    return model


def decode_once(model, ids: torch.Tensor, *, kernel: str, compile: bool, new: int) -> tuple[list, list, dict]:
    torch._dynamo.reset()
    length = ids.shape[1]
    cache = static_cache.StaticCache(num_layers=model.config.text_config.num_hidden_layers)
    cache.kernel = kernel
    decode.text_attention(model, "sdpa")
    cache.reserve(length + new)
    cache.begin_prefill(keep=None, prompt=length)
    with torch.no_grad(), decode.layer_index_dynamic():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].double()
    cache.begin_decode()
    decode.text_attention(model, cache.decode_attention)
    token = int(logits.argmax())
    tokens, logprobs = [token], [float(torch.log_softmax(logits, -1)[0, token])]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        report = decode_buffered(model, cache=cache, tokens=tokens, logprobs=logprobs, row=length,
                                 rotary=torch.full((3, 1, 1), length, dtype=torch.long), max_new_tokens=new,
                                 stops=set(), device=torch.device("cpu"), show=None, capture=True, read_every=4,
                                 compile=compile)
    return tokens, logprobs, report


def stand_in_triton() -> None:
    """The Triton operator's CPU kernel: the torch split-KV attention (what the trace sees is
    the operator, whatever runs it)."""
    from weft.strategies.attention.kernels import decode_triton  # noqa: F401 - registers weft::triton_decode

    @torch.library.register_kernel("weft::triton_decode", "cpu")
    def _on_cpu(query, key, value, lengths, scale, splits, split_rows):
        return split_decode_attention(query, key, value, lengths=lengths, scale=scale, splits=4, return_lse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("split", "triton"), default="split")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--preset", default="recipes/presets/qwen2_5_vl_tiny.toml",
                        help="a preset's TOML (e.g. qwen2_5_vl_7b.toml with --layers 4: the 7B's widths)")
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    parser.add_argument("--checkpoint", choices=MODES, default="off",
                        help="a training rule's recomputation hooks on the layers (weft eval/generate attach none: "
                             "under torch 2.11 they break the step in every layer, 2026-12-01)")
    parser.add_argument("--reference", action="store_true",
                        help="also the eager step in float32 (the same weights): each path's distance from it")
    args = parser.parse_args()
    if args.kernel == "triton":
        stand_in_triton()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, kernel {args.kernel}")
    model = tiny_model(preset=args.preset, layers=args.layers, dtype=getattr(torch, args.dtype),
                       checkpoint=args.checkpoint)
    ids = torch.randint(0, 300, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    eager, eager_lp, _ = decode_once(model, ids, kernel=args.kernel, compile=False, new=args.new)
    fast, fast_lp, report = decode_once(model, ids, kernel=args.kernel, compile=True, new=args.new)
    print(f"graphs {report.get('step_graphs')}, graph breaks {report.get('step_graph_breaks')}"
          + (f" (first: {report['step_graph_break']})" if report.get("step_graph_break") else ""))
    print(f"tokens as eager: {fast == eager}; |log-probability difference| at each token: "
          + " ".join(f"{abs(a - b):.1e}" for a, b in zip(fast_lp, eager_lp)))
    if args.reference:
        torch._dynamo.reset()
        exact, exact_lp, _ = decode_once(model.float(), ids, kernel=args.kernel, compile=False, new=args.new)
        for name, (tokens, lps) in {"eager": (eager, eager_lp), "compiled": (fast, fast_lp)}.items():
            shared = next((i for i, (a, b) in enumerate(zip(tokens, exact)) if a != b), len(exact))
            print(f"{name} against float32 eager: tokens the same up to {shared}; |log-probability difference| "
                  + " ".join(f"{abs(a - b):.1e}" for a, b in zip(lps[:shared + 1], exact_lp[:shared + 1])))


if __name__ == "__main__":
    main()
