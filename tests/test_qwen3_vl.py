"""Qwen3-VL under sequence parallelism equals the unsharded model.

transformers' own ``Qwen3VLForConditionalGeneration`` (preset ``qwen3_vl_tiny``),
float32, three images of different sizes in one batch. DeepStack's decoder inputs
(``visual_pos_masks``, ``deepstack_visual_embeds``) are cut like the sequence; its
ViT features are gathered with the merged embeddings when images are spread over
the SP ranks. Loss relative difference <= 1e-5, every gradient <= 1e-4.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from distributed import run_ranks, sp_model

#: (ulysses, ring, text strategy, layout, vision rule or None); 4 gloo ranks.
CONFIGS = [
    (2, 2, "usp", "zigzag", None),
    (1, 4, "ring", "zigzag", None),
    (1, 4, "ring", "contiguous", None),
    (1, 2, "ring", "zigzag", None),  # dp 2 x ring 2: two SP groups of 2 ranks
    # Ulysses over one image's patches: the 48-patch image makes all 4 ranks share the
    # tower, so DeepStack's taps (blocks 0 and 1) gather the patch parts themselves.
    (2, 2, "usp", "zigzag", {"strategy": "vision_ulysses", "min_patches": 40}),
]


# -- which DeepStack rows a rank keeps ------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_local_rows_match_brute_force(layout):
    """ring 2 x ulysses 2, batch 2: every rank's rows are the visual positions it holds,
    numbered in the whole (B, S) row-major order, listed in its local row-major order;
    together the ranks hold every row once."""
    from weft.strategies.sequence.deepstack import local_rows, select_rows
    from weft.strategies.sequence.model_split import TextSplit

    generator = torch.Generator().manual_seed(0)
    batch, seq = 2, 24
    mask = torch.rand((batch, seq), generator=generator) < 0.4  # (B, S)
    mask[0, 3:9] = True  # an image run across a chunk border
    number = {}  # (b, s) -> row of the whole features
    for b in range(batch):
        for s in range(seq):
            if mask[b, s]:
                number[b, s] = len(number)
    features = torch.randn((len(number), 5), generator=generator)  # (N_visual, H)
    seen = []
    for ring_rank in range(2):
        for ulysses_rank in range(2):
            split = TextSplit(ring=2, ring_rank=ring_rank, ulysses=2, ulysses_rank=ulysses_rank, layout=layout)
            positions = split.shard(torch.arange(seq), dim=0).tolist()  # global positions held, in local order
            expected = [number[b, s] for b in range(batch) for s in positions if mask[b, s]]
            rows = local_rows(mask, shard=split.shard)
            assert rows.tolist() == expected, (layout, ring_rank, ulysses_rank)
            local_mask = split.shard(mask, dim=1)
            assert int(local_mask.sum()) == len(expected)
            (picked,) = select_rows([features], rows)
            assert torch.equal(picked, features[expected])
            seen += expected
    assert sorted(seen) == list(range(len(number)))


# -- exactness on 4 ranks ---------------------------------------------------------------


def _batch(*, pad_multiple: int) -> dict:
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    tokenizer, image_processor = load_processor("tiny_vl")
    conversations = synthetic_conversations(seed=5, num_samples=3, min_side=28, max_side=112)
    samples = [encode_conversation(c.messages, tokenizer=tokenizer, image_processor=image_processor)
               for c in conversations]
    return collate(samples, pad_id=tokenizer.pad_token_id, pad_to_multiple_of=pad_multiple)


def _decoder_inputs(model) -> list[dict]:
    """Records the text decoder's DeepStack inputs at each call (after the split hook)."""
    seen: list[dict] = []

    def record(module, args, kwargs):
        seen.append({"mask": kwargs.get("visual_pos_masks"), "deepstack": kwargs.get("deepstack_visual_embeds")})

    model.model.language_model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def _check(rank: int, world: int, *, ulysses: int, ring: int, strategy: str, layout: str, vision: dict | None) -> None:
    from weft.core.train.loss import label_count, targets, token_loss_sum

    rules = [{"when": {"modality": "text"}, "attention": {"strategy": strategy, "layout": layout}}]
    rules += [{"when": {"modality": "vision"}, "attention": vision}] if vision else []
    model, reference, plan, mesh, split = sp_model(
        {"model": {"preset": "qwen3_vl_tiny"}, "parallel": {"ulysses": ulysses, "ring": ring}, "rules": rules},
        rank=rank, world=world,
    )
    name = f"ulysses={ulysses} ring={ring} dp={plan.mesh.dp} {strategy}/{layout} vision={vision}"
    assert plan.mesh.sp == ulysses * ring and plan.mesh.dp * plan.mesh.sp == world, name
    group = mesh.sp.get_group()
    batch = _batch(pad_multiple=split.multiple)
    assert batch["image_grid_thw"].prod(-1).tolist() == [48, 16, 24], "three images of different sizes"
    count = label_count(targets(batch))

    def inputs(b):
        return {k: v for k, v in b.items() if k not in ("labels", "shift_labels")}

    ref_seen, seen = _decoder_inputs(reference), _decoder_inputs(model)
    ref_loss = token_loss_sum(reference(**inputs(batch)).logits, targets(batch)) / count
    ref_loss.backward()
    # DeepStack really runs: the reference decoder got the visual positions and one
    # feature tensor per tapped ViT block.
    visual = int(ref_seen[0]["mask"].sum())
    assert visual == 22 and [tuple(f.shape) for f in ref_seen[0]["deepstack"]] == [(visual, 64)] * 2, name

    shift_labels = split.shard(targets(batch), dim=1)  # shifted on the whole sequence, then cut
    logits = model(**inputs(batch)).logits  # (B, S_local, V)
    loss_part = token_loss_sum(logits, shift_labels) / count
    loss_part.backward()

    # The SP ranks' visual positions are the whole sequence's, each once.
    local = int(seen[0]["mask"].sum())
    assert [tuple(f.shape) for f in seen[0]["deepstack"]] == [(local, 64)] * 2, name
    held = torch.tensor([local])
    torch.distributed.all_reduce(held, group=group)
    assert int(held) == visual, name

    loss = loss_part.detach().clone()
    torch.distributed.all_reduce(loss, group=group)
    rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    assert rel <= 1e-5, f"{name}: loss {loss.item()} vs {ref_loss.item()} (rel {rel:.2e})"
    worst = 0.0
    for (pname, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert p_ref.grad is not None and p_ref.grad.abs().max() > 0, f"{pname}: no gradient in the reference"
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        err = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)).item()
        assert err <= 1e-4, f"{name}: {pname} gradient relative error {err:.2e}"
        worst = max(worst, err)
    if rank == 0:
        print(f"{name}: loss rel {rel:.1e}, worst gradient rel {worst:.1e}")


