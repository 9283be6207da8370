"""The files and folders people bring, as (where, one JSON record) pairs: what preprocessing
reads (strategies/data/preprocess.py takes a record as one JSON line, whatever file it came from).

- ``.jsonl``: one record a line, read a line at a time (an oversized line as its size only);
- ``.json``: one JSON array of records, as LLaVA ships its instruction data (``file:record N``);
- ``.csv``: one record a row, its header the keys (Alpaca's instruction/input/output columns, or
  a ``messages`` / ``conversations`` / ``images`` / ``videos`` column holding JSON text);
- ``.parquet``: one record a row, nested columns as they are (pyarrow, the ``datasets`` extra);
- a folder a Hugging Face ``datasets`` dataset was saved to (``save_to_disk``; a DatasetDict's
  ``data.split``), read offline with ``datasets.load_from_disk``;
- any other folder: its files of the kinds above, in sorted order, as one dataset.

A row's empty cells (None: a column other rows have) are left out of its record. Images are
paths, relative to the data file's folder (or a saved dataset's; to the folder itself when
``data.path`` is a folder of data files);
a ``datasets`` Image column is read as its files' paths (images embedded as bytes are not read yet).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Iterator

from weft.strategies.data.record_text import Unreadable, array_pieces, escaped_bytes, line_text

#: The file kinds a folder of data files may hold, by suffix.
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
#: CSV cells under these columns hold JSON text (a list of messages, of image paths).
_JSON_COLUMNS = ("messages", "conversations", "images", "videos", "history")


class DataFileError(ValueError):
    """The data file as a whole cannot be read (not one bad sample): the user's error."""


def is_saved_dataset(path: pathlib.Path) -> bool:
    """A folder ``datasets``' save_to_disk wrote (a Dataset's state.json or a DatasetDict's dict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def data_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The files ``path`` stands for: itself, a saved dataset's files, or a folder's data files."""
    if path.is_file():
        return [path]
    if is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def base_of(path: pathlib.Path) -> pathlib.Path:
    """The folder a record's image and video paths are relative to: a data file's own folder (a
    saved dataset is one file in this: the folder it lies in), or a folder of data files itself."""
    return path if path.is_dir() and not is_saved_dataset(path) else path.parent


def data_key(path: pathlib.Path) -> str:
    """Names one version of the data: each of its files' path, size and modification time."""
    digest = hashlib.sha256(str(path.resolve()).encode())
    for file in data_files(path):
        stat = file.stat()
        digest.update(f"{file.relative_to(path) if file != path else ''}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def records(path: pathlib.Path, *, split: str = "train",
            max_line_bytes: int) -> Iterator[tuple[str, str | int | Unreadable]]:
    """(where, the record as one JSON line) for every record of ``path``; a JSONL line over
    ``max_line_bytes`` as its size in bytes, a record whose bytes are not UTF-8 as Unreadable (the
    encoder reports both as bad samples)."""
    if path.is_dir():
        if is_saved_dataset(path):
            yield from _saved_dataset(path, split=split)
            return
        files = data_files(path)
        if not files:
            raise DataFileError(f"data.path {str(path)!r}: a folder with no data file ({', '.join(SUFFIXES)}) and "
                                "no saved dataset")
        for file in files:
            yield from records(file, split=split, max_line_bytes=max_line_bytes)
        return
    if path.suffix == ".csv":
        yield from _csv_records(path, max_cell_bytes=max_line_bytes)
        return
    reader = {".json": _array_records, ".parquet": _parquet_records}.get(path.suffix)
    if reader is not None:
        yield from reader(path)
        return
    with path.open("rb") as handle:
        for number, line in enumerate(_bounded_lines(handle, limit=max_line_bytes), start=1):
            if isinstance(line, int) or line.strip():
                yield f"{path}:{number}", line if isinstance(line, int) else line_text(line)


def _array_records(path: pathlib.Path) -> Iterator[tuple[str, str | Unreadable]]:
    """A JSON array file's records, numbered from 1. The whole array is parsed at once (by the
    process that preprocesses: rank 0), so an array file is bounded by that process's memory;
    JSONL is read a line at a time. An array that does not parse whole (bytes that are not UTF-8,
    a record nested too deep, a malformed record) is read a record at a time, each that cannot be
    read a bad sample of its own (strategies/data/record_text.py)."""
    data = path.read_bytes()
    try:
        found = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        try:
            for number, piece in enumerate(array_pieces(data), start=1):
                yield f"{path}:record {number}", piece
        except ValueError as error:  # the records cannot be told apart from here on
            raise DataFileError(f"data.path {str(path)!r}: not a readable JSON array: {error}; a .json "
                                "file holds one array of records, a .jsonl file one record a line") from None
        return
    if not isinstance(found, list):
        raise DataFileError(f"data.path {str(path)!r}: a .json file holds one JSON array of records; this one "
                            f"holds a {type(found).__name__} (one record a line: name the file .jsonl)")
    for number, record in enumerate(found, start=1):
        yield f"{path}:record {number}", json.dumps(record)


