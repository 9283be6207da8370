"""`weft plan --estimate`: the arithmetic against hand-computed sizes (tiny and 7B presets), the
model against the measured 7B runs on one H200 (BENCHMARKS.md), and the command's answers."""

from __future__ import annotations

import json
import pathlib
import textwrap

import attrs
import pytest

from weft.core.plan.estimate import GIB, Setup, Shape, Unit, layer_saved, longest_fit, memory
from weft.core.plan.gpus import GPUS
from weft.core.plan.step_time import step_seconds

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _plan(recipe_path, world_size=1):
    from weft.core.plan.estimate_inputs import setup_of, shape_of, units_of
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    recipe = Recipe.from_toml(str(recipe_path))
    plan, model = plan_recipe(recipe, pm=plugin_manager_from_env(), world_size=world_size)
    units = units_of(plan, model)
    return units, shape_of(model, units), setup_of(recipe, plan)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.quick
def test_tiny_parameters_and_static_memory_by_hand(tmp_path):
    """qwen2_text_tiny: V 320, hidden 64, intermediate 128, 2 layers, 4 heads over 2 KV heads of
    16. A layer: q 64x64+64, k and v 64x32+32 each, o 64x64, MLP 3x64x128, 2 norms of 64 =
    37,120; the model: 2 embeddings of 320x64, 2 layers, a final norm = 115,264."""
    recipe = _write(tmp_path, "tiny.toml", """
        [model]
        preset = "qwen2_text_tiny"
        [[rules]]
        when = { path = "model.layers.*" }
        shard = { strategy = "fsdp2", storage_dtype = "bfloat16" }
        [[rules]]
        shard = { strategy = "fsdp2" }
    """)
    units, shape, setup = _plan(recipe, world_size=2)
    assert sum(u.params for u in units) == 115_264
    assert [u.params for u in units if u.modality == "text"] == [37_120, 37_120]
    assert shape.layer_params == 37_120 and (shape.hidden, shape.intermediate, shape.vocab) == (64, 128, 320)
    mem = memory(units, shape, setup)
    # bf16 layers, float32 rest, both sharded over 2 ranks: weights = gradients, AdamW twice.
    want = (2 * 37_120 * 2 + (115_264 - 2 * 37_120) * 4) / 2
    assert mem["weights"] == mem["gradients"] == want and mem["optimizer"] == 2 * want


@pytest.mark.quick
def test_7b_sizes_by_hand():
    """Qwen2.5-VL-7B's decoder layer at 128K tokens: its input is 131,072 x 3,584 x 2 bytes
    (0.875 GiB); 'full' keeps it, 'except_attention' the attention's output and float32 LSE
    (28 heads) too, 'off' the MLP's three 18,944-wide intermediates as well."""
    shape = Shape(hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                  layer_params=233_057_792)
    t = 131_072
    layer_in = t * 3584 * 2
    assert layer_in / GIB == 0.875
    assert layer_saved("full", shape, layer_in, t) == layer_in
    assert layer_saved("except_attention", shape, layer_in, t) == 2 * layer_in + t * 28 * 4
    assert layer_saved("off", shape, layer_in, t) == 3.9 * layer_in + 3 * t * 18944 * 2
    # Weights, gradients and AdamW states of the 8,292,166,656 parameters in bf16, unsharded: 8 bytes each.
    units = [Unit(path="", modality=None, params=8_292_166_656, strategy="none", storage_bytes=2)]
    mem = memory(units, shape, Setup(tokens=t))
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == 8 * 8_292_166_656
    # The fused loss: the float32 head-gradient sum's surplus (V x H x 2 bytes) and its chunks.
    assert mem["loss or recomputation"] == 152064 * 3584 * 2 + 0.55 * GIB + layer_in


#: Measured on one H200 (BENCHMARKS.md: "fourth figures" and the second figures): recipe,
#: peak GiB, steady step seconds.
MEASURED = [
    ("bundled 7B 32K", None, 132.6, 4.18),  # layers 0-9 not recomputed, the logits' gradient in their storage
    ("7B 32K, all layers mlp", "mlp28", 107.7, 4.349),
    ("bundled 7B 128K", None, 122.7, 32.3),
    ("7B 128K, FSDP2, full recomputation", "full128", 100.1, 40.3),
]

_FULL_128 = """
    [model]
    preset = "qwen2_5_vl_7b"
    [data]
    source = "synthetic"
    tokens = 131072
    images = [[448, 448]]
    [train]
    micro_batch_tokens = 131072
    precision = "bf16"
    loss = "fused"
    [parallel]
    nproc = 1
    [[rules]]
    when = { path = "*.visual.*" }
    shard = { strategy = "fsdp2", storage_dtype = "bfloat16", checkpoint = "off", compile = true }
    [[rules]]
    shard = { strategy = "fsdp2", storage_dtype = "bfloat16", checkpoint = "full", compile = true }
"""


