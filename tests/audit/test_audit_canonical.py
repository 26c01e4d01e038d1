"""RFC 8785 canonical entry bytes: the RFC's own examples, ECMAScript number formatting, and
the fast (C json) path used by bulk verification agreeing with the strict one."""

from __future__ import annotations

import json
import struct
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.canonical import (
    canonical_json,
    entry_bytes,
    event_leaf_hash,
    fast_details_json,
    format_number,
)
from proofplane.audit.merkle import leaf_hash
from proofplane.model import Event, Outcome


def test_rfc8785_section_3_2_2_example():
    value = json.loads(
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    want = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical_json(value) == want.encode()


def test_rfc8785_section_3_2_3_sorting():
    keys = ["\u20ac", "\r", "\ufb33", "1", "\U0001f600", "\u0080", "\u00f6"]
    out = canonical_json({k: i for i, k in enumerate(keys)}).decode()
    order = [json.loads("{" + part + "}") for part in out[1:-1].split(",")]
    assert [next(iter(o)) for o in order] == [
        "\r",
        "1",
        "\u0080",
        "\u00f6",
        "\u20ac",
        "\U0001f600",
        "\ufb33",
    ]


# RFC 8785 Appendix B: IEEE-754 bit patterns and their ECMAScript strings
APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize("bits,want", APPENDIX_B)
def test_rfc8785_appendix_b_numbers(bits, want):
    (x,) = struct.unpack(">d", bytes.fromhex(bits))
    assert format_number(x) == want


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), 2**53 + 1, -(2**60) - 1, {1: "x"}, object()]
)
def test_unrepresentable_values_are_refused(bad):
    with pytest.raises(ValueError):
        canonical_json(bad if isinstance(bad, dict) else [bad])


def test_lone_surrogate_refused():
    with pytest.raises(ValueError):
        canonical_json("\ud800")


def _event(**over):
    base = dict(
        seq=7,
        ts=datetime(2026, 11, 23, 12, 0, 0, 5, tzinfo=UTC),
        actor="alice",
        action="node.admit",
        target_type="node",
        target_id="gpu-01",
        outcome=Outcome.SUCCESS,
        details={"b": 1, "a": ["x", None]},
    )
    base.update(over)
    return Event(**base)


def test_entry_bytes_fields_and_leaf_hash():
    e = _event()
    want = (
        b'{"action":"node.admit","actor":"alice","details":{"a":["x",null],"b":1},'
        b'"outcome":"success","seq":7,"target_id":"gpu-01","target_type":"node",'
        b'"ts":"2026-11-23T12:00:00.000005Z","v":1}'
    )
    assert entry_bytes(e) == want
    assert event_leaf_hash(e) == leaf_hash(want)
    # the same instant in another zone is the same entry
    other = _event(ts=e.ts.astimezone(timezone(timedelta(hours=5))))
    assert entry_bytes(other) == want
    with pytest.raises(ValueError):
        entry_bytes(_event(ts=datetime(2026, 1, 1)))


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), json_value, max_size=5))
def test_fast_path_agrees_with_strict_canonicalization(details):
    try:
        strict = canonical_json(details).decode()
    except ValueError:
        return  # lone surrogates: the strict path refuses, so must everything else
    for text in (json.dumps(details), json.dumps(details, ensure_ascii=False)):
        fast = fast_details_json(text)
        if fast is not None:
            assert fast == strict


@settings(max_examples=300, deadline=None)
@given(json_value)
def test_canonical_json_is_valid_json_with_same_value(value):
    try:
        out = canonical_json(value)
    except ValueError:
        return
    # parse as ECMAScript would: every number a double (large integers included)
    back = json.loads(out, parse_int=lambda s: int(s) if abs(int(s)) < 2**53 else float(s))
    assert back == value
    assert canonical_json(back) == out
