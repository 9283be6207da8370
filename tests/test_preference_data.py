"""Preference data (strategies/data/pairs.py): TRL's and LLaMA-Factory's pair records, a pair as
one sample of its two conversations (images in the prompt held by both), bad pairs skipped and
counted; a packed micro-batch of pairs under the DPO objective equals the pairs as rows through
the unsharded model (loss and gradients) on one rank and under ring 2 and Ulysses 2; and
`weft check` with a DPO rule on a VL model passes under ring 2, Ulysses 2 and dp 2."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from distributed import run_ranks
from weft.strategies.data.pairs import is_pair, join_pair, pair_records, split_pair

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.mark.quick
def test_pair_records_read_trl_and_llama_factory_fields():
    user = {"role": "user", "content": "2 + 2?"}
    standard = pair_records({"prompt": "2 + 2?", "chosen": "four", "rejected": "5", "ref_chosen_logps": -3.0,
                             "ref_rejected_logps": -4})
    assert standard[0] == {"messages": [user, {"role": "assistant", "content": "four"}]}
    assert standard[1]["messages"][-1]["content"] == "5" and standard[2] == (-3.0, -4.0)
    conversational = pair_records({"prompt": [user], "images": ["a.png"],
                                   "chosen": [{"role": "assistant", "content": "four"}],
                                   "rejected": [{"role": "assistant", "content": "5"}]})
    assert conversational[0]["images"] == ["a.png"] and conversational[1]["messages"][0] == user
    assert conversational[2] is None
    implicit = pair_records({"chosen": [user, {"role": "assistant", "content": "four"}],
                             "rejected": [user, {"role": "assistant", "content": "5"}]})
    assert implicit[1]["messages"] == [user, {"role": "assistant", "content": "5"}]
    sharegpt = pair_records({"conversations": [{"from": "human", "value": "2 + 2?"}],
                             "chosen": {"from": "gpt", "value": "four"}, "rejected": {"from": "gpt", "value": "5"}})
    assert sharegpt[0]["conversations"][-1]["value"] == "four"
    alpaca = pair_records({"instruction": "2 + 2?", "input": "", "chosen": "four", "rejected": "5"})
    assert (alpaca[0]["output"], alpaca[1]["output"], alpaca[1]["instruction"]) == ("four", "5", "2 + 2?")
    assert is_pair({"chosen": 1, "rejected": 2}) and not is_pair({"messages": []})
    for bad, message in [
        ({"chosen": [user, {"role": "assistant", "content": "a"}], "rejected": [{"role": "user", "content": "x"},
                                                                               {"role": "assistant", "content": "b"}]},
         "differ only in their last"),
        ({"prompt": "q", "chosen": "a", "rejected": "b", "ref_chosen_logps": -1.0}, "or neither"),
        ({"prompt": "q", "chosen": "a", "rejected": "b", "ref_chosen_logps": 1.0, "ref_rejected_logps": -1.0},
         "numbers <= 0"),
        ({"prompt": "q", "chosen": [user], "rejected": "b"}, "assistant messages"),
        ({"conversations": [], "chosen": "a", "rejected": "b"}, "must be one turn"),
    ]:
        with pytest.raises(ValueError, match=message):
            pair_records(bad)


def _write_pairs(folder: pathlib.Path, *, n: int, every_image: int = 2, bad: bool = False) -> pathlib.Path:
    """``n`` pairs asking for a digit (chosen: its word, rejected: its numeral), every
    ``every_image``-th with an image in the prompt, each with reference log-probabilities."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(n):
        d = int(torch.randint(0, 10, (1,), generator=g))
        ref = [-float(torch.rand((), generator=g)) * 20 - 1 for _ in range(2)]
        record = {"prompt": f"Which digit is {d}?", "chosen": f"It is {WORDS[d]}.", "rejected": f"It is {d}.",
                  "ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
        if i % every_image == 0:
            Image.new("RGB", (56, 28), (25 * d, 90, 40)).save(folder / f"d{i}.png")
            record = {"prompt": [{"role": "user", "content": "<image>Which digit?"}], "images": [f"d{i}.png"],
                      "chosen": [{"role": "assistant", "content": WORDS[d]}],
                      "rejected": [{"role": "assistant", "content": str(d)}],
                      "ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
        lines.append(json.dumps(record))
    if bad:
        lines.append(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b", "ref_chosen_logps": -1.0}))
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _samples(path: pathlib.Path):
    from weft.strategies.data.datasets import BadSample, jsonl_samples

    out = list(jsonl_samples(path, processor="tiny_vl"))
    return [s for s in out if not isinstance(s, BadSample)], [s for s in out if isinstance(s, BadSample)]


def test_a_pair_is_one_sample_of_both_conversations(tmp_path):
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.formats import record_to_messages

    path = _write_pairs(tmp_path, n=4, bad=True)
    samples, bad = _samples(path)
    assert len(samples) == 4 and len(bad) == 1 and "or neither" in bad[0].reason and ":5" in bad[0].where
    tokenizer, image_processor = load_processor("tiny_vl")
    for sample, line in zip(samples, path.read_text().splitlines()):
        chosen, rejected = split_pair(sample)
        made = pair_records(json.loads(line))
        for half, record in ((chosen, made[0]), (rejected, made[1])):  # each as that conversation alone encodes
            alone = encode_conversation(record_to_messages(record, base=tmp_path), tokenizer=tokenizer,
                                        image_processor=image_processor)
            assert torch.equal(half.input_ids, alone.input_ids) and torch.equal(half.labels, alone.labels)
            assert (half.pixel_values is None) == (alone.pixel_values is None)
            if alone.pixel_values is not None:
                assert torch.equal(half.pixel_values, alone.pixel_values)
                assert torch.equal(half.image_grid_thw, alone.image_grid_thw)
        again = join_pair(chosen, rejected, reference=tuple(sample.reference_logps.tolist()))
        assert torch.equal(again.input_ids, sample.input_ids) and torch.equal(again.pair_split, sample.pair_split)
    # Rows: chosen, rejected, chosen, ...; each row its conversation's id.
    from weft.strategies.data.pairs import collate_pairs

    batch = collate_pairs(samples[:2], collate=lambda c: collate(c, pad_id=0), packed=False)
    assert batch["input_ids"].shape[0] == 4 and int(batch["weft_pairs"]) == 2
    assert batch["weft_sequence"][:, 0].tolist() == [0, 1, 2, 3]
    assert batch["weft_reference"].tolist() == [*samples[0].reference_logps.tolist(),
                                               *samples[1].reference_logps.tolist()]


def _packed_worker(rank: int, world: int, folder: str, strategy: str) -> None:
    import contextlib

    import structlog
    import torch.distributed as dist

    from distributed import sp_model
    from weft.core.context import RunContext
    from weft.core.recipe import Recipe
    from weft.core.train.step import run_micro_batches
    from weft.plugins.models.rope_index import document_positions
    from weft.plugins.objective import Preference, PreferenceParams
    from weft.strategies.data.conversation import collate
    from weft.strategies.data.packing import collate_packed
    from weft.strategies.data.pairs import collate_pairs

    samples, _ = _samples(pathlib.Path(folder) / "pairs.jsonl")
    recipe = {"model": {"preset": "qwen2_5_vl_tiny"}, "parallel": {strategy: world} if world > 1 else {},
              "rules": [{"when": {"modality": "text"}, "attention": {"strategy": strategy if world > 1 else "auto"}},
                        {"batching": {"strategy": "token_budget", "pack": True}}]}
    model, reference, plan, mesh, split = sp_model(recipe, rank=rank, world=world)
    model, reference = model.double(), reference.double()
    ctx = RunContext(recipe=Recipe.from_dict(recipe), device=torch.device("cpu"), rank=rank, world_size=world,
                     log=structlog.get_logger())
    params = PreferenceParams(beta=0.1, label_smoothing=0.1)

    def step(net, micro_batch, group, split_):
        return run_micro_batches(model=net, micro_batches=[micro_batch], split=split_, keep_vision=False,
                                 autocast=contextlib.nullcontext(), ctx=ctx, objective=Preference(params, group=group))

    packed = collate_pairs(samples, collate=lambda c: collate_packed(c, pad_id=0, positions=document_positions(model)),
                           packed=True)
    rows = collate_pairs(samples, collate=lambda c: collate(c, pad_id=0), packed=False)
    assert packed["input_ids"].shape[0] == 1 and int(packed["weft_doc_ids"].max()) >= 2 * len(samples) - 1
    got, units = step(model, packed, mesh.sp.get_group() if split is not None else None, split)
    dist.all_reduce(got)
    want, want_units = _alone(reference, rows, params)  # every rank alone: no collectives
    torch.testing.assert_close(got / units[0], want / want_units[0], rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        grad = p.grad.clone()
        if world > 1:
            dist.all_reduce(grad)
            grad /= world
        err = ((grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-30)).item()
        assert err <= 1e-6, f"{strategy} {name}: gradient relative error {err:.3g}"


def _alone(model, rows, params):
    """The rows' DPO loss sum and pair count through the unsharded model, without collectives."""
    from weft.core.train.loss import targets
    from weft.core.train.step import shard_micro_batch
    from weft.plugins.objective import Preference

    objective = Preference(params, group=None)
    local = shard_micro_batch(rows, None, token_keys=objective.token_keys)
    keys = (*objective.token_keys, *objective.batch_keys)
    inputs = {k: v for k, v in local.items() if k not in ("labels", *keys)}
    extra = {k: local[k] for k in keys if k in local}
    pairs = objective.units(local, targets(local))
    part = objective.loss_sum(model=model, batch=inputs, target=targets(local), fused=None, extra=extra)
    (part / pairs).backward()
    return part.detach(), torch.stack([pairs, pairs])


@pytest.mark.parametrize("world,strategy", [(1, "sdpa"), (2, "ring"), (2, "ulysses")])
def test_packed_pairs_equal_the_pairs_as_rows(tmp_path, world, strategy):
    _write_pairs(tmp_path, n=3)
    run_ranks(world, _packed_worker, str(tmp_path), strategy)


RECIPE = """
[model]
preset = "qwen2_5_vl_tiny"

[data]
source = "jsonl"
path = "pairs.jsonl"

[train]
max_steps = 2
seed = 0
micro_batch_tokens = 1024
precision = "fp32"

[parallel]
nproc = 2

[[rules]]
objective = { strategy = "dpo", beta = 0.1, label_smoothing = 0.05 }
"""


def test_weft_check_with_a_dpo_rule(tmp_path):
    from weft_cli import run_weft

    _write_pairs(tmp_path, n=32, every_image=1)
    (tmp_path / "dpo.toml").write_text(RECIPE)
    for sets in (["parallel.ring=2"], ["parallel.ulysses=2"], ["parallel.dp_shard=2"],
                 ["parallel.ring=2", "train.loss=fused"]):  # the head by chunks from the hidden states
        done = run_weft("check", "dpo.toml", "--world-size", "2", *(a for s in sets for a in ("--set", s)), "--json",
                        cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
        assert 0.1 < result["loss_ref"] < 5 and {"vision", "text", "head"} <= set(result["grad_max_rel_diff_by_group"])


LORA_REFERENCE = RECIPE.replace('objective = { strategy = "dpo", beta = 0.1, label_smoothing = 0.05 }', """\
objective = { strategy = "dpo", beta = 5.0, reference = "adapters" }

[[rules]]
when = { path = "*.language_model.*" }
adapter = { strategy = "lora", r = 4, b_init = "normal" }""")


def test_weft_check_with_the_adapters_off_as_reference(tmp_path):
    """LoRA DPO with the base as its reference (one more forward, adapters off): the adapters'
    loss and gradients under ring 2, Ulysses 2 and FSDP2 dp 2 equal one rank's (B drawn, so the
    policy is not its reference and the loss is not ln 2)."""
    from weft_cli import run_weft

    _write_pairs(tmp_path, n=16, every_image=1)
    (tmp_path / "lora.toml").write_text(LORA_REFERENCE)
    for mesh in ("parallel.ring=2", "parallel.ulysses=2", "parallel.dp_shard=2"):
        done = run_weft("check", "lora.toml", "--world-size", "2", "--set", mesh, "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
        assert abs(result["loss_ref"] - 0.693147) > 1e-3, result


def test_weft_eval_writes_the_reference_log_probabilities(tmp_path):
    """`weft eval --reference OUT`: every pair of the data with the model's summed response
    log-probabilities (TRL's columns, the record's own replaced), the bad record skipped and
    named; the same values under ring 2 as on one rank; and DPO on OUT with the same weights
    starts at ln 2 with the policy's log-probabilities equal to the written ones (each pair's
    chosen and rejected in their places: the rewards are zero, not only their difference)."""
    from weft_cli import run_weft

    _write_pairs(tmp_path, n=6, every_image=2, bad=True)
    (tmp_path / "dpo.toml").write_text(RECIPE)
    written = {}
    for name, sets in (("one", ("--nproc", "1")), ("ring", ("--nproc", "2", "--set", "parallel.ring=2"))):
        done = run_weft("eval", "dpo.toml", *sets, "--reference", f"{name}.jsonl", "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["pairs"] == 6 and result["skipped"] == 1 and "pairs.jsonl:7" in result["bad"][0], result
        written[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    source = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()][:6]
    for mine, theirs, record in zip(written["one"], written["ring"], source):
        assert {k: v for k, v in mine.items() if not k.startswith("ref_")} == \
            {k: v for k, v in record.items() if not k.startswith("ref_")}
        assert mine["ref_chosen_logps"] != record["ref_chosen_logps"]  # computed, not copied
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            assert mine[key] < 0 and abs(mine[key] - theirs[key]) <= 1e-5 * abs(mine[key]), (key, mine, theirs)
    done = run_weft("run", "dpo.toml", "--nproc", "1", "--run-dir", "run", "--set", "data.path=one.jsonl",
                    "--set", "train.max_steps=1", "--set", "train.micro_batch_tokens=4096", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert abs(row["loss"] - 0.693147) < 1e-5 and abs(row["reward_chosen"]) < 1e-5, row
    mean = sum(r["ref_chosen_logps"] for r in written["one"]) / 6
    assert abs(row["logps_chosen"] - mean) <= 1e-5 * abs(mean), (row, mean)


def test_weft_check_with_a_dpo_rule_under_usp(tmp_path):
    """Ring 2 x Ulysses 2 (USP, 4 ranks): the DPO loss and every gradient the unsharded model's.
    (weft check compares unpacked micro-batches; packed pairs under ring and Ulysses:
    test_packed_pairs_equal_the_pairs_as_rows.)"""
    from weft_cli import run_weft

    _write_pairs(tmp_path, n=16, every_image=2)
    (tmp_path / "dpo.toml").write_text(RECIPE)
    done = run_weft("check", "dpo.toml", "--world-size", "4", "--set", "parallel.ring=2", "--set",
                    "parallel.ulysses=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
    assert 0.1 < result["loss_ref"] < 5, result


def test_held_out_pairs_give_the_preference_metrics(tmp_path):
    """[eval] of a DPO run on pairs: each evaluation row carries the held-out loss, rewards,
    margin and preference accuracy (means over the pairs); `weft eval` of the run's last
    checkpoint gives the same loss and preference accuracy, and `weft report` names it."""
    from weft_cli import run_weft

    _write_pairs(tmp_path, n=8, every_image=2)
    recipe = RECIPE.replace("max_steps = 2", "max_steps = 2\nlr = 1e-3").replace(
        "[parallel]", "[eval]\nevery = 1\n\n[parallel]")
    (tmp_path / "dpo.toml").write_text(recipe)
    done = run_weft("run", "dpo.toml", "--nproc", "1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    held = [r for r in rows if "eval_loss" in r]
    assert len(held) == 2 and all(r["eval_pairs"] == 8 and "eval_tokens" not in r for r in held)
    for row in held:
        assert 0 <= row["eval_preference_accuracy"] <= 1 and "eval_reward_margin" in row, row
        assert row["eval_reward_chosen"] - row["eval_reward_rejected"] == pytest.approx(row["eval_reward_margin"])
    done = run_weft("eval", "dpo.toml", "--nproc", "1", "--run-dir", "run", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["loss"] == pytest.approx(held[-1]["eval_loss"], rel=1e-6)
    assert result["preference_accuracy"] == pytest.approx(held[-1]["eval_preference_accuracy"])
    report = run_weft("report", "run", cwd=tmp_path)
    assert report.returncode == 0 and "held-out preference accuracy" in report.stdout, report.stdout
