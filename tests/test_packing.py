"""Packed documents through ring, Ulysses and USP equal the documents run one by one (float32)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks, sp_model
from weft.strategies.attention.document_mask import document_mask
from weft.strategies.data.packing import collate_packed, pack_documents


@pytest.mark.quick
def test_document_mask_directly():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    index = torch.arange(6)
    mask = document_mask(docs, docs, index, index, causal=True)[0, 0]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, want)
    full = document_mask(docs, docs, index, index, causal=False)[0, 0]
    assert full[2, 4] and not full[1, 2]
    # A block of rows 4-5 against keys 0-2 (another rank's part): only row 4 sees key 2.
    part = document_mask(docs[:, 4:], docs[:, :3], index[4:], index[:3], causal=True)[0, 0]
    assert part.tolist() == [[False, False, True], [False, False, False]]


@pytest.mark.quick
def test_pack_documents_fills_rows_up_to_the_budget():
    rows = list(pack_documents([30, 50, 20, 70, 10, 40], budget=100, seed=0, epoch=0))
    lengths = [30, 50, 20, 70, 10, 40]
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 100 for row in rows) and len(rows) <= 3


CONFIGS = [(1, 1, "auto"), (1, 4, "ring"), (4, 1, "ulysses"), (2, 2, "usp")]


def _worker(rank: int, world: int) -> None:

    from weft.core.train.loss import label_count, targets, token_loss_sum
    from weft.core.train.step import shard_micro_batch as shard_batch
    from weft.plugins.models.rope_index import document_positions
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    tokenizer, image_processor = load_processor("tiny_vl")
    conversations = synthetic_conversations(seed=9, num_samples=3, min_side=28, max_side=84)
    samples = [encode_conversation(c.messages, tokenizer=tokenizer, image_processor=image_processor)
               for c in conversations]
    for preset in ("qwen2_5_vl_tiny", "qwen2_text_tiny"):
        for ulysses, ring, strategy in CONFIGS:
            sub = ulysses * ring
            model, reference, plan, mesh, split = sp_model({
                "model": {"preset": preset},
                "parallel": {"ulysses": ulysses, "ring": ring, "dp_shard": world // sub},
                "rules": [{"when": {"modality": "text"}, "attention": {"strategy": strategy}},
                          {"batching": {"strategy": "token_budget", "pack": True}}],
            }, rank=rank, world=world)

            docs = (samples if preset == "qwen2_5_vl_tiny"
                    else [type(s)(input_ids=s.input_ids, labels=s.labels) for s in samples])
            keep = ("input_ids", "labels") if preset == "qwen2_text_tiny" else None
            # Reference: each document alone through the unsharded model.
            ref_sum, count = 0.0, 0
            for doc in docs:
                batch = collate([doc], pad_id=tokenizer.pad_token_id)
                batch = {k: v for k, v in batch.items() if keep is None or k in keep}
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                ref_sum += token_loss_sum(reference(**inputs).logits, targets(batch)).item()
                count += int(label_count(targets(batch)))
            packed = collate_packed(docs, pad_id=tokenizer.pad_token_id,
                                    pad_to_multiple_of=split.multiple if split else 1,
                                    positions=document_positions(model))
            assert packed["input_ids"].shape[0] == 1 and int(packed["weft_doc_ids"].max()) >= 2
            local = shard_batch(packed, split) if split else packed
            inputs = {k: v for k, v in local.items() if k != "shift_labels"}
            loss = token_loss_sum(model(**inputs).logits, local["shift_labels"]).detach()
            if split is not None:
                torch.distributed.all_reduce(loss, group=mesh.sp.get_group())
            rel = abs(loss.item() - ref_sum) / abs(ref_sum)
            assert rel <= 1e-5, (f"{preset} ulysses={ulysses} ring={ring} {strategy}: "
                                 f"packed {loss.item()} vs one by one {ref_sum} (rel {rel:.2e})")


def test_packed_batch_through_each_strategy_equals_documents_one_by_one():
    run_ranks(4, _worker)
