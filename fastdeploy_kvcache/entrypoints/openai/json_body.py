"""Parsing a request body as JSON, with a 400 that says what is wrong.

FastAPI's own parsing answers "There was an error parsing the body" for a body that is not
UTF-8 or nests too deep (the parser's recursion limit), and lets a lone UTF-16 surrogate
(``"\\ud800"``, valid JSON) through as a string no encoder can write.  Here each is a
:class:`BodyRejected` naming the problem:

- invalid UTF-8: the byte offset of the first bad byte;
- nesting deeper than :data:`MAX_JSON_DEPTH`: found by a scan of the raw bytes that stops as
  soon as it passes the limit, before the parser recurses (no OpenAI request nests more than
  a few levels);
- a lone surrogate in any string, key or value: the field's path (``messages[0].content``).

Each check is linear in the body (bounded by ``--max-request-body-bytes``) and the scans run
only when a cheap count shows they can find something.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from fastapi import HTTPException

MAX_JSON_DEPTH = 64

# A JSON string (escapes included) or one bracket: the tokens the depth scan looks at.
_STRING_OR_BRACKET = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
# A \uD800-\uDFFF escape: the only way a surrogate gets into a UTF-8 body's strings.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyRejected(HTTPException):
    """A request body that is not acceptable JSON: HTTP 400 with ``detail`` and ``param``."""

    def __init__(self, detail: str, param: Optional[str] = None) -> None:
        super().__init__(status_code=400, detail=detail)
        self.param = param


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``body``'s arrays and objects nest deeper than ``limit`` (strings skipped)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def _path(parts: list[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _lone_surrogate(text: str) -> Optional[int]:
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return exc.start


def find_lone_surrogate(value: Any) -> Optional[tuple[str, str, int]]:
    """The first string (path, text, character index) holding a lone surrogate, or None.

    Iterative (an explicit stack), so no recursion however the value nests.
    """
    stack: list[tuple[list[Any], Any]] = [([], value)]
    while stack:
        parts, item = stack.pop()
        if isinstance(item, str):
            at = _lone_surrogate(item)
            if at is not None:
                return _path(parts), item, at
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                at = _lone_surrogate(key)
                if at is not None:
                    return _path(parts) or "body", key, at
                stack.append((parts + [key], child))
        elif isinstance(item, list):
            stack.extend((parts + [i], child) for i, child in reversed(list(enumerate(item)))
                         if isinstance(child, (str, list, dict)))
    return None


def parse_json_body(body: bytes) -> Any:
    """``body`` as JSON; :class:`BodyRejected` for invalid UTF-8, deep nesting or a lone surrogate.

    Malformed JSON stays ``json.JSONDecodeError`` (FastAPI reports its position itself).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyRejected(f"request body: invalid UTF-8 at byte {exc.start} (0x{body[exc.start]:02x}: "
                           f"{exc.reason}); JSON bodies must be UTF-8") from None
    if json_depth_exceeds(body):
        raise BodyRejected(f"request body: JSON nesting deeper than {MAX_JSON_DEPTH} levels")
    value = json.loads(text)
    if _SURROGATE_ESCAPE.search(body):
        found = find_lone_surrogate(value)
        if found is not None:
            path, item, at = found
            raise BodyRejected(
                f"{path}: not valid Unicode text: a lone UTF-16 surrogate U+{ord(item[at]):04X} at character "
                f"{at} (a \\uD800-\\uDFFF escape must be half of a pair)", param=path)
    return value
