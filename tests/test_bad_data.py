"""A dataset with 16 kinds of broken lines and images runs to the end; each one is reported."""

from __future__ import annotations

import io
import json
import pathlib
import struct
import zlib

import pytest
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]


def png(size, mode="RGB", colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else colour + (128,)).save(buffer, format="PNG")
    return buffer.getvalue()


def chat(image: str | None, question: str = "What colour is it?", answer: str = "It is red.") -> dict:
    user = [{"type": "text", "text": question}] + ([{"type": "image", "image": image}] if image else [])
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


BROKEN = {
    "malformed JSON": '{"messages": [',
    "no messages key": json.dumps({"foo": 1}),
    "empty conversation": json.dumps({"messages": []}),
    "missing image file": json.dumps(chat("images/nowhere.png")),
    "truncated PNG": json.dumps(chat("images/truncated.png")),
    "text file named .png": json.dumps(chat("images/not-an-image.png")),
    "zero-byte image": json.dumps(chat("images/empty.png")),
    "unknown content part": json.dumps({
        "messages": [
            {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
            {"role": "assistant", "content": "hm"},
        ]
    }),
    "unknown role": json.dumps({
        "messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]
    }),
    "no assistant turn": json.dumps({"messages": [{"role": "user", "content": "hello?"}]}),
    "image token in text": json.dumps(chat("images/red.png", question="Look: <|image_pad|><|image_pad|>")),
    "placeholders vs images": json.dumps({
        "messages": [
            {"role": "user", "content": "<image><image>Two?"},
            {"role": "assistant", "content": "One."},
        ],
        "images": ["images/red.png"],
    }),
    "JSON array line": "[1, 2, 3]",
    "content is a number": json.dumps({
        "messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "seven"}]
    }),
    "decompression bomb": json.dumps(chat("images/bomb.png")),
    "line over 16 MiB": json.dumps({"messages": "x" * (17 << 20)}),
}


def bomb_png(width: int = 40_000, height: int = 40_000) -> bytes:
    """A PNG header declaring 1.6 billion pixels, with no pixel data: opening it is enough
    to find out, decoding it would take the machine's memory."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def make_dataset(folder: pathlib.Path) -> tuple[pathlib.Path, dict[int, str]]:
    images = folder / "images"
    images.mkdir(parents=True)
    (images / "red.png").write_bytes(png((56, 84)))
    (images / "rgba.png").write_bytes(png((84, 56), mode="RGBA"))
    Image.new("CMYK", (70, 42), (0, 200, 200, 0)).save(images / "cmyk.jpg")
    (images / "truncated.png").write_bytes(png((64, 64))[:60])
    (images / "not-an-image.png").write_text("this is text")
    (images / "empty.png").write_bytes(b"")
    (images / "bomb.png").write_bytes(bomb_png())
    good = [
        json.dumps(chat("images/red.png")),
        json.dumps(chat("images/rgba.png", answer="It is red and half transparent.")),
        json.dumps(chat("images/cmyk.jpg", answer="It is cyan.")),
        json.dumps({
            "messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
            "images": ["images/red.png"],
        }),
        json.dumps({
            "conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "Red."}],
            "images": ["images/rgba.png"],
        }),
    ]
    lines, bad_lines = [], {}
    for i, (kind, line) in enumerate(BROKEN.items()):
        lines.append(good[i % len(good)])
        lines.append(line)
        bad_lines[len(lines)] = kind
        lines.append("")  # blank lines are not samples
    lines += good * 2
    path = folder / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, bad_lines


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


def test_broken_dataset_runs_to_the_end_and_reports_each_line(weft, dataset, tmp_path):
    path, bad_lines = dataset
    assert len(bad_lines) >= 10
    run_dir = tmp_path / "run"
    done = weft("run", str(ROOT / "recipes" / "tiny-vl.toml"),
                "--set", "data.source='jsonl'", "--set", f"data.path='{path}'",
                "--set", "train.max_steps=3", "--set", "train.micro_batch_tokens=256",
                "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_samples"] == len(bad_lines) and summary["steps"] == 3
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    reported = {int(e["where"].rsplit(":", 1)[1]): e["reason"] for e in events if e["event"] == "data.skipped"}
    assert sorted(reported) == sorted(bad_lines), (reported, bad_lines)
    assert all(e["where"].startswith(str(path)) for e in events if e["event"] == "data.skipped")
    assert "image-token count" in reported[next(n for n, k in bad_lines.items() if k == "image token in text")]
    assert "malformed JSON" in reported[next(n for n, k in bad_lines.items() if k == "malformed JSON")]
    line_of = {kind: number for number, kind in bad_lines.items()}
    assert "decompression bomb" in reported[line_of["decompression bomb"]]
    assert "over the 16,777,216-byte limit" in reported[line_of["line over 16 MiB"]]


def test_strict_data_stops_at_the_first_bad_line(weft, dataset, tmp_path):
    path, bad_lines = dataset
    done = weft("run", str(ROOT / "recipes" / "tiny-vl.toml"), "--nproc", "1",
                "--set", "data.source='jsonl'", "--set", f"data.path='{path}'",
                "--set", "data.strict=true", "--run-dir", str(tmp_path / "strict"), cwd=tmp_path)

    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{path}:{min(bad_lines)}" in done.stderr and "data.strict" in done.stderr


@pytest.mark.quick
def test_images_past_skip_pixels_are_skipped_and_counted(tmp_path):
    """data.skip_pixels: an image of more pixels is a bad sample named by its line (read from
    the header, never decoded); a cache filled under a looser limit is not reused."""
    from weft.strategies.data.datasets import BadSample, jsonl_samples

    images = tmp_path / "images"
    images.mkdir()
    (images / "big.png").write_bytes(png((84, 56)))  # 4,704 pixels
    (images / "small.png").write_bytes(png((56, 28)))  # 1,568 pixels
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(chat(f"images/{name}.png")) for name in ("big", "small", "big")) + "\n")
    cache = tmp_path / "cache"

    def results(skip_pixels):
        return list(jsonl_samples(path, processor="tiny_vl", cache_dir=cache, skip_pixels=skip_pixels))

    assert not any(isinstance(r, BadSample) for r in results(0))  # fills the cache
    limited = results(3000)
    assert [isinstance(r, BadSample) for r in limited] == [True, False, True]
    assert limited[0].where == f"{path}:1"
    assert "84x56 = 4,704 pixels, over data.skip_pixels = 3,000" in limited[0].reason


def corrupted_chunk_png() -> bytes:
    """A PNG whose image data is split over two IDAT chunks, the second one's type corrupted:
    its header reads, and decoding stops midway with Pillow's `SyntaxError: broken PNG file`."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    whole = png((56, 84))
    start = whole.find(b"IDAT") - 4
    (size,) = struct.unpack(">I", whole[start:start + 4])
    data = whole[start + 8:start + 8 + size]
    return whole[:start] + chunk(b"IDAT", data[:size // 2]) + chunk(b"ID\x00T", data[size // 2:]) \
        + whole[start + 12 + size:]


def test_records_that_fail_to_decode_are_skipped_with_their_place(weft, tmp_path):
    """Issue 69 (items 4, 7, 8): a PNG that fails mid-decode, a line nested 100,000 deep, a line
    and a .json record that are not UTF-8, and (data.allow_outside = false) an image path leaving
    the data folder, among good samples: the run completes, each one skipped and counted with its
    file:line (file:record N)."""
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "red.png").write_bytes(png((56, 84)))
    (folder / "images" / "chunk.png").write_bytes(corrupted_chunk_png())
    (tmp_path / "beside.png").write_bytes(png((56, 84)))  # readable, but outside the data folder
    good = json.dumps(chat("images/red.png")).encode()
    lines = [good, json.dumps(chat("images/chunk.png")).encode(), b"[" * 100_000 + b"]" * 100_000,
             good.replace(b"What", b"Wh\xff\xfet"), good, json.dumps(chat("../beside.png")).encode(), good]
    (folder / "chat.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "records.json").write_bytes(b"[" + good + b",\n" + good.replace(b"What", b"Wh\xe9t") + b",\n" + good
                                          + b"]")
    run_dir = tmp_path / "run"
    done = weft("run", str(ROOT / "recipes" / "tiny-vl.toml"), "--nproc", "1",
                "--set", "data.source='jsonl'", "--set", f"data.path='{folder}'", "--set", "data.workers=0",
                "--set", "data.allow_outside=false", "--set", "train.max_steps=1",
                "--set", "train.micro_batch_tokens=256", "--run-dir", str(run_dir), cwd=tmp_path)

    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    jsonl, array = folder / "chat.jsonl", folder / "records.json"
    expected = {f"{jsonl}:2": "cannot be decoded: SyntaxError: broken PNG file",
                f"{jsonl}:3": "JSON nested deeper than Python's parser reads",
                f"{jsonl}:4": "not UTF-8: byte 0xff at offset 71 of the line",
                f"{jsonl}:6": "image '../beside.png': the path leaves the data folder",
                f"{array}:record 2": "not UTF-8: byte 0xe9 at offset"}
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    reported = {e["where"]: e["reason"] for e in events if e["event"] == "data.skipped"}
    assert sorted(reported) == sorted(expected), reported
    for where, reason in expected.items():
        assert reason in reported[where], (where, reported[where])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_samples"] == len(expected) and summary["steps"] == 1
