"""The fast paths of the audit log prove what the exact ones do: the C-json canonical form
equals RFC 8785 byte for byte (or defers to the exact encoder), ``Tx.record_many`` writes the
very rows and hashes ``Tx.record`` writes, group commit acknowledges only committed events,
and the fast SQLite verification accepts exactly the logs the exact pass accepts."""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, text

from proofplane.access import SYSTEM
from proofplane.audit import canonical
from proofplane.audit.canonical import (
    canonical_json,
    entry_bytes,
    fast_canonical_json,
    quote_string,
    stored_details,
)
from proofplane.model import Outcome
from proofplane.service import audit as audit_svc
from proofplane.service.context import NewEvent, Store
from proofplane.service.events import event_from_row
from proofplane.store import audit_log, audit_verify, migrate
from proofplane.store.tables import AuditHashRow, EventRow

T0 = datetime(2026, 11, 23, 9, 0, 0, 123456, tzinfo=UTC)

# --- canonical form -------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.sampled_from([2**53 - 1, -(2**53 - 1), 2**53, 2**53 + 1, 10**21])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1.0, 0.5, 1e16, 1e21, 1e-7, 123456789.125, -0.0, 5e-324])
    | st.text()
    | st.sampled_from(["\U0001f600", "\ufb33", "\ud800", "\x00\x1f\x7f\u2028", 'q"\\'])
)
keys = st.text() | st.sampled_from(["\U0001f600", "\ufb33", "\ue000", "a", "b"])
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.dictionaries(st.integers(-20, 20), inner, max_size=3)
    ),
    max_leaves=12,
)


def _outcome(f, *args):
    try:
        return ("ok", f(*args))
    except ValueError as exc:
        return ("refused", type(exc))


@settings(max_examples=500, deadline=None)
@given(values)
def test_fast_canonical_equals_exact_jcs(value):
    assert _outcome(fast_canonical_json, value) == _outcome(canonical_json, value)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(keys, values, max_size=5) | st.dictionaries(st.integers(), values))
def test_stored_details_is_the_jcs_of_what_the_json_column_gives_back(details):
    try:
        back = json.loads(json.dumps(details))
        want = canonical_json(back).decode()
    except ValueError:
        with pytest.raises(ValueError):
            stored_details(details)
        return
    value, _stored, got = stored_details(details)
    assert got == want
    assert value == back or any(isinstance(v, float) and math.isnan(v) for v in back.values())


@settings(max_examples=500, deadline=None)
@given(st.text())
def test_quote_string_is_jcs_string_quoting(s):
    assert quote_string(s) == canonical._string(s)


@pytest.mark.parametrize(
    "value",
    [
        {10: 1, 9: 2},  # int keys: json sorts them as ints, JCS as the strings they become
        {"a": 2**60},  # beyond 2^53: a double, formatted as such
        {"a": 1e16, "b": 1.0, "c": 1e-7},  # repr is not ECMAScript's spelling
        {"\U0001f600": 1, "\ufb33": 2},  # UTF-16 order differs from code-point order
        {"a": ("x", "y")},
        {"a": True, "b": None, "c": [1, 2.5, "é\n"]},
    ],
)
def test_fallback_cases_agree(value):
    assert _outcome(fast_canonical_json, value) == _outcome(canonical_json, value)
    assert stored_details(value)[2] == canonical_json(json.loads(json.dumps(value))).decode()


@pytest.mark.parametrize("bad", [{"a": float("nan")}, {"a": "\ud800"}, {"a": float("inf")}])
def test_what_jcs_cannot_carry_is_refused(bad):
    with pytest.raises(ValueError):
        stored_details(bad)
    with pytest.raises(ValueError):
        fast_canonical_json(bad)


# --- record_many == record -------------------------------------------------------------------

EVENTS = [
    ("node.enroll", "node", "gpu-001", {"gpus": 8, "tags": ("hipaa",)}, Outcome.SUCCESS),
    ("workload.place", "workload", "w-1", {"x": 0.5, "s": 'é\n"', 3: "int key"}, Outcome.SUCCESS),
    ("auth.login", "user", "alice", None, Outcome.FAILURE),
    ("policy.change", "policy", "p\u2028", {"big": 2**60, "f": 1e21}, Outcome.DENIED),
    ("x", "y", "\U0001f600", {"\U0001f600": 1, "\ufb33": [1.0, -0.0]}, Outcome.SUCCESS),
]


def _dump(store: Store) -> tuple[list[tuple], list[tuple]]:
    with store.read() as s:
        events = [
            (r.seq, r.ts, r.actor, r.action, r.target_type, r.target_id, r.outcome, r.details)
            for r in s.scalars(select(EventRow).order_by(EventRow.seq))
        ]
        hashes = [(r.id, bytes(r.hash)) for r in s.scalars(select(AuditHashRow).order_by("id"))]
    return events, hashes


