"""Why a message body could not be decoded, said in the client's terms.

msgspec reports positions (`Expected int, got str - at $[3]`); a client wrote field names, so the message names
the field (`max_tokens: expected int, got str`). And the request id is read from the body's first element
without decoding the rest, which may be exactly what is broken (bad UTF-8 further on, trailing bytes, a body
over the size limit): a client that routes replies by id then sees the error on the request it belongs to.
"""

from __future__ import annotations

import re

import msgspec

MAX_REQUEST_ID_LEN = 256  # characters
_AT_PATH = re.compile(r"^(?P<what>.*) - at `\$\[(?P<index>\d+)\](?P<rest>.*)`$")
_ARRAY_LENGTH = re.compile(r"^Expected `array` of at (?P<bound>least|most) length (?P<n>\d+), got (?P<got>\d+)$")


def describe(cls: type[msgspec.Struct], body: bytes, error: Exception) -> str:
    """One line for an Error reply; starts with `FIELD: ` when one field is at fault."""
    fields = cls.__struct_fields__
    text = str(error)
    if m := _AT_PATH.match(text):
        index = int(m["index"])
        name = fields[index] if index < len(fields) else f"element {index}"
        return f"{name}{m['rest']}: {_plain(m['what'])}"
    if m := _ARRAY_LENGTH.match(text):
        got = int(m["got"])
        if m["bound"] == "least":  # the first required field not given
            return f"{fields[got]}: required field missing"
        return f"too many elements: {cls.__name__} has {len(fields)} ({', '.join(fields) or 'no fields'}), got {got}"
    if text.startswith("Expected `array`, got"):
        got = _plain(text).removeprefix("expected array, ")
        return f"the body must be a msgpack array of {cls.__name__}'s fields, {got}"
    if "UTF-8" in text:
        return f"{_utf8_culprit(fields, body)}: a string is not valid UTF-8"
    return f"the body is not a single msgpack value: {text}"


_MSGPACK_NAMES = {"`None`": "nil", "`object`": "map", "`bytes`": "bin"}  # msgspec's names -> msgpack's


def _plain(msgspec_text: str) -> str:
    """msgspec's "Expected `int`, got `None`" as "expected int, got nil"."""
    text = msgspec_text.replace("Expected", "expected", 1)
    for theirs, ours in _MSGPACK_NAMES.items():
        text = text.replace(theirs, ours)
    return text.replace("`", "")


def _utf8_culprit(fields: tuple[str, ...], body: bytes) -> str:
    """The field holding the bad string: elements are split as raw bytes (no string is decoded), then each
    is decoded on its own."""
    try:
        elements = msgspec.msgpack.decode(body, type=list[msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "body"
    for i, raw in enumerate(elements):
        try:
            msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            return fields[i] if i < len(fields) else f"element {i}"
    return "body"


def guess_request_id(body: bytes) -> str | None:
    """Element 0 when the body starts as a msgpack array whose first element is a string of 1-256 characters
    (what check_request_id accepts); None otherwise. Reads only the bytes up to the end of the id."""
    array = _header(body, 0, 0x90, 0x0F, {0xDC: 2, 0xDD: 4})
    if array is None or array[0] == 0:
        return None
    string = _header(body, array[1], 0xA0, 0x1F, {0xD9: 1, 0xDA: 2, 0xDB: 4})
    if string is None or string[0] > 4 * MAX_REQUEST_ID_LEN or string[1] + string[0] > len(body):
        return None
    try:
        rid = body[string[1]:string[1] + string[0]].decode()
    except UnicodeDecodeError:
        return None
    return rid if 0 < len(rid) <= MAX_REQUEST_ID_LEN else None


def _header(body: bytes, pos: int, fixed: int, mask: int, sized: dict[int, int]) -> tuple[int, int] | None:
    """(length, offset after the header) of the msgpack array or str header at `pos`: a "fix" form (`fixed`
    in the high bits, the length in `mask`) or a tag followed by a big-endian length of `sized[tag]` bytes."""
    if pos >= len(body):
        return None
    tag = body[pos]
    if tag & ~mask == fixed:
        return tag & mask, pos + 1
    size = sized.get(tag)
    if size is None or pos + 1 + size > len(body):
        return None
    return int.from_bytes(body[pos + 1:pos + 1 + size], "big"), pos + 1 + size
