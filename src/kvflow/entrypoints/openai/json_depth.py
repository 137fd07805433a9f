"""JSON text a client controls is parsed only when its nesting is bounded.

The body itself is bounded by its parser (pydantic-core stops at about 200 levels with a "not valid
JSON" error), but some fields carry JSON inside a string — a past tool call's `arguments`,
`guided_json` as text — and the tool-call parsers read JSON from the model's text, which a client
can steer. Python's `json` recurses once per level: a string of 5,000 `[` raises RecursionError,
which is no ValueError and would end the request as a 500. The depth is therefore measured
first, without recursion, and text nested deeper than MAX_JSON_DEPTH is refused (a 400 naming the
field) or, from the model, not taken as JSON.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any

# Deeper than any real schema or tool arguments, and far from Python's recursion limit, which
# the walks such a value gets later (json.dumps, a chat template's tojson) also count against.
MAX_JSON_DEPTH = 64

# A string literal (brackets inside do not nest), closed or cut off at the end of the text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_OPEN_CLOSE = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1, +1, -1, -1 as signed bytes
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of `text` nest (0 for a scalar), valid JSON or not.
    Linear and in C but for the running sum: a UTF-8 multi-byte character never contains a
    bracket's byte, so counting bytes is counting characters."""
    structure = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    steps = array("b", structure.translate(_OPEN_CLOSE, _NOT_A_BRACKET))
    return max(accumulate(steps), default=0)


def check_depth(text: str) -> str:
    """`text` itself, or ValueError (for a field validator, which names the field)."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} levels are accepted")
    return text


def loads(text: str) -> Any:
    """json.loads within MAX_JSON_DEPTH: ValueError for text that is not JSON or nests too deeply."""
    return json.loads(check_depth(text))
