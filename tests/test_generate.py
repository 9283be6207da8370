"""`weft generate`: greedy decoding of the tiny Qwen2.5-VL with an image equals transformers'
own `generate`, token for token and in each token's log-probability, on one process
(dynamic cache) and with the cache sharded over 2 and 4 gloo ranks after a ring, Ulysses
and USP prefill; each rank holds ~1/W of the cache; seeded sampling draws the same tokens
on any world size; the user's mistakes are exit-2 messages."""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from PIL import Image

from weft_cli import Done, run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny-vl.toml")
PROMPT = "What colour is this picture, and why?"
# Long enough (158 tokens with the chat template's default system prompt) that the video's
# tokens, at 36-43, straddle the first quarter of the sequence: ring 2's zigzag gives rank 0
# the first and last quarters, rank 1 the middle two, so both hold video rows.
VIDEO_PROMPT = (PROMPT + " Describe the colours, the shapes and how they move, frame by frame, in as much detail as "
                "you can, and be precise.")
NEW = 10


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("generate") / "red.png"
    buffer = io.BytesIO()
    Image.new("RGB", (84, 56), (200, 30, 30)).save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())
    return path


def weft(*args) -> Done:
    """In this process; the ranks a command starts are forked (tests/forked_ranks.py)."""
    return run_weft(*args)


def weft_process(*args) -> subprocess.CompletedProcess:
    """`python -m weft`: its ranks from torch's elastic agent, writing to the launcher's stdout."""
    return subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, timeout=600)


def generate(image: pathlib.Path, *extra: str) -> dict:
    done = weft("generate", RECIPE, "--prompt", PROMPT, "--image", str(image), "--max-new-tokens", str(NEW),
                "--json", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def expected(image) -> dict:
    """transformers' generate on the model as it ships, same weights, same prompt encoding."""
    from model_helpers import transformers_greedy

    found = transformers_greedy(RECIPE, prompt=PROMPT, image=str(image), new=NEW)
    model, inputs, tokens, logprobs = found["model"], found["inputs"], found["tokens"], found["logprobs"]
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    return {"tokens": tokens, "logprobs": logprobs, "prompt_tokens": inputs["input_ids"].shape[1],
            "image_tokens": image_tokens}


@pytest.fixture(scope="module")
def dynamic_recipe(tmp_path_factory) -> pathlib.Path:
    """tiny-vl with transformers' DynamicCache by rule (the default is the static cache)."""
    recipe = tmp_path_factory.mktemp("dynamic") / "dynamic.toml"
    text = pathlib.Path(RECIPE).read_text().replace('include = ["rules/', f'include = ["{ROOT}/recipes/rules/')
    recipe.write_text(text + '\n[[rules]]\nname = "dynamic cache"\nwhen = { modality = "text" }\n'
                      'kv_cache = { strategy = "dynamic" }\n')
    return recipe


@pytest.fixture(scope="module")
def single(image, dynamic_recipe) -> dict:
    """One process over transformers' DynamicCache: prompt + NEW - 1 rows, the bytes' yardstick."""
    done = weft("generate", str(dynamic_recipe), "--prompt", PROMPT, "--image", str(image), "--max-new-tokens",
                str(NEW), "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"], (got["tokens"], want["tokens"])
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), (got["logprobs"], want["logprobs"])