def _all(rank: int, world: int) -> None:
    for ulysses, ring, strategy, layout, vision in CONFIGS:
        _check(rank, world, ulysses=ulysses, ring=ring, strategy=strategy, layout=layout, vision=vision)


def test_qwen3_vl_under_sp_equals_unsharded():
    """ulysses 2 x ring 2 (usp, zigzag), ring 4 (zigzag, contiguous), dp 2 x ring 2, and
    ulysses 2 x ring 2 with the vision tower shared over the 4 ranks."""
    run_ranks(4, _all)


@pytest.mark.quick
def test_describe_and_positions():
    """Shard units include the DeepStack mergers (projector); both towers' attention has
    heads; positions() is the model's own interleaved-mRoPE index, per document."""
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.strategies.data.conversation import encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    recipe = Recipe.from_dict({"model": {"preset": "qwen3_vl_tiny"}})
    family = build_plugin_manager(entry_points=False).models.for_recipe(recipe)
    model = family.build(recipe, device="cpu", seed=0)
    infos = {i.path: i for i in family.describe(model)}
    units = {p: i.modality for p, i in infos.items() if i.kind == "unit"}
    assert units["model.visual.merger"] == "projector"
    assert units["model.visual.deepstack_merger_list.0"] == units["model.visual.deepstack_merger_list.1"] == "projector"
    assert units["model.visual.blocks.2"] == "vision" and units["model.language_model.layers.2"] == "text"
    assert units["model.language_model.embed_tokens"] == "embedding" and units["lm_head"] == "head"
    text, vision = infos["model.language_model.layers.0.self_attn"], infos["model.visual.blocks.0.attn"]
    assert (text.heads, text.kv_heads, text.head_dim) == (4, 2, 16)
    assert (vision.heads, vision.kv_heads, vision.head_dim) == (4, 4, 8)

    tokenizer, image_processor = load_processor("tiny_vl")
    conversation = synthetic_conversations(seed=5, num_samples=1, min_side=28, max_side=112)[0]
    sample = encode_conversation(conversation.messages, tokenizer=tokenizer, image_processor=image_processor)
    positions = family.positions(model)(sample)  # (3, 1, L)
    expected, _ = model.model.get_rope_index(sample.input_ids[None], sample.mm_token_type_ids[None],
                                             image_grid_thw=sample.image_grid_thw)
    assert torch.equal(positions, expected)
    assert not torch.equal(positions[1], positions[2]), "image tokens get 2-D (height, width) positions"


