"""The files and records people bring: a JSON array file (LLaVA ships its instruction data so)
reads as the JSONL of its records, through the store too; Alpaca records are the chat they
mean; a .json file that is not one array is exit 2 naming data.path."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from weft.strategies.data.datasets import BadSample, jsonl_samples, jsonl_store
from weft_cli import run_weft


def _same(a, b):
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert (a.pixel_values is None) == (b.pixel_values is None)
    if a.pixel_values is not None:
        assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "coco").mkdir()
    Image.new("RGB", (84, 56), (200, 30, 30)).save(tmp_path / "coco" / "red.png")
    return tmp_path


LLAVA = [
    {"id": "1", "image": "coco/red.png",
     "conversations": [{"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": "Red."}]},
    {"id": "2", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
    {"id": "3", "image": "coco/missing.png",
     "conversations": [{"from": "human", "value": "<image>\nAnd this?"}, {"from": "gpt", "value": "Blue."}]},
]


@pytest.mark.quick
def test_a_json_array_file_reads_as_its_records_lines(folder):
    (folder / "llava.json").write_text(json.dumps(LLAVA, indent=2))  # as LLaVA ships it: one array
    (folder / "llava.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LLAVA))
    array = list(jsonl_samples(folder / "llava.json", processor="tiny_vl"))
    lines = list(jsonl_samples(folder / "llava.jsonl", processor="tiny_vl"))
    assert [type(s) for s in array] == [type(s) for s in lines]
    _same(array[0], lines[0])
    _same(array[1], lines[1])
    assert isinstance(array[2], BadSample) and array[2].where.endswith("llava.json:record 3")
    store = jsonl_store(folder / "llava.json", processor="tiny_vl", cache_dir=folder / "cache")
    assert len(store) == 2 and store.bad[0][0].endswith("llava.json:record 3")
    _same(store[0], lines[0])


@pytest.mark.quick
def test_alpaca_records_are_the_chat_they_mean(folder):
    records = [
        {"instruction": "Name the colour.", "input": "A ripe tomato", "output": "Red."},
        {"instruction": "Say hi.", "input": "", "output": "Hi.", "system": "Be brief.",
         "history": [["Who are you?", "A model."]]},
        {"instruction": "<image>What colour is it?", "output": "Red.", "images": ["coco/red.png"]},
        {"instruction": "Name it.", "output": 3},  # not a string: a bad sample
    ]
    chat = [
        {"messages": [{"role": "user", "content": "Name the colour.\n\nA ripe tomato"},
                      {"role": "assistant", "content": "Red."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"},
                      {"role": "assistant", "content": "A model."}, {"role": "user", "content": "Say hi."},
                      {"role": "assistant", "content": "Hi."}]},
        {"messages": [{"role": "user", "content": "<image>What colour is it?"},
                      {"role": "assistant", "content": "Red."}], "images": ["coco/red.png"]},
    ]
    (folder / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    alpaca = list(jsonl_samples(folder / "alpaca.jsonl", processor="tiny_vl"))
    same = list(jsonl_samples(folder / "chat.jsonl", processor="tiny_vl"))
    for a, b in zip(alpaca[:3], same):
        _same(a, b)
    assert alpaca[2].pixel_values is not None
    assert isinstance(alpaca[3], BadSample) and "Alpaca 'output' must be a string" in alpaca[3].reason


def test_a_json_file_that_is_not_an_array_is_exit_2(folder):
    (folder / "one.json").write_text(json.dumps(LLAVA[1]))
    (folder / "r.toml").write_text('[model]\npreset = "qwen2_5_vl_tiny"\n[data]\nsource = "jsonl"\npath = "one.json"\n'
                                   '[train]\nmax_steps = 1\n')
    done = run_weft("run", str(folder / "r.toml"), "--nproc", "1", "--run-dir", str(folder / "run"), cwd=folder)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "data.path" in done.stderr and "one JSON array of records" in done.stderr and "dict" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.quick
def test_max_pixels_resizes_as_the_processor_does(folder):
    """data.min_pixels / data.max_pixels: images over and under the budget come out as the model's
    own image processor sizes them for it (its smart_resize), in the store as in memory."""
    from weft.strategies.data.conversation import load_processor

    sizes = {"big": (448, 336), "small": (40, 30), "middle": (112, 84)}
    for name, size in sizes.items():
        Image.new("RGB", size, (20, 120, 220)).save(folder / "coco" / f"{name}.png")
    records = [{"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A."}],
                "images": [f"coco/{name}.png"]} for name in sizes]
    (folder / "sized.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    budget = (56 * 56, 112 * 112)
    _, processor = load_processor("tiny_vl")
    for pixels in ((0, 0), budget, (0, budget[1])):
        resized = list(jsonl_samples(folder / "sized.jsonl", processor="tiny_vl", pixels=pixels))
        store = jsonl_store(folder / "sized.jsonl", processor="tiny_vl", cache_dir=folder / "cache", pixels=pixels)
        own = {"shortest_edge": pixels[0] or processor.size.shortest_edge,
               "longest_edge": pixels[1] or processor.size.longest_edge}
        for n, name in enumerate(sizes):
            with Image.open(folder / "coco" / f"{name}.png") as image:
                want = processor(images=[image.convert("RGB")], return_tensors="pt", size=own)
            assert torch.equal(resized[n].image_grid_thw, want["image_grid_thw"]), (pixels, name)
            assert torch.equal(resized[n].pixel_values, want["pixel_values"].float())
            _same(store[n], resized[n])
        t, h, w = resized[0].image_grid_thw[0].tolist()
        if pixels == budget:  # the big one shrunk into the budget, the small one grown to its least
            assert h * w * 14 * 14 <= budget[1] < 448 * 336
            assert resized[1].image_grid_thw[0].prod() * 14 * 14 >= budget[0] > 40 * 30
        if pixels == (0, 0):
            assert h * w * 14 * 14 > budget[1]  # the folder's own budget keeps it larger


def test_csv_parquet_a_saved_dataset_and_a_folder_read_as_the_jsonl(folder):
    """The same records as CSV rows, parquet rows, a Hugging Face dataset saved to disk (its
    DatasetDict's split), and a folder of files give the JSONL's tokens and pixels."""
    import datasets

    chat = [
        {"messages": [{"role": "user", "content": "<image>What colour is it?"},
                      {"role": "assistant", "content": "Red."}], "images": ["coco/red.png"]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]},
    ]
    alpaca = [{"instruction": "Name the colour.", "input": "A ripe tomato", "output": "Red."},
              {"instruction": "Say hi.", "input": "", "output": "Hi."}]
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (folder / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))
    want = list(jsonl_samples(folder / "chat.jsonl", processor="tiny_vl"))
    want_alpaca = list(jsonl_samples(folder / "alpaca.jsonl", processor="tiny_vl"))
    # CSV: Alpaca columns as they are, a messages / images column as JSON text.
    import csv

    with (folder / "alpaca.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(alpaca)
    with (folder / "chat.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["messages", "images"])
        writer.writeheader()
        writer.writerows({"messages": json.dumps(r["messages"]), "images": json.dumps(r.get("images", ""))
                          if "images" in r else ""} for r in chat)
    dataset = datasets.Dataset.from_list(chat)
    dataset.to_parquet(str(folder / "chat.parquet"))
    datasets.DatasetDict({"train": dataset, "validation": dataset.select([1])}).save_to_disk(str(folder / "saved"))
    (folder / "several").mkdir()
    (folder / "several" / "coco").symlink_to(folder / "coco")
    (folder / "several" / "a.jsonl").write_text(json.dumps(chat[0]) + "\n")
    (folder / "several" / "b.json").write_text(json.dumps([chat[1]]))
    for path, expected in ((folder / "chat.csv", want), (folder / "alpaca.csv", want_alpaca),
                           (folder / "chat.parquet", want), (folder / "saved", want), (folder / "several", want)):
        got = list(jsonl_samples(path, processor="tiny_vl"))
        assert len(got) == len(expected) and not any(isinstance(s, BadSample) for s in got), (path, got)
        for a, b in zip(got, expected):
            _same(a, b)
    store = jsonl_store(folder / "saved", processor="tiny_vl", cache_dir=folder / "cache")
    held_out = jsonl_store(folder / "saved", processor="tiny_vl", cache_dir=folder / "cache", split="validation")
    assert len(store) == 2 and len(held_out) == 1 and store.folder != held_out.folder and store.folder.is_dir()
    _same(store[0], want[0])
    _same(held_out[0], want[1])