def test_one_process_equals_transformers_generate(image, single, expected, tmp_path):
    """The default cache on one process (the static one: `kv_cache = "auto"`) and
    transformers' DynamicCache by rule give transformers' tokens; ``--profile`` writes the
    decoding steps' operators by time (on the CPU their host time) and changes no token."""
    assert single["cache"] == "DynamicCache" and single["prompt_tokens"] == expected["prompt_tokens"]
    assert len(expected["tokens"]) == NEW  # no early end: every step compared
    _same(single, expected)
    default = generate(image, "--nproc", "1", "--profile", str(tmp_path / "profile"))
    assert default["cache"] == "StaticCache" and not default["step_compiled"]  # the CPU decodes eagerly
    _same(default, expected)
    # The one-time work is reported apart and the per-token figure is what is left of the wall time.
    steps = default["decode_ms_per_token"] * (NEW - 2) / 1e3  # the decoding steps after the first
    assert 0 < default["decode_setup_s"] < default["decode_wall_s"]
    assert default["decode_wall_s"] == pytest.approx(default["decode_setup_s"] + default["first_step_s"] + steps)
    profile = json.loads((tmp_path / "profile" / "decode_profile.json").read_text())
    layers = 2 * (NEW - 1)  # the tiny text model's 2 layers, each step: at least one product each
    assert profile["steps"] == NEW - 1 and profile["device"] == "cpu" and profile["ms_per_step"] > 0
    assert any("mm" in k["kernel"] and k["calls"] >= layers for k in profile["kernels"]), profile["kernels"][:5]
    assert "Self CPU" in (tmp_path / "profile" / "decode_profile.txt").read_text()


@pytest.mark.parametrize("world, mesh", [
    (2, ["--set", "parallel.ring=2", "--warmup"]),  # an untimed prefill first changes nothing
    (2, ["--set", "parallel.ulysses=2"]),
    (4, ["--set", "parallel.ring=2", "--set", "parallel.ulysses=2"]),
], ids=["ring2", "ulysses2", "usp2x2"])
def test_sharded_cache_equals_transformers_generate(image, expected, single, world, mesh):
    got = generate(image, "--nproc", str(world), *mesh)
    assert got["cache"] == "ShardedCache" and got["world_size"] == world
    _same(got, expected)
    # Each rank keeps ~1/W of the whole cache: its part of the prompt and every W-th new token.
    whole, shards = single["cache_bytes_per_rank"][0], got["cache_bytes_per_rank"]
    per_token = whole / (expected["prompt_tokens"] + NEW - 1)
    assert sum(shards) == pytest.approx(whole, abs=per_token * world)  # prompt pads are dropped
    assert max(shards) <= whole / world + 2 * per_token, shards


def paged_recipe(tmp_path) -> pathlib.Path:
    """tiny-vl with the paged cache, pages of 4 rows (the text buffer grows while decoding)."""
    recipe = tmp_path / "paged.toml"
    text = pathlib.Path(RECIPE).read_text().replace('include = ["rules/', f'include = ["{ROOT}/recipes/rules/')
    recipe.write_text(text + '\n[[rules]]\nname = "paged cache"\nwhen = { modality = "text" }\n'
                      'kv_cache = { strategy = "paged", page_tokens = 4 }\n')
    return recipe


