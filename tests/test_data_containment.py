"""What a data file may make weft read (issue 69, items 5 and 8): images only in the formats a
dataset can mean, and, with ``data.allow_outside = false``, files only inside the data file's
folder, refused alike whether or not the target exists; and a .json array that breaks is one
exit-2 message naming the byte."""

from __future__ import annotations

import json
import os

import pytest
from PIL import EpsImagePlugin

from test_bad_data import chat, png

pytestmark = pytest.mark.quick

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n0 0 moveto 16 16 lineto stroke\n%%EOF\n"


def reasons(path, **kwargs) -> list[str | None]:
    """Each record's reason as a bad sample, or None for a sample."""
    from weft.strategies.data.datasets import BadSample, jsonl_samples

    return [r.reason if isinstance(r, BadSample) else None
            for r in jsonl_samples(path, processor="tiny_vl", **kwargs)]


def test_an_eps_named_png_is_refused_before_pillows_eps_plugin(tmp_path, monkeypatch):
    from weft.strategies.data.conversation import _open_image

    opened = []
    real_open = EpsImagePlugin.EpsImageFile._open
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append(self) or real_open(self))
    (tmp_path / "drawing.png").write_bytes(EPS)
    (tmp_path / "red.png").write_bytes(png((56, 28)))
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(chat(name)) + "\n" for name in ("drawing.png", "red.png")))

    found = reasons(path)
    assert found[0] == ("ValueError: image 'drawing.png': not an allowed image format "
                        "(PNG, JPEG, WebP, GIF, BMP or TIFF)")
    assert found[1] is None
    with pytest.raises(OSError):  # `weft generate --image`: the same formats
        _open_image({"image": str(tmp_path / "drawing.png")})
    assert not opened  # the EPS plugin (and Ghostscript behind it) never saw the file


def test_paths_leaving_the_data_folder_are_refused_alike_when_not_allowed(tmp_path):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    (elsewhere / "there.png").write_bytes(png((56, 28)))
    (data / "red.png").write_bytes(png((56, 28)))
    (data / "link-there.png").symlink_to(elsewhere / "there.png")
    (data / "link-absent.png").symlink_to(elsewhere / "absent.png")
    leaving = {  # a path to a file that exists, and the same path to one that does not
        "absolute": (str(elsewhere / "there.png"), str(elsewhere / "absent.png")),
        "dot-dot": ("../elsewhere/there.png", "../elsewhere/absent.png"),
        "symlink": ("link-there.png", "link-absent.png"),
    }
    records = [chat("red.png")] + [chat(p) for pair in leaving.values() for p in pair]
    records.append({"messages": [{"role": "user", "content": [{"type": "video", "video": "../elsewhere/clip.mp4"}]},
                                 {"role": "assistant", "content": "A clip."}]})
    path = data / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cache = tmp_path / "cache"

    allowed = reasons(path, cache_dir=cache)  # the default, as the field reads local data; fills the cache
    assert allowed[:2] == [None, None] and allowed[3] is None and allowed[5] is None
    assert allowed[2] == f"ValueError: image file {leaving['absolute'][1]!r} not found"
    assert allowed[6] == "ValueError: image file 'link-absent.png' not found"  # never the symlink's target

    refused = reasons(path, cache_dir=cache, allow_outside=False)  # the cache made above is not reused
    assert refused[0] is None
    paths = [p for pair in leaving.values() for p in pair] + ["../elsewhere/clip.mp4"]
    for reason, record_path, kind in zip(refused[1:], paths, ["image"] * 6 + ["video"]):
        assert reason == (f"ValueError: {kind} {record_path!r}: the path leaves the data folder "
                          "(data.allow_outside = false)")
    assert not os.path.exists(elsewhere / "absent.png")


def test_a_json_array_whose_records_cannot_be_told_apart_is_one_message(tmp_path):
    from weft.strategies.data.datasets import DataFileError, jsonl_lines

    good = json.dumps(chat(None)).encode()
    path = tmp_path / "records.json"
    path.write_bytes(b"[" + good + b', {"messages": "never closed}]')
    with pytest.raises(DataFileError) as caught:
        list(jsonl_lines(path))
    assert str(caught.value) == (f"data.path {str(path)!r}: not a readable JSON array: record 2 (from byte "
                                 f"{len(good) + 3:,}) does not end: an unterminated string or bracket; a .json file "
                                 "holds one array of records, a .jsonl file one record a line")


def test_a_csv_row_that_is_not_utf8_is_a_bad_record(tmp_path):
    """As a JSONL line's: refused with its place, never trained with U+FFFD in place of its bytes."""
    from weft.strategies.data.datasets import jsonl_lines
    from weft.strategies.data.record_text import Unreadable

    path = tmp_path / "alpaca.csv"
    path.write_bytes(b"instruction,output\nName it.,Red.\nName it.,R\xe9d.\n")
    rows = list(jsonl_lines(path))
    assert rows[0] == (f"{path}:2", json.dumps({"instruction": "Name it.", "output": "Red."}))
    assert rows[1] == (f"{path}:3", Unreadable("not UTF-8 (in the column 'output')"))


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_csv_or_parquet_file_that_breaks_is_one_message_naming_it(tmp_path, kind):
    """A CSV cell past a JSONL line's limit (the rows after it cannot be told apart), a damaged
    parquet file: a data-file error naming the file (exit 2 in a run), not a traceback."""
    from weft.strategies.data.datasets import DataFileError, jsonl_lines

    path = tmp_path / f"records.{kind}"
    if kind == "csv":
        path.write_text('instruction,output\nName it.,Red.\nName it.,"' + "y" * (17 << 20) + '"\n')
        said = "after line 2: field larger than field limit (16777216)"
    else:
        pytest.importorskip("pyarrow")
        path.write_bytes(b"PAR1 not a parquet file PAR1")
        said = "not a readable parquet file after row 0: ArrowInvalid"
    with pytest.raises(DataFileError) as caught:
        list(jsonl_lines(path))
    assert str(caught.value).startswith(f"data.path {str(path)!r}: {said}"), caught.value
