"""Qwen2.5-VL (and text-only Qwen2) under sequence parallelism equals the unsharded model.

transformers' own classes with tiny configs, float32, several images of different
sizes per batch. The sequence is split after the vision merge (module hooks), images
are spread over the SP ranks, 3-D mRoPE ids are computed on the whole sequence.
Loss relative difference <= 1e-5, every gradient <= 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks, sp_model

CONFIGS = [(1, 4, "ring", "zigzag"), (4, 1, "ulysses", "zigzag"), (2, 2, "usp", "zigzag"), (1, 4, "ring", "contiguous")]


def _batch(preset: str, *, pad_multiple: int):
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    tokenizer, image_processor = load_processor("tiny_vl")
    conversations = synthetic_conversations(seed=5, num_samples=3, min_side=28, max_side=112)
    samples = [encode_conversation(c.messages, tokenizer=tokenizer, image_processor=image_processor)
               for c in conversations]
    batch = collate(samples, pad_id=tokenizer.pad_token_id, pad_to_multiple_of=pad_multiple)
    if preset == "qwen2_text_tiny":
        batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    return batch


def _check(rank: int, world: int, *, preset: str, ulysses: int, ring: int, strategy: str, layout: str,
           vision: dict | None = None, plugins: tuple[str, ...] = ()) -> None:

    from weft.core.train.loss import label_count, targets, token_loss_sum
    from weft.core.train.step import shard_micro_batch as shard_batch

    model, reference, plan, mesh, split = sp_model({
        "model": {"preset": preset},
        "parallel": {"ulysses": ulysses, "ring": ring},
        "rules": [{"when": {"modality": "text"},
                   "attention": {"strategy": strategy, **({"layout": layout} if strategy != "ulysses" else {})}}]
        + ([{"when": {"modality": "vision"}, "attention": vision}] if vision else []),
    }, rank=rank, world=world, plugins=plugins)

    batch = _batch("qwen2_5_vl_tiny" if "vision" in preset or "vl" in preset else preset, pad_multiple=split.multiple)
    if "image_grid_thw" in batch:
        assert len(set(map(tuple, batch["image_grid_thw"].tolist()))) > 1, "images of different sizes"
        assert batch["image_grid_thw"].prod(-1).tolist() == [48, 16, 24]
    count = label_count(targets(batch))

    def inputs(b):
        return {k: v for k, v in b.items() if k not in ("labels", "shift_labels")}

    ref_loss = token_loss_sum(reference(**inputs(batch)).logits, targets(batch)) / count
    ref_loss.backward()

    local = shard_batch(batch, split)
    logits = model(**inputs(local)).logits  # (B, S_local, V)
    loss_part = token_loss_sum(logits, local["shift_labels"]) / count
    loss_part.backward()
    loss = loss_part.detach().clone()
    torch.distributed.all_reduce(loss)
    rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    name = f"{preset} ulysses={ulysses} ring={ring} {strategy}/{layout} vision={vision}"
    assert rel <= 1e-5, f"{name}: loss {loss.item()} vs {ref_loss.item()} (rel {rel:.2e})"
    for (pname, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        err = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)).item()
        assert err <= 1e-4, f"{name}: {pname} gradient relative error {err:.2e}"


def _all(rank: int, world: int, wide_vision_preset: str) -> None:
    for preset in ("qwen2_5_vl_tiny", "qwen2_text_tiny"):
        for ulysses, ring, strategy, layout in CONFIGS:
            _check(rank, world, preset=preset, ulysses=ulysses, ring=ring, strategy=strategy, layout=layout)
    # Vision-Ulysses: 4 vision heads over 4 SP ranks. The batch's images have 48, 16 and 24
    # patches: min_patches 40 makes the ranks share the tower (window-attention block 0 and
    # full-attention block 1 both run Ulysses over patches); 1000 spreads the images.
    for min_patches in (40, 1000):
        _check(rank, world, preset=wide_vision_preset, ulysses=2, ring=2, strategy="usp", layout="zigzag",
               vision={"strategy": "vision_ulysses", "min_patches": min_patches})


def test_vl_and_text_models_under_sp_equal_unsharded(tmp_path):
    """ring 4 (zigzag and contiguous), ulysses 4, ulysses 2 x ring 2; Qwen2.5-VL and Qwen2;
    vision-Ulysses over 4 ranks for large images."""
    import pathlib

    tiny = (pathlib.Path(__file__).resolve().parents[1] / "recipes" / "presets" / "qwen2_5_vl_tiny.toml").read_text()
    wide = tmp_path / "qwen2_5_vl_tiny_4_vision_heads.toml"
    wide.write_text(tiny.replace("num_heads = 2", "num_heads = 4"))
    run_ranks(4, _all, str(wide))


@pytest.mark.quick
def test_images_are_balanced_by_patch_count():
    from weft.strategies.sequence.model_split import assign_images

    owned = assign_images([64, 16, 16, 16, 16, 4], 2)
    loads = [sum([64, 16, 16, 16, 16, 4][i] for i in images) for images in owned]
    assert sorted(i for images in owned for i in images) == list(range(6))
    assert max(loads) - min(loads) <= 4 and owned == [[0, 5], [1, 2, 3, 4]]
    assert assign_images([5], 4) == [[0], [], [], []]
