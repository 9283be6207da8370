"""The `weft` command line in one place: every command, its arguments and their help. Each
command's handler (``args -> exit code``) is given by core/commands/main.py, which imports
this file and the commands: this one imports none of them."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any, Callable, Mapping

#: A command's function: the parsed arguments in, the exit code out.
Handler = Callable[[argparse.Namespace], int]


def build_parser(*, handlers: Mapping[str, Handler]) -> argparse.ArgumentParser:
    """``weft``'s parser; ``handlers``: each command's function (its name -> ``args -> exit code``)."""
    parser = argparse.ArgumentParser(prog="weft",
                                     description="Plugin-based parallelism for long-sequence VLM training.")
    # Given by weft's own launcher to the ranks it starts (core/run/launch.py): they die with it.
    parser.add_argument("--launcher-pid", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train a recipe on N local ranks (or under torchrun)")
    run.add_argument("recipe", help="recipe TOML file")
    run.add_argument("--nproc", type=_positive, default=None,
                     help="local ranks to start (default: parallel.nproc of the recipe)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe key, e.g. train.max_steps=10")
    run.add_argument("--run-dir", type=pathlib.Path, default=None,
                     help="run directory (default runs/<recipe>-<timestamp>)")
    run.add_argument("--locked", action="store_true", help=argparse.SUPPRESS)  # set by weft's own launcher
    run.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="restart the ranks up to N times after one dies; they resume from the newest checkpoint")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest checkpoint of --run-dir (default: the newest run of this recipe)")
    run.add_argument("--overwrite", action="store_true",
                     help="start over in a --run-dir that holds a run: its files are moved to a folder beside it first")
    run.set_defaults(func=handlers["run"])

    plan = sub.add_parser("plan", help="show which strategy each module gets, without weights or processes")
    plan.add_argument("recipe")
    plan.add_argument("--world-size", type=_positive, default=None, help="ranks to plan for (default: parallel.nproc)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--explain", action="store_true", help="add the deciding rule's file:line")
    plan.add_argument("--json", action="store_true", help="print the Plan as JSON")
    plan.add_argument("--estimate", action="store_true",
                      help="per-rank GPU memory, host memory and step time predicted, the longest length that fits")
    plan.add_argument("--gpu", choices=("h200", "h100", "a100-80g"), default="h200",
                      help="with --estimate: the GPU kind (default h200)")
    plan.add_argument("--host-gib", type=float, default=None,
                      help="with --estimate: one host's memory (default 128 GiB per GPU, up to 8 GPUs)")
    plan.add_argument("--positions", action="store_true",
                      help="read the recipe's data: the largest position id per sample (mRoPE-aware) "
                           "and the YaRN factor it needs")
    plan.set_defaults(func=handlers["plan"])

    check = sub.add_parser("check", help="one batch: unsharded model vs the recipe's plan on N ranks (loss, gradients)")
    check.add_argument("recipe")
    check.add_argument("--world-size", type=_positive, default=None,
                       help="ranks for the plan (default: parallel.nproc)")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--json", action="store_true", help="print the comparison as JSON")
    check.set_defaults(func=handlers["check"])

    worker = sub.add_parser("_check-worker", help=argparse.SUPPRESS)
    worker.add_argument("recipe")
    worker.add_argument("--out", type=pathlib.Path, required=True)
    worker.add_argument("--set", dest="overrides", action="append", default=[])
    worker.set_defaults(func=handlers["_check-worker"])

    _inference_commands(sub, handlers=handlers)

    export = sub.add_parser("export", help="write a run's newest checkpoint as a Hugging Face model directory")
    export.add_argument("run_dir", type=pathlib.Path)
    export.add_argument("out_dir", type=pathlib.Path)
    export.add_argument("--step", type=_positive, default=None,
                        help="export this step's checkpoint instead of the newest")
    export.add_argument("--merge", action="store_true",
                        help="a run with adapters: fold them into the base's weights and write a plain model "
                             "(default: the adapters' own directory, PEFT's adapter_config.json and "
                             "adapter_model.safetensors)")
    export.add_argument("--overwrite", action="store_true",
                        help="OUT_DIR holds files: replace them whole (the export is written beside it and swapped in; "
                             "default: refused)")
    export.set_defaults(func=handlers["export"])

    plugins = sub.add_parser("plugins", help="hook points, plugins and their strategies")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=handlers["plugins"])
    return parser


def _inference_commands(sub: Any, *, handlers: Mapping[str, Handler]) -> None:
    """eval, generate, report and the hidden rank commands of eval and generate."""
    evaluate = sub.add_parser("eval", help="a dataset's loss and perplexity under the recipe's plan, forward only")
    evaluate.add_argument("recipe", nargs="?", help="recipe TOML file (or --model-dir)")
    evaluate.add_argument("--data", type=pathlib.Path, default=None,
                          help="JSONL chat file to evaluate (default: the recipe's own data)")
    _common(evaluate)
    evaluate.add_argument("--max-batches", type=_positive, default=None, help="stop after N rounds of micro-batches")
    evaluate.add_argument("--task", type=pathlib.Path, default=None, metavar="FILE.jsonl",
                          help="accuracy on questions with right answers (choices by log-likelihood, else greedy "
                               "generation and exact match; docs/inference.md) in place of the loss")
    evaluate.add_argument("--results", type=pathlib.Path, default=None, metavar="FILE.jsonl",
                          help="with --task: one line per question (default: TASK-STEM.results.jsonl here)")
    evaluate.add_argument("--max-new-tokens", type=_positive, default=32,
                          help="with --task: the longest generated answer")
    evaluate.add_argument("--forced", action="store_true",
                          help="with --task: score each generation question in one teacher-forced pass under the "
                               "plan (right exactly when greedy decoding's reply is the answer; always so on 2+ "
                               "ranks)")
    evaluate.add_argument("--reference", type=pathlib.Path, default=None, metavar="OUT.jsonl",
                          help="write the data's preference pairs with the model's summed log-probabilities of each "
                               "response (ref_chosen_logps, ref_rejected_logps): the reference of DPO's "
                               "reference = \"batch\" (docs/preference.md)")
    evaluate.set_defaults(func=handlers["eval"])

    generate = sub.add_parser("generate", help="decode from a prompt (and images) under the recipe's plan")
    generate.add_argument("recipe", nargs="?", help="recipe TOML file (or --model-dir)")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the user's turn")
    source.add_argument("--prompt-file", type=pathlib.Path, default=None, metavar="FILE.jsonl",
                        help="several prompts decoded together (greedy, one process): one JSON object a line, "
                             "{\"prompt\": TEXT, \"images\": [PATH...], \"videos\": [PATH...]}, paths relative to "
                             "the file")
    source.add_argument("--prompt-from-data", nargs="?", type=_positive, const=1, default=None, metavar="N",
                        help="the first sample of the recipe's data as the prompt (e.g. long synthetic: data.tokens); "
                             "with N, its first N samples decoded together (greedy, one process)")
    generate.add_argument("--image", dest="images", action="append", default=[], type=pathlib.Path,
                          metavar="PATH", help="an image before the prompt (repeatable)")
    generate.add_argument("--video", dest="videos", action="append", default=[], type=pathlib.Path,
                          metavar="PATH", help="a video file after the images, sampled at data.video_fps (repeatable)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    generate.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    generate.add_argument("--warmup", action="store_true",
                          help="one untimed prefill first (compiled modules compile there): benchmarks")
    generate.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                          help="the static cache's greedy steps eagerly, not replayed as a captured CUDA graph")
    generate.add_argument("--no-fused-projections", dest="fused_projections", action="store_false",
                          help="each layer's query/key/value and gate/up projections as separate products, not "
                               "one over their weights in one storage (docs/inference.md)")
    generate.add_argument("--profile", type=pathlib.Path, metavar="DIR", help="the decoding steps' kernels by device "
                          "time into DIR (decode_profile.json/.txt; torch.profiler)")
    _common(generate)
    generate.set_defaults(func=handlers["generate"])

    report = sub.add_parser("report", help="a run's curves (loss, tokens/s, MFU, memory, grad norm, lr) and summary")
    report.add_argument("run_dirs", nargs="*", type=pathlib.Path, metavar="RUN_DIR")
    report.add_argument("--heatmap", type=pathlib.Path, action="append", default=[], metavar="RESULTS.jsonl",
                        help="in place of run directories: accuracy by the questions' meta.depth x meta.length "
                             "from `weft eval --task --results` files, a panel each")
    report.add_argument("--out", type=pathlib.Path, default=None,
                        help="FILE.png or FILE.html (default: report.png in the first run directory; with "
                             "--heatmap: the first results file's name as .png)")
    report.set_defaults(func=handlers["report"])

    for name in ("_eval-worker", "_generate-worker"):
        worker = sub.add_parser(name, help=argparse.SUPPRESS)
        worker.add_argument("recipe")
        worker.add_argument("--out", type=pathlib.Path, required=True)
        worker.add_argument("--set", dest="overrides", action="append", default=[])
        worker.add_argument("--run-dir", type=pathlib.Path, default=None)
        worker.add_argument("--step", type=int, default=None)
        worker.add_argument("--options", default="{}", help="the command's own options, as JSON")
        worker.set_defaults(func=handlers[name])


def _common(parser: Any) -> None:
    """The arguments eval and generate share: where the model and its weights come from, the ranks."""
    parser.add_argument("--model-dir", type=pathlib.Path, default=None,
                        help="a Hugging Face model directory (e.g. from `weft export`), a Hub id in the local "
                             "Hugging Face cache or a .gguf file, instead of a recipe: one rank, float32, the default "
                             "rules")
    parser.add_argument("--nproc", type=_positive, default=None, help="ranks (default: parallel.nproc)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--run-dir", type=pathlib.Path, default=None,
                        help="weights from this weft run's newest checkpoint (default: the recipe's initial ones)")
    parser.add_argument("--step", type=_positive, default=None, help="with --run-dir: this step's checkpoint")
    parser.add_argument("--adapter", type=pathlib.Path, default=None, metavar="DIR",
                        help="a PEFT adapter directory (adapter_config.json, adapter_model.safetensors; `weft export` "
                             "of a LoRA run writes one) applied over the recipe's model, instead of its adapter rules")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