def test_paged_cache_equals_transformers_generate(image, expected, single, tmp_path):
    """The modality-partitioned cache on one process gives transformers' tokens; its pool
    holds exactly the image's tokens (under ring 2: the video test below)."""
    done = weft("generate", str(paged_recipe(tmp_path)), "--prompt", PROMPT, "--image", str(image),
                "--max-new-tokens", str(NEW), "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["cache"] == "PagedCache"
    _same(got, expected)
    parts = got["cache_partitions_per_rank"]
    per_token = single["cache_bytes_per_rank"][0] / (expected["prompt_tokens"] + NEW - 1)
    whole = per_token * (expected["prompt_tokens"] + NEW - 1)
    assert sum(p["vision"] + p["text"] for p in parts) == pytest.approx(whole)
    assert sum(p["vision"] for p in parts) == per_token * expected["image_tokens"]
    assert all(p["text_capacity"] - p["text"] < 4 * per_token for p in parts)  # less than a page spare


def test_a_video_prompt_over_ring2_equals_transformers_generate(tmp_path):
    """`--video`: a 2-second clip sampled at the recipe's 2 fps (4 frames, 2 temporal
    patches) before the prompt; prefill under ring 2, the paged cache split over the two
    ranks (its vision pools hold the video's tokens), transformers' tokens on the same inputs."""
    from video_files import write_mp4
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    clip = write_mp4(tmp_path / "clip.mp4", frames=8, fps=4)
    recipe = Recipe.from_toml(RECIPE)
    family = plugin_manager_from_env().models.for_recipe(recipe)
    model = family.build(recipe, device="cpu", seed=recipe.train.seed).eval()
    inputs = family.prompt_inputs(recipe, text=VIDEO_PROMPT, images=[], videos=[str(clip)])
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]] and inputs["second_per_grid_ts"].tolist() == [1.0]
    video_at = (inputs["input_ids"][0] == model.config.video_token_id).nonzero().flatten()
    quarter = inputs["input_ids"].shape[1] / 4
    assert video_at[0] < quarter < video_at[-1]  # the premise of the last assertion below
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()
    done = weft("generate", str(paged_recipe(tmp_path)), "--prompt", VIDEO_PROMPT, "--video", str(clip),
                "--max-new-tokens", str(NEW), "--json", "--nproc", "2", "--set", "parallel.ring=2")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["tokens"] == want and got["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert got["cache"] == "PagedCache"
    parts = got["cache_partitions_per_rank"]
    per_token = sum(p["vision"] + p["text"] for p in parts) / (got["prompt_tokens"] + NEW - 1)
    video_tokens = int((inputs["input_ids"] == model.config.video_token_id).sum())
    assert sum(p["vision"] for p in parts) == per_token * video_tokens
    assert all(p["vision"] > 0 for p in parts)  # ring 2's zigzag halves both hold video rows
    # One process in chunks of 20 (a boundary at 40 inside the video's tokens): its pixels go with them.
    done = weft("generate", str(chunked_recipe(tmp_path, 20)), "--prompt", VIDEO_PROMPT, "--video", str(clip),
                "--max-new-tokens", str(NEW), "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    chunked = json.loads(done.stdout)
    assert chunked["tokens"] == want and chunked["prefill_chunks"] > 4, chunked["prefill_chunks"]


def test_a_hugging_face_directory_without_a_recipe(image, expected, tmp_path):
    """--model-dir: the same weights written as a Hugging Face directory (what `weft export`
    writes) generate what transformers' generate gives."""
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    recipe = Recipe.from_toml(RECIPE)
    family = plugin_manager_from_env().models.for_recipe(recipe)
    family.export(family.build(recipe, device="cpu", seed=recipe.train.seed), recipe, tmp_path / "hf")
    done = weft("generate", "--model-dir", str(tmp_path / "hf"), "--prompt", PROMPT, "--image", str(image),
                "--max-new-tokens", str(NEW), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    _same(json.loads(done.stdout), expected)


def test_terminal_streams_the_text(image, single):
    # Through the real launcher: rank 0's stream reaches the user's terminal through it.
    done = weft_process("generate", RECIPE, "--prompt", PROMPT, "--image", str(image), "--max-new-tokens", str(NEW),
                "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == single["text"] + "\n"  # printed token by token by rank 0, then a newline
    assert f"weft generate: {NEW} tokens after a " in done.stderr and "StaticCache MiB per rank" in done.stderr


def test_seeded_sampling_is_the_same_on_any_world_size(image, single):
    sampling = ["--temperature", "1.5", "--top-p", "0.9", "--seed", "7"]
    one = generate(image, "--nproc", "1", *sampling)
    two = generate(image, "--nproc", "2", "--set", "parallel.ring=2", *sampling)
    assert one["tokens"] == two["tokens"]
    assert one["tokens"] != single["tokens"] and len(set(one["tokens"])) > 1  # sampled, not greedy


def test_prompt_from_the_recipes_long_synthetic_data():
    """A tokenizer-free prompt (the recipe's first synthetic sample, with its image): the same
    tokens and log-probabilities with the cache sharded over a ring of 2 as on one process."""
    data = ["--prompt-from-data", "--set", "data.tokens=300", "--set", "data.images=[[56, 56]]",
            "--set", "train.micro_batch_tokens=300", "--max-new-tokens", "6", "--json"]
    runs = []
    for extra in (["--nproc", "1"], ["--nproc", "2", "--set", "parallel.ring=2"]):
        done = weft("generate", RECIPE, *data, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout))
    assert runs[0]["prompt_tokens"] == 300 and runs[1]["cache"] == "ShardedCache"
    _same(runs[1], runs[0])


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--top-p", "0"], "--top-p: --top-p takes a value in (0, 1], got 0"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: --max-new-tokens must be at least 1"),
    (["--prompt", "hi", "--image", "missing.png"], "--image: no such file: missing.png"),
    (["--prompt", "hi", "--profile", RECIPE], "--profile: --profile names a folder to write decode_profile.json"),
    (["--prompt-from-data", "--nproc", "2"], "--prompt-from-data: --prompt-from-data gives every rank one prompt"),
    (["--prompt", "hi", "--model-dir", "."], "--model-dir: give a recipe or --model-dir, not both"),
    # Found by the rank, inside the data's prefetching: its exit code is the command's, and the
    # rank ends cleanly (the prefetch thread stopped, not torn down at interpreter exit).
    (["--prompt-from-data", "2", "--nproc", "1", "--set", "data.tokens=48"],
     "--prompt-from-data: the data's micro-batches hold"),
])
def test_mistakes_are_messages(args, message):
    done = weft("generate", RECIPE, *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]


