"""Cursor pagination: opaque cursors that encode the last key of the previous page."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Generic, TypeVar

from proofplane.errors import ValidationFailed

T = TypeVar("T")
MAX_LIMIT = 500
DEFAULT_LIMIT = 100
MAX_KEY = 255  # the longest string key a cursor carries (names are far shorter)
# The longest cursor a valid key makes: JSON escapes a character in at most 12 bytes (a
# surrogate pair, "\\ud83d\\ude00"), plus the envelope and a short kind, in base64 (4 per 3).
MAX_CURSOR = -(-(MAX_KEY * 12 + 64) // 3) * 4


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next: str | None


def encode_cursor(kind: str, last: str | int) -> str:
    raw = json.dumps({"k": kind, "after": last}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str | None, expected: type) -> str | int | None:
    """The key to continue after, or None for the first page; ``invalid_cursor`` if forged."""
    if cursor is None or cursor == "":
        return None
    try:
        if len(cursor) > MAX_CURSOR:  # refuse before decoding anything huge
            raise ValueError("cursor too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        after = data["after"]
        ok = data.get("k") == kind and isinstance(after, expected) and not isinstance(after, bool)
        ok = ok and (not isinstance(after, int) or 0 <= after < 2**63)
        ok = ok and (not isinstance(after, str) or len(after) <= MAX_KEY)
        if ok and isinstance(after, str):
            after.encode()  # a lone surrogate ("\\ud800") is no text a store can compare
    except (binascii.Error, ValueError, TypeError, KeyError, RecursionError):
        ok = False
    if not ok:
        raise ValidationFailed(
            "invalid cursor: pass back the 'next' value of a previous page unchanged",
            code="invalid_cursor",
            details={"cursor": cursor[:64]},
        )
    return after  # type: ignore[no-any-return]


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(
            f"limit must be between 1 and {MAX_LIMIT}",
            code="validation_failed",
            details={"limit": limit},
        )
    return limit


def paginate(kind: str, items: list[T], limit: int, key: str | int | None) -> Page[T]:
    """``items`` holds up to limit+1 rows: the extra one tells whether a next page exists."""
    if len(items) > limit and key is not None:
        return Page(items[:limit], encode_cursor(kind, key))
    return Page(items[:limit], None)


def decode_text_cursor(kind: str, cursor: str | None) -> str | None:
    """``decode_cursor`` for a page keyed by a name: a key holding NUL is refused too. No name
    has one (only a forged cursor can), and PostgreSQL refuses NUL in a text parameter, which
    would answer 500 instead of 422."""
    after = decode_cursor(kind, cursor, str)
    if isinstance(after, str) and "\x00" in after:
        raise ValidationFailed(
            "invalid cursor: pass back the 'next' value of a previous page unchanged",
            code="invalid_cursor",
            details={"cursor": (cursor or "")[:64]},
        )
    return after