@pytest.mark.quick
def test_keep_vision_alive_runs_deepstack_mergers():
    """A micro-batch without images but with the vision flag runs the whole tower, the
    DeepStack mergers included (FSDP units whose backward every rank must join), and
    changes nothing numerically."""
    from weft.core.models import VISION_FLAG
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    recipe = Recipe.from_dict({"model": {"preset": "qwen3_vl_tiny"}})
    family = build_plugin_manager(entry_points=False).models.for_recipe(recipe)
    model = family.build(recipe, device="cpu", seed=0)
    ids = torch.tensor([[306, 10, 11, 12, 13, 308]])  # text only
    plain = model(input_ids=ids).logits
    family.keep_vision_alive(model)
    logits = model(input_ids=ids, **{VISION_FLAG: True}).logits
    assert torch.equal(logits, plain)
    logits.sum().backward()
    visual = family.vision_tower(model)
    for name in ("merger", "deepstack_merger_list.0", "deepstack_merger_list.1", "blocks.2"):
        grads = [p.grad for p in visual.get_submodule(name).parameters()]
        assert all(g is not None for g in grads), f"visual.{name} is not in the graph"


def test_qwen3_vl_through_the_cli(weft, tmp_path):
    """As a user would: `weft check` on 4 ranks (ulysses 2 x ring 2, images), `weft plan --explain`
    with both towers' modules and their modalities, and `weft run` training it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    tiny = str(root / "recipes" / "tiny-vl.toml")
    preset = ["--set", "model.preset=qwen3_vl_tiny"]

    done = weft("check", tiny, "--world-size", "4", *preset, "--set", "parallel.ulysses=2",
                "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
    assert {"vision", "projector", "text", "embedding", "head"} <= set(result["grad_max_rel_diff_by_group"])

    done = weft("plan", tiny, *preset, "--explain", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)
    assert plan["model"] == "qwen3_vl"
    modality = {m["path"]: m["modality"] for m in plan["modules"]}
    assert modality["model.visual.blocks.0"] == "vision" and modality["model.visual.merger"] == "projector"
    assert modality["model.visual.deepstack_merger_list.0"] == "projector"
    assert modality["model.language_model.layers.0"] == "text"
    kinds = {(m["modality"], m["kind"]) for m in plan["modules"]}
    assert {("vision", "attention"), ("text", "attention")} <= kinds

    done = weft("run", tiny, *preset, "--nproc", "1", "--set", "train.max_steps=3", "--run-dir", str(tmp_path / "run"),
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"]