def test_static_cache_equals_transformers_generate(image, expected, single, tmp_path):
    """The preallocated cache (rows written in place, the rows past the position masked) gives
    transformers' tokens; it holds the prompt plus every new token from the prefill on."""
    recipe = tmp_path / "static.toml"
    text = pathlib.Path(RECIPE).read_text().replace('include = ["rules/', f'include = ["{ROOT}/recipes/rules/')
    recipe.write_text(text + '\n[[rules]]\nname = "static cache"\nwhen = { modality = "text" }\n'
                      'kv_cache = { strategy = "static" }\n')
    done = weft("generate", str(recipe), "--prompt", PROMPT, "--image", str(image), "--max-new-tokens", str(NEW),
                "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["cache"] == "StaticCache"
    _same(got, expected)
    whole = single["cache_bytes_per_rank"][0]  # the dynamic cache: prompt + NEW - 1 rows
    per_token = whole / (expected["prompt_tokens"] + NEW - 1)
    assert got["cache_bytes_per_rank"][0] == pytest.approx(per_token * (expected["prompt_tokens"] + NEW), rel=1e-9)
    # Sampling through the same buffered step (the draws on the device): seeded, so a second run
    # gives the same tokens; not the greedy ones.
    sampled = [json.loads(weft("generate", str(recipe), "--prompt", PROMPT, "--image", str(image), "--max-new-tokens",
                               str(NEW), "--temperature", "1.5", "--seed", "4", "--json", "--nproc", "1").stdout)
               for _ in range(2)]
    assert sampled[0]["tokens"] == sampled[1]["tokens"] != got["tokens"] and len(sampled[0]["tokens"]) == NEW
    done = weft("generate", str(recipe), "--prompt", PROMPT, "--image", str(image), "--max-new-tokens", "2",
                "--nproc", "2", "--set", "parallel.ring=2")
    assert done.returncode == 2 and "the static cache keeps the whole sequence" in " ".join(done.stderr.split())


@pytest.mark.quick
def test_greedy_decoding_on_the_device_stops_at_the_first_stop_token_of_a_read_back():
    """Tokens come back every READ_EVERY steps; a stop token inside a read-back ends the
    answer there (the steps computed after it are dropped), with each token's log-probability."""
    import types

    import torch.distributed as dist

    from weft.core.infer import decode as gen

    script = [5, 6, 7, 9, 8, 8, 8, 8]  # the model's argmax after each input; 9 is a stop

    class Scripted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, *, input_ids, cache_position, **kwargs):
            assert cache_position.item() == 11 + self.calls  # the device counter follows the positions
            logits = torch.full((1, 1, 12), -4.0)
            logits[0, 0, script[self.calls]] = 4.0
            self.calls += 1
            return types.SimpleNamespace(logits=logits)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, tokens, logprobs, shown = Scripted(), [4], [-0.1], []
        old, gen.READ_EVERY = gen.READ_EVERY, 3
        try:
            gen.decode_greedy(model, cache=None, tokens=tokens, logprobs=logprobs, length=11, max_new_tokens=8,
                               stops={9}, device=torch.device("cpu"), show=shown.append)
        finally:
            gen.READ_EVERY = old
    finally:
        dist.destroy_process_group()
    assert tokens == [4, 5, 6, 7, 9] and shown == [5, 6, 7, 9]
    assert model.calls == 6  # two read-backs of 3 steps: the stop came in the second
    want = float(torch.log_softmax(torch.tensor([4.0] + [-4.0] * 11, dtype=torch.float64), dim=0)[0])
    assert logprobs[1:] == pytest.approx([want] * 4)