@pytest.mark.quick
@pytest.mark.parametrize(("name", "variant", "gib", "seconds"), MEASURED)
def test_predictions_within_the_issue_tolerances_of_the_measured_runs(tmp_path, name, variant, gib, seconds):
    """Peak memory within 15% and step time within 25% of every measured 7B row."""
    bundled = ROOT / "recipes" / ("qwen2.5-vl-7b-32k-1gpu.toml" if "32K" in name else "qwen2.5-vl-7b-128k-1gpu.toml")
    if variant == "mlp28":  # the bundled 32K recipe without its first rule (layers 0-7 not recomputed)
        text = bundled.read_text()
        first = text.index("[[rules]]")
        path = _write(tmp_path, "v.toml", text[:first] + text[text.index("[[rules]]", first + 1):])
    elif variant == "full128":
        path = _write(tmp_path, "v.toml", _FULL_128)
    else:
        path = bundled
    units, shape, setup = _plan(path)
    predicted = memory(units, shape, setup)["total"] / GIB
    step = step_seconds(units, shape, setup, GPUS["h200"])["total"]
    assert abs(predicted / gib - 1) <= 0.15, (name, predicted, gib)
    assert abs(step / seconds - 1) <= 0.25, (name, step, seconds)


@pytest.mark.quick
def test_the_attention_backward_runs_faster_at_length():
    """The H200's attention backward: 553 TFLOP/s at 32K (a step's profile), 613 at 128K (one
    forward-and-backward call at 128K, 694.7 ms a layer, less the forward at 640), following
    log2 of the length between, no faster past 128K; the bundled 128K recipe's step then within
    5% of its 31.7 s (one H200, 2026-12-02; 34.4 s predicted at the 32K rate: +8.6%)."""
    h200 = GPUS["h200"]
    assert [h200.attention_bwd_rate(n) for n in (8192, 32768, 65536, 131072, 1 << 20)] == pytest.approx(
        [553.0, 553.0, 583.0, 613.0, 613.0])
    assert GPUS["a100-80g"].attention_bwd_rate(131072) == GPUS["a100-80g"].attention_bwd_tflops  # not measured
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-128k-1gpu.toml")
    assert step_seconds(units, shape, setup, h200)["total"] == pytest.approx(31.7, rel=0.05)


#: The bundled 128K recipe and the same rules over 4 of its 28 layers
#: (benchmarks/step/variants/7b-128k-4layers.toml), peaks in GiB: the slice 44.47 on one H100
#: with its MLPs made again by hand (2026-12-06, session 8; 49.09 through the compiled module,
#: the snapshot of issue 46); the whole 122.7 on one H200 (2026-12-02) through the compiled
#: module, less what the slice measured the by-hand recomputation to save (the peak's one
#: recomputed MLP: the same in both). The LoRA recipe's rules over the same 4 layers
#: (benchmarks/step/variants/7b-lora-128k-4layers.toml), one H200 in one lease (2026-12-06,
#: session 8): 30.82 made again by hand, 53.94 through PEFT's forward (eight MLP-sized tensors at
#: its peak against three); ``LORA_BY_HAND`` the difference.
PEAK_128K_SLICE, PEAK_LORA_SLICE = 44.47, 30.82
LORA_BY_HAND = 53.94 - PEAK_LORA_SLICE
PEAK_128K = 122.7 - (49.09 - PEAK_128K_SLICE)


@pytest.mark.quick
def test_the_128k_recipe_and_its_4_layer_slice_by_one_memory_model():
    """One model for both: the slice within 3%, the whole within 1.5%, and what 24 layers add
    (weights, gradients, states, saved activations) within 0.5% of the measured difference. At
    the peak (the backward's first layer) of the gradients only the fused loss's float32 head
    sum exists (2.03 GiB, as the snapshot showed): counting every gradient there put the slice
    23% under its measurement. Several micro-batches, or activations offloaded: every one."""
    whole = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-128k-1gpu.toml")
    cut = _plan(ROOT / "benchmarks" / "step" / "variants" / "7b-128k-4layers.toml")
    full, part = memory(*whole), memory(*cut)
    assert abs(part["total"] / GIB / PEAK_128K_SLICE - 1) <= 0.03, part["total"] / GIB
    assert abs(full["total"] / GIB / PEAK_128K - 1) <= 0.015, full["total"] / GIB
    assert abs((full["total"] - part["total"]) / GIB / (PEAK_128K - PEAK_128K_SLICE) - 1) <= 0.005
    assert full["gradients"] == part["gradients"] == 152064 * 3584 * 4
    units, shape, setup = whole
    accumulated = memory(units, shape, attrs.evolve(setup, micro_batches=2))
    assert accumulated["gradients"] == sum(u.params for u in units) * 2  # every one, in bf16
    offloaded = [attrs.evolve(u, offload_activations=True) if u.modality == "text" else u for u in units]
    assert memory(offloaded, shape, setup)["gradients"] == accumulated["gradients"]
    # The LoRA rules over the same 4 layers, by hand: the plain MLP's three intermediates, no adapter surplus.
    lora = memory(*_plan(ROOT / "benchmarks" / "step" / "variants" / "7b-lora-128k-4layers.toml"))
    assert abs(lora["total"] / GIB / PEAK_LORA_SLICE - 1) <= 0.02, lora["total"] / GIB


