"""Cursor pagination: opaque cursors, limits, pages."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proofplane.errors import ValidationFailed
from proofplane.service.pagination import (
    DEFAULT_LIMIT,
    MAX_CURSOR,
    MAX_KEY,
    MAX_LIMIT,
    Page,
    check_limit,
    decode_cursor,
    decode_text_cursor,
    encode_cursor,
    paginate,
)


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def bad_cursor(kind: str, cursor: str, expected: type = str) -> ValidationFailed:
    with pytest.raises(ValidationFailed) as exc:
        decode_cursor(kind, cursor, expected)
    assert exc.value.code == "invalid_cursor"
    assert exc.value.details == {"cursor": cursor[:64]}
    return exc.value


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ("fra-h100-01", str),
        ("", str),
        ("ünïcode/ключ", str),
        (0, int),
        (123456789, int),
        (2**63 - 1, int),
        ("x" * 255, str),
    ],
)
def test_round_trip(last, expected):
    cursor = encode_cursor("nodes", last)
    assert decode_cursor("nodes", cursor, expected) == last


@given(st.text(max_size=255), st.text(min_size=1, max_size=10))
def test_round_trip_any_string(last, kind):
    assert decode_cursor(kind, encode_cursor(kind, last), str) == last


@pytest.mark.parametrize("char", ["\x00", "\x1f", "\U0001f600", "\u00e9", "a"])
def test_the_longest_key_of_any_character_round_trips(char):
    # 255 control characters made an 827-character cursor the old 512-character cap refused
    last = char * MAX_KEY
    cursor = encode_cursor("workloads", last)
    assert len(cursor) <= MAX_CURSOR
    assert decode_cursor("workloads", cursor, str) == last


def test_a_cursor_longer_than_any_valid_one_is_refused_before_decoding():
    with pytest.raises(ValidationFailed) as exc:
        decode_cursor("workloads", "A" * (MAX_CURSOR + 1), str)
    assert exc.value.code == "invalid_cursor"


@given(st.integers(min_value=0, max_value=2**63 - 1))
def test_round_trip_any_int(last):
    assert decode_cursor("events", encode_cursor("events", last), int) == last


@given(st.text(max_size=40) | st.integers(0, 2**63 - 1))
def test_cursor_is_url_safe_and_unpadded(last):
    cursor = encode_cursor("workloads", last)
    assert cursor
    assert "=" not in cursor
    assert all(c.isascii() and (c.isalnum() or c in "-_") for c in cursor)


def test_cursor_is_opaque_json_inside():
    cursor = encode_cursor("tenants", "acme")
    raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    assert json.loads(raw) == {"k": "tenants", "after": "acme"}


@pytest.mark.parametrize("cursor", [None, ""])
def test_no_cursor_means_first_page(cursor):
    assert decode_cursor("nodes", cursor, str) is None


# --------------------------------------------------------------------------- bad cursors


def test_wrong_kind():
    bad_cursor("workloads", encode_cursor("nodes", "a"))
    bad_cursor("nodes", encode_cursor("Nodes", "a"))


@pytest.mark.parametrize(
    ("after", "expected"),
    [("5", int), (5, str), (True, int), (False, int), (1.5, int), (None, str), ([1], int)],
)
def test_wrong_type(after, expected):
    cursor = b64(json.dumps({"k": "events", "after": after}).encode())
    bad_cursor("events", cursor, expected)


@pytest.mark.parametrize(
    ("after", "expected"),
    [(-1, int), (-(2**63), int), (2**63, int), (10**30, int), ("x" * 256, str)],
)
def test_keys_out_of_range(after, expected):
    # keys a real page can never have: negative or beyond 64-bit ids, over-long names
    bad_cursor("events", encode_cursor("events", after), expected)


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor!",
        "%%%%",
        "a",  # a single base64 character can never decode
        "abcde",
        "é",  # not ASCII
        b64(b"not json"),
        b64(b"\xff\xfe\xfd"),  # not UTF-8
        b64(b'["k", "after"]'),
        b64(b'"after"'),
        b64(b"null"),
        b64(b"42"),
        b64(b"{}"),
        b64(b'{"k": "nodes"}'),  # no "after"
        b64(b'{"after": "a"}'),  # no kind
        b64(b'{"k": ["nodes"], "after": "a"}'),
    ],
)
def test_garbage_cursors(cursor):
    err = bad_cursor("nodes", cursor)
    assert "invalid cursor" in err.message


def test_tampered_cursor():
    good = encode_cursor("nodes", "fra-h100-01")
    bad_cursor("nodes", good[:-3])  # truncated
    bad_cursor("nodes", good[5:])  # front cut off
    # a rewritten kind is refused even though the cursor is well-formed
    forged = b64(json.dumps({"k": "tenants", "after": "fra-h100-01"}).encode())
    bad_cursor("nodes", forged)


def test_deeply_nested_cursor_is_invalid_not_a_crash():
    bad_cursor("nodes", b64(b"[" * 2000))


# --------------------------------------------------------------------------- check_limit


@pytest.mark.parametrize("limit", [1, 2, DEFAULT_LIMIT, MAX_LIMIT - 1, MAX_LIMIT])
def test_limit_in_bounds(limit):
    assert check_limit(limit) == limit


@pytest.mark.parametrize("limit", [0, -1, MAX_LIMIT + 1, 10**9])
def test_limit_out_of_bounds(limit):
    with pytest.raises(ValidationFailed) as exc:
        check_limit(limit)
    assert exc.value.code == "validation_failed"
    assert exc.value.details == {"limit": limit}
    assert str(MAX_LIMIT) in exc.value.message


def test_limit_constants():
    assert 1 <= DEFAULT_LIMIT <= MAX_LIMIT == 500


# --------------------------------------------------------------------------- paginate


def test_short_page_has_no_next():
    page = paginate("nodes", ["a", "b"], 5, "b")
    assert page == Page(["a", "b"], None)


def test_exactly_limit_items_has_no_next():
    assert paginate("nodes", ["a", "b", "c"], 3, "c").next is None


def test_extra_row_means_next_page():
    page = paginate("nodes", ["a", "b", "c", "d"], 3, "c")
    assert page.items == ["a", "b", "c"]
    assert page.next is not None
    assert decode_cursor("nodes", page.next, str) == "c"
    assert paginate("events", [1, 2, 3], 2, 2).next == encode_cursor("events", 2)


def test_extra_row_without_key_has_no_next():
    assert paginate("nodes", ["a", "b"], 1, None) == Page(["a"], None)


def test_empty_page():
    assert paginate("nodes", [], 10, None) == Page([], None)


def test_paginate_does_not_modify_input():
    items = [1, 2, 3]
    paginate("events", items, 2, 2)
    assert items == [1, 2, 3]


def _fetch(data: list[int], kind: str, limit: int, cursor: str | None) -> Page[int]:
    """What a service does: query limit+1 rows after the cursor's key, then paginate."""
    after = decode_cursor(kind, cursor, int)
    rows = [x for x in data if after is None or x > after][: limit + 1]
    key = rows[limit - 1] if len(rows) > limit else None
    return paginate(kind, rows, limit, key)


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=60), st.integers(1, 12))
def test_walking_all_pages_yields_every_item_once(data, limit):
    data = sorted(data)
    seen: list[int] = []
    cursor = None
    for _ in range(len(data) + 2):
        page = _fetch(data, "events", limit, cursor)
        assert len(page.items) <= limit
        seen.extend(page.items)
        if page.next is None:
            break
        assert len(page.items) == limit
        cursor = page.next
    assert seen == data


def test_a_cursor_key_holding_nul_is_refused():
    """PostgreSQL refuses NUL in a text parameter: such a key would answer 500, not 422."""
    forged = b64(json.dumps({"k": "workloads", "after": "a\u0000/t1"}).encode())
    with pytest.raises(ValidationFailed) as err:
        decode_text_cursor("workloads", forged)
    assert err.value.code == "invalid_cursor"
    assert decode_text_cursor("workloads", encode_cursor("workloads", "a/t1")) == "a/t1"
