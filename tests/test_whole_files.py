"""core/whole_files.py: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json

import pytest

from weft.core.whole_files import write_json_whole, write_lines_whole, written_whole


@pytest.mark.quick
def test_a_file_is_replaced_whole_or_left_as_it_was(tmp_path):
    path = tmp_path / "results.jsonl"
    write_lines_whole(path, ["a", "b"])
    assert path.read_text() == "a\nb\n"
    with pytest.raises(RuntimeError, match="midway"):
        with written_whole(path) as out:
            out.write("half of a new file")
            assert path.read_text() == "a\nb\n"  # the new one is not visible while written
            raise RuntimeError("midway")
    assert path.read_text() == "a\nb\n"  # the old one stands
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]  # no temporary left
    write_json_whole(path, {"k": 1}, indent=1)
    assert json.loads(path.read_text()) == {"k": 1}
    with written_whole(tmp_path / "raw.bin", mode="wb") as out:
        out.write(b"\x00\x01")
    assert (tmp_path / "raw.bin").read_bytes() == b"\x00\x01"


@pytest.mark.quick
def test_a_write_cut_off_leaves_no_file(tmp_path):
    """examples/long/retrieval_128k.py skips a data file it finds: a generator stopped by a
    signal must leave none behind."""
    target = tmp_path / "train.jsonl"
    with pytest.raises(KeyboardInterrupt):
        with written_whole(target) as out:
            out.write('{"half": ')
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