def _second_store(db_url: str, tmp_path: Path) -> Store:
    if db_url.startswith("sqlite"):
        other = Store(f"sqlite:///{tmp_path / 'other.db'}")
        migrate.upgrade(other.engine)
        return other
    return None  # type: ignore[return-value]


def test_record_many_writes_what_record_writes(db_url: str, store: Store, tmp_path: Path):
    for k in range(3):
        with store.write(SYSTEM, now=T0 + timedelta(seconds=k)) as tx:
            for action, ttype, tid, details, outcome in EVENTS:
                tx.record(action, ttype, tid, details=details, outcome=outcome)
    single = _dump(store)
    # the same events through record_many, on a fresh database of the same kind
    with store.engine.begin() as conn:
        for table in ("audit_hashes", "events"):
            if store.engine.dialect.name == "sqlite":
                conn.execute(text("DROP TRIGGER IF EXISTS events_no_delete"))
            else:
                conn.execute(text("DROP TRIGGER IF EXISTS events_append_only ON events"))
            conn.execute(text(f"DELETE FROM {table}"))
    for k in range(3):
        with store.write(SYSTEM, now=T0 + timedelta(seconds=k)) as tx:
            seqs = tx.record_many([NewEvent(*e) for e in EVENTS])
            assert seqs == list(range(5 * k + 1, 5 * k + 6))
    assert _dump(store) == single
    # and every stored leaf is the RFC 8785 entry of the row as read back
    with store.read() as s:
        rows = s.scalars(select(EventRow).order_by(EventRow.seq)).all()
        leaves = audit_log.leaf_hashes(s, 0, len(rows))
    assert [canonical.leaf_hash(entry_bytes(event_from_row(r))) for r in rows] == leaves


def test_sqlite_rows_keep_canonical_details_and_the_orm_timestamp(tmp_path: Path):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    migrate.upgrade(store.engine)
    with store.write(SYSTEM, now=T0) as tx:
        tx.record("a", "b", "c", details={"z": 1, "a": [2, {"y": "é"}]})
    with store.write(SYSTEM, now=T0.replace(microsecond=0)) as tx:
        tx.record_many([("a", "b", "c", {"k": 1})])
    conn = sqlite3.connect(tmp_path / "a.db")
    rows = conn.execute("SELECT ts, details FROM events ORDER BY seq").fetchall()
    assert rows == [
        ("2026-11-23 09:00:00.123456", '{"a":[2,{"y":"é"}],"z":1}'),
        ("2026-11-23 09:00:00.000000", '{"k":1}'),
    ]
    with store.read() as s:
        assert [r.ts for r in s.scalars(select(EventRow).order_by(EventRow.seq))] == [
            T0,
            T0.replace(microsecond=0),
        ]
    store.dispose()


@pytest.mark.parametrize(
    "details",
    [{"big": 2**60, "f": 1e16, "one": 1.0, "tiny": 5e-324}, {"n": 1, "s": "plain"}, {3: (1,)}],
)
def test_details_read_back_as_the_json_round_trip_gives_them(store: Store, details):
    """Storing canonical text must not change a value: 2^60 stays 2^60, 1.0 stays a float."""
    with store.write(SYSTEM, now=T0) as tx:
        row = tx.record("a", "b", "c", details=details)
    want = json.loads(json.dumps(details))
    with store.read() as s:
        back = s.get(EventRow, row.seq)
        assert back.details == want == row.details
        if store.engine.dialect.name == "sqlite":  # (JSONB keeps numbers as numeric)
            assert [type(v) for v in back.details.values()] == [type(v) for v in want.values()]
        leaf = audit_log.leaf_hashes(s, 0, 1)[0]
        assert canonical.leaf_hash(entry_bytes(event_from_row(back))) == leaf


def test_recorded_events_are_visible_in_the_transaction_and_rollback_leaves_nothing(
    store: Store,
):
    class Boom(Exception):
        pass

    with pytest.raises(Boom), store.write(SYSTEM, now=T0) as tx:
        tx.record("a", "b", "c")
        tx.record_many([("a", "b", "d", {"n": 1})] * 3)
        assert tx.session.scalar(select(func.count()).select_from(EventRow)) == 4
        raise Boom
    assert _dump(store) == ([], [])


def test_a_refused_event_writes_nothing_of_its_batch(store: Store):
    with store.write(SYSTEM, now=T0) as tx:
        with pytest.raises(ValueError):
            tx.record_many([("a", "b", "ok", {}), ("a", "b", "bad", {"x": float("nan")})])
        assert tx.record_many([("a", "b", "after", {})]) == [1]
    events, hashes = _dump(store)
    assert [e[5] for e in events] == ["after"] and len(hashes) == 1


# --- group commit ----------------------------------------------------------------------------