def test_prompts_decoded_together_get_the_answers_each_gets_alone(image, expected, tmp_path):
    """--prompt-file: prompts of different lengths (one with the image) prefilled one by one into
    the rows of one static cache and decoded together: each row's tokens and log-probabilities
    are the ones its prompt gets alone."""
    shutil_copy = __import__("shutil").copy
    shutil_copy(image, tmp_path / "red.png")
    lines = [{"prompt": PROMPT, "images": ["red.png"]}, {"prompt": "Say something short."},
             {"prompt": VIDEO_PROMPT}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = weft("generate", RECIPE, "--prompt-file", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", str(NEW),
                "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["cache"] == "StaticCache" and len(got["answers"]) == 3 and len(set(got["prompt_tokens"])) == 3
    _same(got["answers"][0], expected)
    for line, answer in zip(lines[1:], got["answers"][1:]):
        alone = weft("generate", RECIPE, "--prompt", line["prompt"], "--max-new-tokens", str(NEW), "--json",
                     "--nproc", "1")
        assert alone.returncode == 0, alone.stderr[-3000:]
        _same(answer, json.loads(alone.stdout))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    done = weft("generate", RECIPE, "--prompt-file", str(tmp_path / "bad.jsonl"))
    assert done.returncode == 2 and "bad.jsonl:2" in done.stderr and '"prompt": a string' in done.stderr


def test_the_datas_first_prompts_decoded_together():
    """--prompt-from-data N: the data's first N samples as rows of one batch; the first row's
    answer is what --prompt-from-data gives it alone, and a row's answer does not depend on
    how many rows decode beside it (nor on an untimed first prefill, --warmup)."""
    args = ("--set", "data.tokens=48", "--set", "train.micro_batch_tokens=48", "--max-new-tokens", "6", "--json",
            "--nproc", "1")
    alone = weft("generate", RECIPE, "--prompt-from-data", *args)
    assert alone.returncode == 0, alone.stderr[-3000:]
    answers = {}
    for count, extra in ((2, ()), (3, ("--warmup",))):
        done = weft("generate", RECIPE, "--prompt-from-data", str(count), *args, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        answers[count] = json.loads(done.stdout)["answers"]
    _same(answers[2][0], json.loads(alone.stdout))
    assert [a["tokens"] for a in answers[2]] == [a["tokens"] for a in answers[3][:2]]


def test_prompts_decoded_together_can_sample():
    """A batch samples on the device (its first tokens too), from a generator the seed seeds:
    the same seed gives the same answers; they are not the greedy ones."""
    args = ("--prompt-from-data", "2", "--set", "data.tokens=48", "--set", "train.micro_batch_tokens=48",
            "--max-new-tokens", "6", "--json", "--nproc", "1")
    greedy = json.loads(weft("generate", RECIPE, *args).stdout)["answers"]
    runs = []
    for _ in range(2):
        done = weft("generate", RECIPE, *args, "--temperature", "1.5", "--seed", "4")
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append([a["tokens"] for a in json.loads(done.stdout)["answers"]])
    assert runs[0] == runs[1] != [a["tokens"] for a in greedy] and all(len(t) == 6 for t in runs[0])


def chunked_recipe(tmp_path, tokens: int) -> pathlib.Path:
    """tiny-vl whose prompts are prefilled in chunks of ``tokens`` (the static cache)."""
    recipe = tmp_path / "chunked.toml"
    text = pathlib.Path(RECIPE).read_text().replace('include = ["rules/', f'include = ["{ROOT}/recipes/rules/')
    recipe.write_text(text + '\n[[rules]]\nname = "chunked prefill"\nwhen = { modality = "text" }\n'
                      f'kv_cache = {{ strategy = "static", prefill_chunk_tokens = {tokens} }}\n')
    return recipe


def test_a_prompt_prefilled_in_chunks_gives_transformers_tokens(image, expected, tmp_path):
    """Chunks of 20 tokens: a boundary (at 40) would fall inside the image's tokens (36-41) and
    moves to its start; one prompt, and a batch of two (each row in chunks), the long text
    prompt's answer as its whole prefill gives it."""
    recipe = chunked_recipe(tmp_path, 20)
    done = weft("generate", str(recipe), "--prompt", PROMPT, "--image", str(image), "--max-new-tokens", str(NEW),
                "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["cache"] == "StaticCache" and got["prefill_chunks"] == 4, got  # 76 tokens: 0-20-36-56-76
    _same(got, expected)
    __import__("shutil").copy(image, tmp_path / "red.png")
    lines = [{"prompt": PROMPT, "images": ["red.png"]}, {"prompt": VIDEO_PROMPT}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = weft("generate", str(recipe), "--prompt-file", str(tmp_path / "prompts.jsonl"), "--max-new-tokens",
                str(NEW), "--json", "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    batch = json.loads(done.stdout)
    answers = batch["answers"]
    assert batch["prefill_chunks"][0] == 4 and batch["prefill_chunks"][1] > 4, batch["prefill_chunks"]
    _same(answers[0], expected)
    whole = weft("generate", RECIPE, "--prompt", VIDEO_PROMPT, "--max-new-tokens", str(NEW), "--json", "--nproc", "1")
    assert whole.returncode == 0, whole.stderr[-3000:]
    _same(answers[1], json.loads(whole.stdout))


def test_projections_fused_by_default_where_the_model_is_not_sharded(image, tmp_path):
    """`weft generate` on one unsharded process fuses each layer's q/k/v and gate/up (the tiny
    model: 2 text layers x 2 groups, 2 vision MLPs) and decodes what `--no-fused-projections`
    decodes; under FSDP2 (tiny-vl's own rules) nothing is fused. Both say the bytes a step reads."""
    recipe = tmp_path / "unsharded.toml"
    recipe.write_text(pathlib.Path(RECIPE).read_text().replace('include = ["rules/modality-groups.toml"]\n', "")
                      + '\n[[rules]]\nname = "no sharding"\nshard = { strategy = "none" }\n')
    runs = {}
    for flag in ((), ("--no-fused-projections",)):
        done = weft("generate", str(recipe), "--prompt", PROMPT, "--image", str(image), "--max-new-tokens",
                    str(NEW), "--json", "--nproc", "1", *flag)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[flag] = json.loads(done.stdout)
    fused, plain = runs[()], runs[("--no-fused-projections",)]
    assert fused["fused_projection_groups"] == 6 and plain["fused_projection_groups"] == 0
    assert fused["tokens"] == plain["tokens"] and fused["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-6)
    assert fused["weight_bytes_per_rank"] == plain["weight_bytes_per_rank"] > 0
    sharded = generate(image, "--nproc", "1")
    assert sharded["fused_projection_groups"] == 0
