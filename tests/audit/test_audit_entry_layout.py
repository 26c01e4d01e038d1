"""The canonical entry's fast path (``canonical.entry_frame``/``entry_text``/
``entry_leaf_hashes``, what ``Tx.record`` and the fast verifier lay out) gives the bytes of
the exact builder (``entry_bytes``: RFC 8785 over ``entry_object``), byte for byte."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.canonical import (
    entry_bytes,
    entry_leaf_hashes,
    entry_text,
    event_leaf_hash,
    format_ts,
    stored_details,
)
from proofplane.audit.merkle import leaf_hash
from proofplane.model import Outcome

T0 = datetime(2026, 11, 23, 9, 0, 0, 123456, tzinfo=UTC)

text = st.text() | st.sampled_from(["", 'é\n"\\', "\x00\x1f\x7f\u2028", "\U0001f600", "a"])
details = st.dictionaries(
    text,
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats() | text,
    max_size=4,
)
event = st.tuples(
    st.integers(1, 2**53 - 1),
    st.sampled_from(["node.enroll", "workload.place", "x"]) | text,
    st.sampled_from(["node", "workload"]) | text,
    text,
    st.sampled_from(list(Outcome)),
    details,
)


def _exact(seq, ts, actor, action, ttype, tid, outcome, det):
    return entry_bytes(
        SimpleNamespace(
            seq=seq, ts=ts, actor=actor, action=action, target_type=ttype, target_id=tid,
            outcome=outcome, details=det,
        )
    )  # fmt: skip


def _outcome(f):
    try:
        return ("ok", f())
    except ValueError:
        return ("refused",)


@settings(max_examples=400, deadline=None)
@given(st.lists(event, min_size=1, max_size=6), text, st.integers(0, 10**12))
def test_the_fast_path_gives_the_exact_entry(events, actor, micros):
    ts = T0 + timedelta(microseconds=micros)
    laid_out = []
    exact = []
    for seq, action, ttype, tid, outcome, det in events:
        try:
            value, _stored, canonical = stored_details(det)
        except ValueError:
            continue  # what JCS cannot carry never reaches the layout
        args = (seq, format_ts(ts), actor, action, ttype, tid, outcome.value, canonical)
        got = _outcome(lambda a=args: entry_text(*a).encode())
        want = _outcome(
            lambda s=seq, a=action, t=ttype, i=tid, o=outcome, v=value: _exact(
                s, ts, actor, a, t, i, o, v
            )
        )
        assert got == want
        if got[0] == "ok":
            laid_out.append((seq, action, ttype, tid, outcome.value, canonical))
            exact.append(leaf_hash(want[1]))
    if laid_out:
        assert entry_leaf_hashes(format_ts(ts), actor, laid_out) == exact


def test_entry_leaf_hashes_are_event_leaf_hashes():
    events = [
        (1, "node.enroll", "node", "gpu-001", "success", {"gpus": 8}),
        (2, "node.enroll", "node", "gpu-002", "success", {"gpus": 8}),  # the same frame
        (3, "auth.login", "user", "alice", "failure", {}),
        (4, "x", "y", "\U0001f600", "denied", {"\U0001f600": 1, "\ufb33": [1.0, -0.0]}),
    ]
    laid_out = [(s, a, t, i, o, stored_details(d)[2]) for s, a, t, i, o, d in events]
    want = [
        event_leaf_hash(
            SimpleNamespace(
                seq=s, ts=T0, actor="root", action=a, target_type=t, target_id=i, outcome=o,
                details=stored_details(d)[0],
            )
        )
        for s, a, t, i, o, d in events
    ]  # fmt: skip
    assert entry_leaf_hashes(format_ts(T0), "root", laid_out) == want


def test_text_that_is_not_unicode_is_refused():
    with pytest.raises(ValueError):
        entry_leaf_hashes(format_ts(T0), "root", [(1, "a\ud800", "t", "i", "success", "{}")])
    with pytest.raises(TypeError):
        entry_leaf_hashes(format_ts(T0), "root", [(1, 5, "t", "i", "success", "{}")])