#: The frontier recipe (``qwen2.5-vl-7b-512k-1gpu``: inputs offloaded, MLP tiled,
#: flash-attn-4) on one H200, BENCHMARKS.md "Frontier rows": length, peak GiB, step
#: seconds, and whether the figure is a first step's (AdamW's states made at its end).
FRONTIER = [
    (131_072, 74.7, 40.6, False),
    (262_144, 82.9, 127.7, False),
    (524_288, 70.2, 485.6, True),
]


@pytest.mark.quick
@pytest.mark.parametrize(("tokens", "gib", "seconds", "first"), FRONTIER)
def test_frontier_predictions_within_the_issue_tolerances(tokens, gib, seconds, first):
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-512k-1gpu.toml")
    setup = attrs.evolve(setup, tokens=tokens)
    mem = memory(units, shape, setup)
    predicted = mem["first step" if first else "total"] / GIB
    step = step_seconds(units, shape, setup, GPUS["h200"])["total"]
    assert abs(predicted / gib - 1) <= 0.15, (tokens, predicted, gib)
    assert abs(step / seconds - 1) <= 0.25, (tokens, step, seconds)


@pytest.mark.quick
def test_frozen_units_hold_no_gradients_or_states():
    """Qwen2.5-VL-7B's 32 vision blocks (630,470,656 parameters in bf16) frozen: 1.17 GiB
    of gradients and 2.35 GiB of AdamW states fewer, as the H200 run measured
    (BENCHMARKS.md: 15.45 -> 14.27 and 30.89 -> 28.54 GiB)."""
    shape = Shape(hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                  layer_params=233_057_792)
    rest = Unit(path="", modality=None, params=8_292_166_656 - 630_470_656, strategy="none", storage_bytes=2)
    tower = Unit(path="model.visual.blocks", modality="vision", params=630_470_656, strategy="none", storage_bytes=2)
    trained = memory([rest, tower], shape, Setup(tokens=1024))
    frozen = memory([rest, attrs.evolve(tower, trainable=False)], shape, Setup(tokens=1024))
    assert trained["gradients"] - frozen["gradients"] == 630_470_656 * 2
    assert trained["optimizer"] - frozen["optimizer"] == 630_470_656 * 4
    assert frozen["weights"] == trained["weights"]
    assert round(frozen["gradients"] / GIB, 2) == 14.27 and round(frozen["optimizer"] / GIB, 2) == 28.54


@pytest.mark.quick
def test_longest_fit_is_the_last_length_that_fits():
    assert longest_fit(lambda n: n <= 300_000, low=1024, high=1 << 22) == 299_008
    assert longest_fit(lambda n: n <= 300_000, low=1024, high=1 << 22, multiple=4096) == 299_008 - 299_008 % 4096
    assert longest_fit(lambda n: False, low=1024, high=1 << 20) is None
    assert longest_fit(lambda n: True, low=1024, high=1 << 20) == 1 << 20


