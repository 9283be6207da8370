"""A record's bytes as JSON text, or the reason it cannot be one: what strategies/data/record_files.py
hands the encoder for each record.

- A JSONL line must be UTF-8: a line that is not is a bad sample ("not UTF-8: byte 0xff at offset
  17 of the line"), never decoded with U+FFFD in place of its bytes (that trains on text nobody
  wrote).
- A ``.json`` array is parsed whole when it can be (the usual file). One that cannot — bytes that
  are not UTF-8, a record nested past Python's recursion limit, a malformed record — is split
  into its records by their brackets, and each is read on its own: the records that cannot be are
  bad samples of their own (``file:record N``), the others train. Only an array whose records
  cannot be told apart (an unterminated string or bracket, something other than ``,`` or ``]``
  after a record, no ``[`` at its start) is a ValueError naming the byte where it breaks: the
  caller stops there, since what follows is not known to be records at all.
"""

from __future__ import annotations

import json
import re
from typing import Iterator

import attrs

#: The characters ``surrogateescape`` gives the bytes that are not UTF-8 (0x80-0xff as U+DC80-U+DCFF).
_NOT_UTF8 = re.compile("[\udc80-\udcff]")
_STRUCTURE = re.compile(r'[][{}"]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # after the opening quote
_SCALAR = re.compile(r'[^,\]\s]+')
_SPACE = re.compile(r"[ \t\n\r]*")


@attrs.frozen
class Unreadable:
    """A record that cannot be read as JSON text, and why: a bad sample like any other (the
    encoder reports ``reason`` with the record's place)."""

    reason: str


def escaped_bytes(text: str) -> bool:
    """Whether text decoded with ``surrogateescape`` holds bytes that were not UTF-8."""
    return _NOT_UTF8.search(text) is not None


def line_text(line: bytes) -> str | Unreadable:
    """A JSONL line as text, or why it is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        return Unreadable(f"not UTF-8: byte 0x{line[error.start]:02x} at offset {error.start:,} of the line")


def array_pieces(data: bytes) -> Iterator[str | Unreadable]:
    """The records of a JSON array file one at a time, each as its own JSON text (parsed by the
    encoder, which reports a malformed or too deeply nested one), or as Unreadable when its bytes
    are not UTF-8. ValueError where the array's records cannot be told apart."""
    encoding = json.detect_encoding(data)
    if encoding not in ("utf-8", "utf-8-sig"):  # a UTF-16 or UTF-32 file: no byte-level recovery
        try:
            data.decode(encoding)
        except UnicodeDecodeError as error:
            raise ValueError(f"not {encoding} at byte {error.start:,}") from None
        text = data.decode(encoding)

        def offset(pos: int) -> int:  # asked once, for the message of a break
            return len(text[:pos].encode(encoding))  # "utf-16" writes the BOM its file opens with
    else:
        text = data.decode("utf-8", "surrogateescape")  # each byte that is not UTF-8 kept as a marker
        offset = _ByteOffsets(text)
    pos = _skip(text, 1 if text.startswith("\ufeff") else 0)
    if text[pos:pos + 1] != "[":
        raise ValueError(f"a .json file holds one JSON array of records; this one does not open with '[' "
                         f"(byte {offset(pos):,})")
    pos = _skip(text, pos + 1)
    closed = text[pos:pos + 1] == "]"
    number = 0
    while not closed:
        number += 1
        end = _value_end(text, pos)
        if end is None:
            raise ValueError(f"record {number} (from byte {offset(pos):,}) does not end: an unterminated string "
                             "or bracket")
        bad = _NOT_UTF8.search(text, pos, end)
        if bad is not None:
            byte = ord(bad.group()) - 0xDC00
            yield Unreadable(f"not UTF-8: byte 0x{byte:02x} at offset {offset(bad.start()):,} of the file")
        else:
            yield text[pos:end]
        pos = _skip(text, end)
        follows = text[pos:pos + 1]
        if follows not in (",", "]"):
            raise ValueError(f"after record {number}, {follows or 'the end of the file'!r} where ',' or ']' belongs "
                             f"(byte {offset(pos):,})")
        closed = follows == "]"
        pos = _skip(text, pos + 1) if not closed else pos
    if _skip(text, pos + 1) != len(text):
        raise ValueError(f"more after the array's closing ']' (byte {offset(_skip(text, pos + 1)):,})")


def _skip(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _value_end(text: str, pos: int) -> int | None:
    """Where the JSON value at ``pos`` ends: brackets counted (strings skipped), without parsing
    it, so a record nested 100,000 deep is found and then refused alone; None if it never ends."""
    first = text[pos:pos + 1]
    if first == '"':
        match = _STRING_REST.match(text, pos + 1)
        return match.end() if match else None
    if first not in ("[", "{"):  # a number, true, false, null: not a record, refused as one by the encoder
        match = _SCALAR.match(text, pos)
        return match.end() if match else None
    depth = 0
    while (match := _STRUCTURE.search(text, pos)) is not None:
        char, pos = match.group(), match.end()
        if char == '"':
            string = _STRING_REST.match(text, pos)
            if string is None:
                return None
            pos = string.end()
        elif char in "[{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos
    return None


class _ByteOffsets:
    """A character position's byte offset in the file, counted on from the last one asked (the
    positions asked only grow, so the whole file is encoded at most once)."""

    def __init__(self, text: str) -> None:
        self.text, self.char, self.byte = text, 0, 0

    def __call__(self, pos: int) -> int:
        if pos < self.char:
            self.char = self.byte = 0
        self.byte += len(self.text[self.char:pos].encode("utf-8", "surrogateescape"))
        self.char = pos
        return self.byte