def test_group_commit_acknowledges_committed_events_only(tmp_path: Path):
    store = Store(f"sqlite:///{tmp_path / 'g.db'}")
    migrate.upgrade(store.engine)
    committer = audit_svc.GroupCommitter(store, SYSTEM, max_batch=64)
    seqs: list[int] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        acks = [committer.submit("t.e", "node", f"n{w}", {"i": i}) for i in range(100)]
        acks += committer.submit_many([("t.e", "node", f"n{w}", {"i": -1})] * 5)
        got = [a.result(timeout=60) for a in acks]
        with lock:
            seqs.extend(got)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = committer.submit("t.e", "node", "x", {"nan": float("nan")})
    good = committer.submit("t.e", "node", "y", {})
    with pytest.raises(ValueError):
        bad.result(timeout=60)
    assert good.result(timeout=60) == 8 * 105 + 1
    committer.close()
    assert sorted(seqs) == list(range(1, 8 * 105 + 1))
    with store.read() as s:
        assert audit_log.tree_size(s) == 8 * 105 + 1
        rows = {r.seq: r for r in s.scalars(select(EventRow))}
    assert all(rows[q].target_id.startswith("n") for q in seqs)
    store.dispose()


# --- fast verification -----------------------------------------------------------------------


def _filled(tmp_path: Path, n: int) -> tuple[Store, audit_svc.AuditKeys, str]:
    path = tmp_path / "v.db"
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    keys = audit_svc.AuditKeys(origin="proofplane/test", key_file=tmp_path / "k.key")
    for k in range(0, n, 7):
        with store.write(SYSTEM, now=T0 + timedelta(seconds=k)) as tx:
            tx.record_many(
                (EVENTS[i % len(EVENTS)][:3] + ({"i": i, "t": "acme"},))
                for i in range(k, min(n, k + 7))
            )
    audit_svc.sign_checkpoint(store, SYSTEM, keys, T0)
    return store, keys, str(path)


@pytest.mark.parametrize("workers", [1, 2])
def test_fast_roots_equal_the_stored_tree(tmp_path: Path, workers: int):
    store, _keys, path = _filled(tmp_path, 45)
    cuts = [0, 1, 7, 8, 9, 31, 32, 45]
    full, roots, slow = audit_verify.log_roots(path, 45, cuts, workers=workers, chunk_level=3)
    with store.read() as s:
        assert full == audit_log.root_at(s, 45)
        assert roots == {c: audit_log.root_at(s, c) for c in cuts}
    assert slow == 0
    store.dispose()


def _attack(store: Store, *statements: str) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER IF EXISTS events_no_update")
        for s in statements:
            conn.exec_driver_sql(s)


def test_non_canonical_details_text_falls_back_to_the_exact_recomputation(tmp_path: Path):
    """Rows whose details text is not canonical (as an older writer stored them) still
    verify: their chunk is recomputed exactly."""
    store, keys, path = _filled(tmp_path, 20)
    _attack(store, 'UPDATE events SET details = \'{"t": "acme", "i": 3}\' WHERE seq = 4')
    full, _, slow = audit_verify.log_roots(path, 20, workers=1, chunk_level=3)
    with store.read() as s:
        assert full == audit_log.root_at(s, 20)
    assert slow == 1
    assert audit_svc.verify_log(store, keys.verifier(store), "proofplane/test").ok
    store.dispose()


@pytest.mark.parametrize(
    "statements",
    [
        # move the boundary between details and outcome: the raw concatenation of the
        # columns would be the same bytes, the quoted layout is not
        [
            'UPDATE events SET details = \'{"i":3,"t":"acme"\' WHERE seq = 4',
            'UPDATE events SET outcome = \'},"outcome":"success\' WHERE seq = 4',
        ],
        ["UPDATE events SET target_id = 'gpu-002' WHERE seq = 1"],
        ['UPDATE events SET details = \'{"i":0,"t":"acmf"}\' WHERE seq = 1'],
        ["UPDATE events SET ts = '2026-11-23 09:00:01.123456' WHERE seq = 1"],
        ["UPDATE events SET ts = '2026-11-23X09:00:00.123456' WHERE seq = 1"],
        ["UPDATE events SET seq = 100 WHERE seq = 20"],
        ["UPDATE events SET actor = CAST(actor AS BLOB) || X'22' WHERE seq = 2"],
    ],
    ids=["shift", "target", "details", "ts", "ts-shape", "seq", "blob"],
)
def test_fast_pass_never_accepts_an_altered_row(tmp_path: Path, statements):
    store, keys, path = _filled(tmp_path, 20)
    with store.read() as s:
        want = audit_log.root_at(s, 20)
    _attack(store, *statements)
    try:
        full, _, _ = audit_verify.log_roots(path, 20, workers=1, chunk_level=3)
    except audit_verify.Unverifiable:
        full = None
    assert full != want
    report = audit_svc.verify_log(store, keys.verifier(store), "proofplane/test")
    assert not report.ok
    store.dispose()