def test_the_command_names_the_rules_that_would_make_it_fit(weft, tmp_path):
    """7B at 1M tokens on one H200 with the MLP-only recomputation does not fit: the answer is
    the longest length that does, and rule changes pulled in turn, each naming its rule's line."""
    recipe = _write(tmp_path, "long.toml", """
        [model]
        preset = "qwen2_5_vl_7b"
        [data]
        source = "synthetic"
        tokens = 1048576
        images = [[448, 448]]
        [train]
        micro_batch_tokens = 1048576
        precision = "bf16"
        loss = "logits"
        [parallel]
        nproc = 1
        [[rules]]
        name = "decoder layers"
        when = { path = "*.language_model.layers.*" }
        shard = { strategy = "none", storage_dtype = "bfloat16", checkpoint = "mlp" }
        [[rules]]
        shard = { strategy = "none", storage_dtype = "bfloat16", checkpoint = "full" }
    """)
    done = weft("plan", str(recipe), "--estimate", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert not result["fits"] and 0 < result["longest_tokens"] < 1_048_576
    changes = result["changes"]
    # The rule that decides the decoder layers, by its [[rules]] line.
    assert changes[0]["change"].startswith('checkpoint = "full"') and changes[0]["where"] == f"{recipe}:14"
    assert changes[1]["change"] == 'train.loss = "fused"' and "train.loss" in changes[1]["where"]
    totals = [c["total_gib"] for c in changes]
    assert totals == sorted(totals, reverse=True) and changes[-1]["fits"] == (totals[-1] <= 139.8 - 2)


def test_host_memory_bounds_offloaded_activations(weft, tmp_path):
    """7B at 512K on one H200: the layers' inputs in host memory, the MLP in tiles. The GPU
    holds weights, states and one layer's recomputation; the host holds 28 layer inputs
    (512K x 3,584 x 2 bytes = 3.5 GiB each), so the host's memory sets the longest length."""
    recipe = _write(tmp_path, "f512.toml", """
        [model]
        preset = "qwen2_5_vl_7b"
        [train]
        micro_batch_tokens = 524288
        precision = "bf16"
        loss = "fused"
        [parallel]
        nproc = 1
        [[rules]]
        when = { path = "*.language_model.layers.*" }
        [rules.shard]
        strategy = "none"
        storage_dtype = "bfloat16"
        checkpoint = "full"
        offload_activations = true
        mlp_tile_tokens = 16384
        [[rules]]
        shard = { strategy = "none", storage_dtype = "bfloat16", checkpoint = "full" }
    """)

    def answer(*extra):
        done = weft("plan", str(recipe), "--estimate", "--json", *extra, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    roomy, tight = answer(), answer("--host-gib", "64")
    assert roomy["memory_gib"]["activations"] == 0.0 and roomy["fits"] and roomy["memory_gib"]["total"] < 130
    assert roomy["host_gib"] == pytest.approx(28 * 3.5 + 8, abs=0.1)
    assert not tight["fits"] and tight["longest_tokens"] < 524288 < roomy["longest_tokens"]


# The bundled recipes, and the benchmarks' real-size recipes that GPU runs take as they stand.
REAL_SIZE = sorted([*(ROOT / "recipes").glob("qwen2.5-*.toml"),
                    *(ROOT / "benchmarks" / "frontier").glob("frontier-*.toml"),
                    *(ROOT / "benchmarks" / "frontier").glob("slice-*.toml"),
                    *(ROOT / "benchmarks" / "frontier").glob("video-*.toml")])


@pytest.mark.quick
@pytest.mark.parametrize("recipe", REAL_SIZE, ids=lambda p: p.stem)
def test_bundled_real_size_recipes_fit_their_gpus_as_the_planner_sizes_them(recipe):
    """Every bundled real-size recipe, planned at its own nproc: the planner says it fits an H200
    (GPU and host memory) and its step ends within a 10-minute GPU command, or, where a step
    cannot (1M tokens on one GPU), the recipe names the slice of few layers that measures it
    (benchmarks/frontier/slice-*.toml, itself planned here as fitting a command)."""
    from weft.core.plan.estimate_view import estimate
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    loaded = Recipe.from_toml(str(recipe))
    plan, model = plan_recipe(loaded, pm=plugin_manager_from_env(), world_size=loaded.parallel.nproc)
    result = estimate(loaded, plan, model, gpu="h200")
    assert result["fits"], (recipe.name, result["memory_gib"]["total"], result["host_gib"], result["changes"])
    if result["step_s"]["total"] >= 540:
        import re

        slices = re.findall(r"benchmarks/frontier/slice-[\w.-]+?\.toml", recipe.read_text())
        assert slices and all((ROOT / name).is_file() for name in slices), (recipe.name, slices)
    else:
        assert result["step_s"]["total"] < 540, (recipe.name, result["step_s"])


@pytest.mark.quick
def test_a_plan_within_3_percent_of_the_device_is_warned_about():
    """The 7B 32K recipe as bundled leaves 8.0 GiB of the H200 free as predicted (over 3%):
    no warning; at 34,816 tokens, 3.8 GiB: a warning naming
    the peak, the device, the allocator setting and the levers. Just under the 3% line, none."""
    import types

    from weft.core.plan.estimate_view import estimate, near_limit
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    results = {}
    for tokens in (32768, 34816):
        loaded = Recipe.from_toml(str(ROOT / "recipes" / "qwen2.5-vl-7b-32k-1gpu.toml"),
                                  overrides=(f"train.micro_batch_tokens={tokens}",))
        plan, model = plan_recipe(loaded, pm=plugin_manager_from_env(), world_size=1)
        results[tokens] = estimate(loaded, plan, model, gpu="h200")
    assert results[32768]["fits"] and results[32768]["warning"] is None
    near = results[34816]
    assert near["fits"] and near["headroom_gib"] < 0.03 * 139.8
    assert near["warning"].startswith(f"the predicted peak, {near['memory_gib']['total']:.1f} GiB, leaves "
                                      f"{near['headroom_gib']:.1f} GiB of the h200's 139.8 GiB free, under 3%")
    assert "expandable_segments is on" in near["warning"] and "micro_batch_tokens (now 34816)" in near["warning"]

    recipe = types.SimpleNamespace(parallel=types.SimpleNamespace(expandable_segments=False),
                                   train=types.SimpleNamespace(micro_batch_tokens=1024))
    assert near_limit(recipe, peak_gib=0.97 * 80 - 0.01, device_gib=80, gpu="x") is None
    assert "set parallel.expandable_segments = true" in near_limit(recipe, peak_gib=0.97 * 80, device_gib=80, gpu="x")


@pytest.mark.quick
def test_an_adapter_plan_holds_no_base_gradients_or_states(tmp_path):
    """qwen2_text_tiny with LoRA r 4 on every linear of its 2 layers: q 64->64, k and v 64->32,
    o 64->64, gate and up 64->128, down 128->64, so r x (in + out) = 4 x (128 + 96 + 96 + 128 +
    192 + 192 + 192) = 4,096 adapter parameters a layer. The whole base (layers, embeddings,
    head) is frozen, as plugins/adapter.py freezes it: weights for all, gradients and AdamW
    states for the 8,192 adapter parameters only."""
    recipe = _write(tmp_path, "lora.toml", """
        [model]
        preset = "qwen2_text_tiny"
        [train]
        micro_batch_tokens = 1024
        [[rules]]
        when = { path = "model.layers.*" }
        adapter = { strategy = "lora", r = 4, targets = "all-linear" }
        [[rules]]
        shard = { strategy = "none" }
    """)
    units, shape, setup = _plan(recipe)
    assert [u.adapter_params for u in units if u.modality == "text"] == [4096, 4096]
    assert sum(u.params for u in units) == 115_264 and not any(u.trainable for u in units)
    assert shape.layer_params == 37_120  # the base layer's: the adapters counted apart
    mem = memory(units, shape, setup)
    assert mem["weights"] == (115_264 + 8192) * 4
    assert mem["gradients"] == 8192 * 4 and mem["optimizer"] == 2 * 8192 * 4  # float32 storage
    # The step: the frozen base runs forward and input gradients (4 FLOPs per weight and token),
    # the adapters all 6; nothing else changes.
    trained = [attrs.evolve(u, params=u.params + u.adapter_params, adapter_params=0, trainable=True) for u in units]
    gpu = GPUS["h200"]
    base = 2 * (2 * 37_120 + 320 * 64)  # the 2 layers' and the head's weight-gradient products, per token
    saved = step_seconds(trained, attrs.evolve(shape, layer_params=37_120 + 4096), setup, gpu)["matmul"] \
        - step_seconds(units, shape, setup, gpu)["matmul"]
    assert saved == pytest.approx(base * 1024 / (gpu.matmul_tflops * 1e12))


@pytest.mark.quick
def test_a_frozen_weight_counts_the_flops_it_runs():
    """MFU's count (core/plan/flops.py): 6 per trained weight and token, 4 per frozen one."""
    from weft.core.plan.flops import sequence_flops

    full = sequence_flops(params=1000, layers=2, hidden=8, length=16)
    assert full == 6 * 1000 * 16 + 6 * 2 * 8 * 16**2
    assert sequence_flops(params=1000, frozen=900, layers=2, hidden=8, length=16) == full - 2 * 900 * 16


#: ``recipes/qwen2.5-vl-7b-lora-128k-1gpu.toml`` (then benchmarks/variants/7b-lora-128k.toml) on
#: one H200 (BENCHMARKS.md, "LoRA by rule: the first 7B row at 128K"): 4,266 tokens/s (30.7 s
#: a step), 106.84 GiB allocated at the peak through PEFT's forward (by hand: less what its
#: 4-layer slice measured by hand to save, ``LORA_BY_HAND``; the peak's one recomputed MLP is the
#: same in both), states weights 15.52 / gradients 0.075 / optimizer 0.150 GiB.
LORA_128K = {"gib": 106.84, "seconds": 131_072 / 4266, "states": (15.52, 0.075, 0.150)}


@pytest.mark.quick
def test_the_lora_row_against_its_measured_run():
    """The states exactly as the run's summary counted them (the base's weights, 40.4M adapter
    parameters' bf16 gradients and two moments); the step within 10% (measured 30.7 s: the
    base's weight-gradient products gone); the peak within 15% of the measured one less what the
    MLP made again by hand holds fewer (``LORA_BY_HAND``, measured on the 4-layer slice). The
    gradients as the run counts them at its end: with a second micro-batch, as many live at the peak."""
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-lora-128k-1gpu.toml")
    assert sum(u.adapter_params for u in units) == 28 * 16 * (7168 + 4096 + 4096 + 7168 + 3 * 22528)
    mem = memory(units, shape, setup)
    every = memory(units, shape, attrs.evolve(setup, micro_batches=2))["gradients"]
    assert mem["gradients"] == 0  # one micro-batch: none made yet at the peak (the head is frozen)
    states = (round(mem["weights"] / GIB, 2), round(every / GIB, 3), round(mem["optimizer"] / GIB, 3))
    assert states == LORA_128K["states"]
    assert mem["vision"] == 0  # the frozen tower runs no backward: nothing saved
    assert abs(mem["total"] / GIB / (LORA_128K["gib"] - LORA_BY_HAND) - 1) <= 0.15
    step = step_seconds(units, shape, setup, GPUS["h200"])["total"]
    assert abs(step / LORA_128K["seconds"] - 1) <= 0.10, step


@pytest.mark.quick
def test_the_longest_length_of_an_adapter_run_uses_the_same_counts():
    """The LoRA variant's longest length (states 46 GiB lighter than the full fine-tune's, the
    adapters' recomputation heavier) fits by the same memory model the table shows, one step more does not."""
    from weft.core.plan.estimate_view import HEADROOM_GIB, estimate
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    loaded = Recipe.from_toml(str(ROOT / "recipes" / "qwen2.5-vl-7b-lora-128k-1gpu.toml"))
    plan, model = plan_recipe(loaded, pm=plugin_manager_from_env(), world_size=1)
    result = estimate(loaded, plan, model, gpu="h200")
    assert result["adapter_parameters"] == 40_370_176 and result["memory_gib"]["gradients"] < 0.1
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-lora-128k-1gpu.toml")
    budget = (GPUS["h200"].memory_gib - HEADROOM_GIB) * GIB
    longest = result["longest_tokens"]
    assert memory(units, shape, attrs.evolve(setup, tokens=longest))["total"] <= budget
    assert memory(units, shape, attrs.evolve(setup, tokens=longest + 1024))["total"] > budget


#: float8 rows measured on one H200 (BENCHMARKS.md, 2026-12-01/02): the bundled 32K layout in
#: each scaling, and the 128K float8 recipe in rowwise and tensorwise: (length, scaling, step seconds).
FLOAT8 = [(32_768, "tensorwise", 3.28), (32_768, "rowwise_with_gw_hp", 3.56), (32_768, "rowwise", 3.99),
          (131_072, "rowwise", 31.10), (131_072, "tensorwise", 28.37)]


@pytest.mark.quick
@pytest.mark.parametrize(("tokens", "scaling", "seconds"), FLOAT8)
def test_float8_steps_within_the_tolerance_of_the_measured_runs(tokens, scaling, seconds):
    """A float8 unit's products at its scaling's measured speed-up: each measured float8 step
    within 25%, faster than the same plan's bf16 step by the scaling's order (an A100, which has
    no float8 units, keeps bf16's)."""
    length = "32k" if tokens == 32_768 else "128k"
    units, shape, setup = _plan(ROOT / "recipes" / f"qwen2.5-vl-7b-{length}-float8-1gpu.toml")
    units = [attrs.evolve(u, float8=scaling) if u.float8 else u for u in units]
    assert sum(1 for u in units if u.float8) == 28
    step = step_seconds(units, shape, setup, GPUS["h200"])["total"]
    # The same units at bf16's rate (the same recomputation: a compiled float8 MLP makes its down
    # product again, a plain one's recomputation by hand does not).
    plain = step_seconds(units, shape, setup, attrs.evolve(GPUS["h200"], float8=()))["total"]
    assert abs(step / seconds - 1) <= 0.25, (tokens, scaling, step, seconds)
    assert step < plain
    # An A100 has no float8 units: bf16's rate (its step differs from the bf16 plan's by the down
    # product a compiled float8 MLP makes again, which a plain one's recomputation by hand does not).
    assert GPUS["a100-80g"].float8_speedup(scaling) == 1.0


#: Peaks of the bundled 32K float8 layout on one H200 (BENCHMARKS.md, 2026-12-01/02), by scaling.
FLOAT8_PEAKS = {"tensorwise": 116.9, "rowwise": 116.9, "rowwise_with_gw_hp": 132.6}


@pytest.mark.quick
@pytest.mark.parametrize("scaling", sorted(FLOAT8_PEAKS))
def test_float8_peaks_within_four_percent_of_the_measured_runs(scaling):
    """A compiled, unrecomputed float8 layer's MLP keeps two intermediates in tensorwise and
    rowwise (three in bf16 and gw_hp): each measured peak within 4%, never under it by more
    than 1%, and the saving exactly those layers' third intermediate."""
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-32k-float8-1gpu.toml")
    units = [attrs.evolve(u, float8=scaling) if u.float8 else u for u in units]
    peak = memory(units, shape, setup)["total"] / GIB
    assert -0.01 <= peak / FLOAT8_PEAKS[scaling] - 1 <= 0.04, (scaling, peak)
    bf16 = memory([attrs.evolve(u, float8="") for u in units], shape, setup)["total"] / GIB
    kept = sum(1 for u in units if u.float8 and u.checkpoint == "off" and u.compiled)
    third = kept * setup.tokens * shape.intermediate * 2 / GIB if scaling != "rowwise_with_gw_hp" else 0.0
    assert kept == 10 and bf16 - peak == pytest.approx(third, rel=1e-9)


#: Peaks of the bundled 128K float8 recipe on one H200 (BENCHMARKS.md, 2026-12-01/02), by scaling.
FLOAT8_PEAKS_128K = {"tensorwise": 129.0, "rowwise": 136.05}


@pytest.mark.quick
@pytest.mark.parametrize("scaling", sorted(FLOAT8_PEAKS_128K))
def test_float8_peaks_at_128k_are_not_under_estimated(scaling):
    """Recomputed whole ("except_attention"), a float8 layer holds its casts' copies beside the
    bf16 intermediates while it is made again: each measured 128K peak within 1% above the
    estimate's (never under it by more than 1%), bf16's estimate unchanged by the rule (its MLPs
    made again by hand: one intermediate fewer than the compiled module's)."""
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-128k-float8-1gpu.toml")
    units = [attrs.evolve(u, float8=scaling) if u.float8 else u for u in units]
    assert {u.checkpoint for u in units if u.float8} == {"except_attention"}
    peak = memory(units, shape, setup)["total"] / GIB
    assert 0 <= peak / FLOAT8_PEAKS_128K[scaling] - 1 <= 0.01, (scaling, peak)
    bf16 = memory([attrs.evolve(u, float8="") for u in units], shape, setup)["total"] / GIB
    assert bf16 == pytest.approx(116.93, abs=0.01) and bf16 < peak


@pytest.mark.quick
def test_dpo_with_the_adapters_off_adds_the_reference_forward():
    """The LoRA DPO recipe's step time holds the reference's forward (adapters off, no
    gradients): about a forward's share of the step, not a backward's; its pairs are two rows."""
    from weft.core.plan.estimate_view import estimate
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    loaded = Recipe.from_toml(str(ROOT / "recipes" / "qwen2.5-vl-7b-dpo-lora-32k-1gpu.toml"))
    plan, model = plan_recipe(loaded, pm=plugin_manager_from_env(), world_size=1)
    seconds = estimate(loaded, plan, model, gpu="h200")["step_s"]
    reference = seconds["reference forward"]
    assert 0.15 < reference / (seconds["total"] - reference) < 0.5, seconds
    # A pair is two rows of 16K, an image each: attention inside each row, half one 32K sequence's.
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-dpo-lora-32k-1gpu.toml")
    assert (setup.rows, setup.patches) == (2, 2 * 32 * 32)
    one = step_seconds(units, shape, attrs.evolve(setup, rows=1), GPUS["h200"])
    assert one["attention forward"] == pytest.approx(2 * step_seconds(units, shape, setup, GPUS["h200"])[
        "attention forward"])


@pytest.mark.quick
def test_the_million_token_recipe_fits_one_h200_and_its_host():
    """qwen2.5-vl-7b-1m-1gpu as the planner sizes it: GPU <= 135 GiB, host <= 120 GiB (issue's
    bounds; the device has 139.8 and 128). Keeping every second layer input halves the host's
    share of them (14 of 28 at 7 GiB each) and costs 14 more layer forwards; with every input
    kept the host would need 204 GiB."""
    units, shape, setup = _plan(ROOT / "recipes" / "qwen2.5-vl-7b-1m-1gpu.toml")
    assert setup.tokens == 1_048_576
    mem = memory(units, shape, setup)
    assert mem["total"] / GIB <= 135 and mem["host"] / GIB <= 120, (mem["total"] / GIB, mem["host"] / GIB)
    every = [attrs.evolve(u, offload_keep_every=1) for u in units]
    layer_in = setup.tokens * shape.hidden * 2
    assert memory(every, shape, setup)["host"] - mem["host"] == 14 * layer_in
    assert memory(every, shape, setup)["host"] / GIB > 200
    thin, full = (step_seconds(u, shape, setup, GPUS["h200"]) for u in (units, every))
    assert thin["attention forward"] / full["attention forward"] == pytest.approx((28 * 2 + 14) / (28 * 2))
    assert thin["total"] > full["total"]


@pytest.mark.quick
def test_a_tiled_mlp_adds_a_forward_only_where_its_layer_is_not_recomputed():
    """The tiled MLP's backward runs its tiles again; a recomputed layer's recomputation stops
    before them (strategies/memory/tiled_mlp.py), so there the tiles cost nothing more."""
    shape = Shape(hidden=64, intermediate=256, heads=4, kv_heads=2, head_dim=16, vocab=512, layer_params=90_000)
    setup, gpu = Setup(tokens=4096), GPUS["h200"]
    mlp_forward = 2 * 4096 * 3 * 64 * 256 / (gpu.matmul_tflops * 1e12)

    def matmul(checkpoint: str, tile: int, *, adapters: bool = False, float8: str = "") -> float:
        unit = Unit(path="model.layers.0", modality="text", params=90_000, strategy="none", storage_bytes=2,
                    checkpoint=checkpoint, mlp_tile_tokens=tile, adapter_params=1000 * adapters, float8=float8)
        return step_seconds([unit], shape, setup, gpu)["matmul"]

    assert matmul("full", 1024) == pytest.approx(matmul("full", 0), rel=1e-12)
    assert matmul("except_attention", 1024) == pytest.approx(matmul("except_attention", 0), rel=1e-12)
    # A SwiGLU's tiles make gate and up again by hand, not down (strategies/memory/swiglu.py), its
    # LoRA adapters' too; a float8 MLP runs its tiles' whole forward again.
    assert matmul("off", 1024) - matmul("off", 0) == pytest.approx(mlp_forward * 2 / 3, rel=1e-9)
    assert matmul("off", 1024, adapters=True) - matmul("off", 0, adapters=True) == pytest.approx(
        mlp_forward * 2 / 3, rel=1e-9)
    assert matmul("off", 1024, float8="tensorwise") - matmul("off", 0, float8="tensorwise") == pytest.approx(
        mlp_forward / GPUS["h200"].float8_speedup("tensorwise"), rel=1e-9)


@pytest.mark.quick
def test_a_tiled_4bit_mlp_holds_its_weights_expanded_while_its_tiles_run():
    """72B's widths at 128K, where a layer's recomputation is the peak's last term: the tiled
    MLP's 4-bit weights in 16 bits (3 x 8,192 x 29,568 x 2 bytes) counted beside it."""
    shape = Shape(hidden=8192, intermediate=29568, heads=64, kv_heads=8, head_dim=128, vocab=152064,
                  layer_params=880_000_000)
    unit = Unit(path="model.layers.0", modality="text", params=880_000_000, strategy="none", storage_bytes=2,
                checkpoint="full", mlp_tile_tokens=16384, quantized_params=3 * 8192 * 29568, trainable=False)
    setup = Setup(tokens=131072, loss="fused")
    four_bit, plain = (memory([u], shape, setup)["loss or recomputation"]
                       for u in (unit, attrs.evolve(unit, quantized_params=0)))
    assert four_bit - plain == 3 * 8192 * 29568 * 2
    untiled = attrs.evolve(unit, mlp_tile_tokens=0)
    assert memory([untiled], shape, setup)["loss or recomputation"] > four_bit  # (its whole MLP's intermediates)


@pytest.mark.quick
def test_micro_batches_a_step_come_from_the_step_tokens_over_the_data_parallel_ranks():
    from weft.core.plan.estimate_inputs import micro_batches_of
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    def rounds(*sets: str, world: int = 1) -> int:
        recipe = Recipe.from_toml(str(ROOT / "recipes" / "tiny-vl.toml"), overrides=("train.micro_batch_tokens=1024",
                                                                                     *sets))
        plan, _ = plan_recipe(recipe, pm=plugin_manager_from_env(), world_size=world)
        return micro_batches_of(recipe, plan)

    assert rounds() == 1  # step_tokens 0: one round
    assert rounds("train.step_tokens=4096") == 4
    assert rounds("train.step_tokens=4097") == 5
    assert rounds("train.step_tokens=4096", "parallel.nproc=2", world=2) == 2  # two data-parallel ranks