def _csv_records(path: pathlib.Path, *, max_cell_bytes: int) -> Iterator[tuple[str, str | Unreadable]]:
    import csv

    # A cell may be as long as a JSONL line may: csv's own limit (128 Ki characters) is less than a long
    # conversation's messages cell. The limit is the process's; it is only ever raised here.
    csv.field_size_limit(max(csv.field_size_limit(), max_cell_bytes))
    # Bytes that are not UTF-8 kept as markers (U+DC80-U+DCFF), so their row is refused, not trained
    # with U+FFFD in their place.
    with path.open(newline="", encoding="utf-8", errors="surrogateescape") as handle:
        rows = csv.DictReader(handle)
        try:
            yield from _csv_rows(path, rows)
        except csv.Error as error:  # a cell over the limit: the rows after it cannot be told apart
            raise DataFileError(f"data.path {str(path)!r}: after line {rows.line_num}: {error} (the most a cell holds "
                                "is a JSONL line's limit)") from None


def _csv_rows(path: pathlib.Path, rows) -> Iterator[tuple[str, str | Unreadable]]:
    for number, row in enumerate(rows, start=2):  # the header is line 1
        broken = sorted(str(key) for key, value in row.items() if _not_utf8(key) or _not_utf8(value))
        if broken:
            yield f"{path}:{number}", Unreadable(f"not UTF-8 (in the column {broken[0]!r})")
            continue
        record = {}
        for key, value in row.items():
            if key is None or value in (None, ""):
                continue  # a ragged row's extra cells, an empty cell
            if key in _JSON_COLUMNS and value.lstrip()[:1] in ("[", "{"):
                try:
                    value = json.loads(value)
                except (json.JSONDecodeError, RecursionError):
                    pass  # left as text: the record is then refused with its reason
            record[key] = value
        yield f"{path}:{number}", json.dumps(record)


def _not_utf8(cell) -> bool:
    """A CSV cell (or a ragged row's list of them) holding bytes that were not UTF-8."""
    return any(isinstance(c, str) and escaped_bytes(c) for c in (cell if isinstance(cell, list) else [cell]))


def _parquet_records(path: pathlib.Path) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise DataFileError(f"data.path {str(path)!r}: reading parquet needs pyarrow (pip install "
                            "'weft[datasets]')") from None
    number = 0
    try:
        for batch in parquet.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield f"{path}:row {number}", _row_json(row)
    except Exception as error:  # pyarrow's: a damaged or truncated file, read no further
        raise DataFileError(f"data.path {str(path)!r}: not a readable parquet file after row {number}: "
                            f"{type(error).__name__}: {error}") from None


def _saved_dataset(path: pathlib.Path, *, split: str) -> Iterator[tuple[str, str]]:
    try:
        import datasets
    except ImportError:
        raise DataFileError(f"data.path {str(path)!r} is a saved Hugging Face dataset; reading it needs the "
                            "datasets package (pip install 'weft[datasets]')") from None
    try:
        found = datasets.load_from_disk(str(path))
    except Exception as error:  # a damaged state.json or arrow file: the folder as a whole
        raise DataFileError(f"data.path {str(path)!r}: not a readable saved dataset: {type(error).__name__}: "
                            f"{error}") from None
    if isinstance(found, datasets.DatasetDict):
        if split not in found:
            raise DataFileError(f"data.split {split!r}: the dataset at {str(path)!r} has the splits "
                                f"{', '.join(found)}")
        found = found[split]
    for column, feature in found.features.items():  # an Image column: its files, not decoded images
        if isinstance(feature, datasets.Image):
            found = found.cast_column(column, datasets.Image(decode=False))
    for number, row in enumerate(found, start=1):
        yield f"{path}:row {number}", _row_json(row)


def _row_json(row: dict) -> str:
    """A table row as a record: None cells left out, Image cells as their file paths."""

    def plain(value):
        if isinstance(value, dict):
            if set(value) == {"bytes", "path"}:  # a datasets Image, not decoded
                return value["path"]
            return {k: plain(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return json.dumps({key: plain(value) for key, value in row.items() if value is not None})


def _bounded_lines(handle, *, limit: int) -> Iterator[bytes | int]:
    """The file's lines as bytes; a line over ``limit`` bytes as its length (an int), read
    through in 1 MiB pieces and dropped."""
    while line := handle.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):  # whole (the newline may be byte limit + 1)
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n") and (line := handle.readline(1 << 20)):
            size += len(line)
        yield size
