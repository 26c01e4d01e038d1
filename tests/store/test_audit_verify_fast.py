"""The fast SQLite verification (``store.audit_verify``: rows streamed, the repeated column
parts quoted once, several chunks in several worker processes) proves exactly what the exact
pass proves. On an intact log it alone accepts; a row altered, deleted or reordered directly
in the database (first, middle or last index) is never accepted by it, and ``verify_log``
names the first index that does not match."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proofplane.access import SYSTEM
from proofplane.keys import SIGN
from proofplane.model import Outcome
from proofplane.service import audit as audit_svc
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store import audit_log, audit_verify, migrate

T0 = datetime(2026, 11, 23, 9, 0, 0, 250000, tzinfo=UTC)
N = 40  # events: five chunks of 2^3
LEVEL = 3
ACTIONS = [
    ("workload.place", "workload", Outcome.SUCCESS),
    ("workload.place", "workload", Outcome.SUCCESS),
    ("node.heartbeat", "node", Outcome.SUCCESS),
    ("auth.login", "user", Outcome.DENIED),
]


def _fill(tmp_path: Path) -> tuple[Store, audit_svc.AuditKeys, str]:
    """N events: the audit key's creation, then four per transaction (one ts for the four),
    actions in runs and switches."""
    path = tmp_path / "fast.db"
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    keys = audit_svc.AuditKeys(origin="proofplane/test", key_file=tmp_path / "k.key")
    with store.write(SYSTEM, now=T0) as tx:  # the checkpoints' KMS key: event 1 (key.create)
        keys_svc.kms_for(store).ensure_key(tx, keys_svc.AUDIT_KEY, SIGN)
    for start in range(0, N - 1, 4):
        with store.write(SYSTEM, now=T0 + timedelta(seconds=start)) as tx:
            for i in range(start, min(start + 4, N - 1)):
                action, ttype, outcome = ACTIONS[(i // 3) % len(ACTIONS)]
                details = {"i": i, "node": f"gpu-{i % 5}", "tags": {"hipaa": "true"}}
                tx.record(action, ttype, f"t-{i}", details=details, outcome=outcome)
        if start == 16:
            audit_svc.sign_checkpoint(store, SYSTEM, keys, T0)
    audit_svc.sign_checkpoint(store, SYSTEM, keys, T0 + timedelta(hours=1))
    return store, keys, str(path)


def _attack(store: Store, *statements: str) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER IF EXISTS events_no_update")
        conn.exec_driver_sql("DROP TRIGGER IF EXISTS events_no_delete")
        for s in statements:
            conn.exec_driver_sql(s)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify_log's fast pass in chunks of 2^3 events (several chunks, several workers)."""
    monkeypatch.setattr(audit_verify, "CHUNK_LEVEL", LEVEL)


def _no_exact_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("the exact pass ran")

    monkeypatch.setattr(audit_svc, "iter_leaf_hashes", refuse)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_intact_log_is_proved_by_the_fast_pass_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_chunks: None, workers: int
):
    store, keys, path = _fill(tmp_path)
    with store.read() as s:
        want = {c: audit_log.root_at(s, c) for c in (1, 8, 17, 20, 39, N)}
    full, roots, slow = audit_verify.log_roots(path, N, list(want), workers=workers)
    assert (full, roots, slow) == (want[N], want, 0)
    _no_exact_pass(monkeypatch)
    report = audit_svc.verify_log(store, keys.verifier(store), "proofplane/test", workers=workers)
    assert report.ok and report.events == N, report.problems
    store.dispose()


@pytest.mark.parametrize("level", [None, 0, 1, 2, 3, 4, 5, 6, 16])
def test_every_chunk_size_gives_the_stored_roots(tmp_path: Path, level: int | None):
    store, _keys, path = _fill(tmp_path)
    cuts = [0, 1, 2, 3, 4, 5, 8, 9, 16, 31, 32, 33, 39, N]
    with store.read() as s:
        want = {c: audit_log.root_at(s, c) if c else audit_verify.merkle.EMPTY_ROOT for c in cuts}
    assert audit_verify.log_roots(path, N, cuts, workers=1, chunk_level=level) == (
        want[N],
        want,
        0,
    )
    store.dispose()


def test_the_default_chunks_shrink_to_give_every_worker_several():
    """1M events: chunks of 2^16 for one worker; 2^15 (31 chunks) for two; never below
    2^13; an explicit level is kept."""
    one = audit_verify.chunk_bounds(1_000_000, 1)
    two = audit_verify.chunk_bounds(1_000_000, 2)
    for bounds, size in ((one, 1 << 16), (two, 1 << 15)):
        assert bounds[0] == (0, size) and bounds[-1][1] == 1_000_000
        assert all(hi - lo == size and lo % size == 0 for lo, hi in bounds[:-1])
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert len(two) == 31
    assert audit_verify.chunk_bounds(100_000, 4)[0] == (0, 1 << 13)
    assert audit_verify.chunk_bounds(100, 4) == [(0, 100)]
    assert audit_verify.chunk_bounds(20, 2, 3) == [(0, 8), (8, 16), (16, 20)]
    assert audit_verify.chunk_bounds(0, 2) == []


FIRST, MIDDLE, LAST = 1, 22, N  # seq (index + 1); 22: the first of its transaction


def _alter(column: str, value: str):
    return lambda seq: [f"UPDATE events SET {column} = {value} WHERE seq = {seq}"]


ATTACKS = {
    "actor": _alter("actor", "'mallory'"),
    "action": _alter("action", "'workload.evict'"),
    # the action of the row before (or after): the same parts as a neighbour's, not its own
    # parts (action, target type, outcome) that another row of the chunk has
    "parts-of-another-row": lambda seq: [
        "UPDATE events SET (action, target_type, outcome) = (SELECT action, target_type, "
        "outcome FROM events AS o WHERE o.action != events.action "
        f"ORDER BY abs(o.seq - {seq}), o.seq LIMIT 1) WHERE seq = {seq}"
    ],
    # every repeated part (ts, actor, action, target type, outcome) as the nearest row with
    # other ones has them, the row before where it can (the middle row is the first of its
    # transaction): what the parts kept from one row to the next are
    "parts-of-a-near-row": lambda seq: [
        "UPDATE events SET (ts, actor, action, target_type, outcome) = (SELECT ts, actor, "
        "action, target_type, outcome FROM events AS o WHERE NOT (o.ts = events.ts AND "
        "o.actor = events.actor AND o.action = events.action AND o.target_type = "
        "events.target_type AND o.outcome = events.outcome) "
        f"ORDER BY abs(o.seq - {seq}), o.seq LIMIT 1) WHERE seq = {seq}"
    ],
    "target_type": _alter("target_type", "'tenant'"),
    "target_id": _alter("target_id", "'t-999'"),
    "outcome": _alter("outcome", "'failure'"),
    "details": _alter("details", """'{"i":0,"node":"gpu-0","tags":{"hipaa":"false"}}'"""),
    "details-spaced": _alter("details", """'{"i": 99}'"""),  # not canonical: exact path
    "ts": _alter("ts", "substr(ts, 1, 25) || '1'"),
    "ts-as-next-tx": _alter("ts", "'2026-11-23 09:01:00.250000'"),
    "blob": _alter("actor", "CAST(actor AS BLOB)"),
    "delete": lambda seq: [f"DELETE FROM events WHERE seq = {seq}"],
    "reorder": lambda seq: [  # swap with a neighbour
        f"UPDATE events SET seq = -1 WHERE seq = {seq}",
        f"UPDATE events SET seq = {seq} WHERE seq = {seq + 1 if seq < N else seq - 1}",
        f"UPDATE events SET seq = {seq + 1 if seq < N else seq - 1} WHERE seq = -1",
    ],
}


@pytest.mark.parametrize("seq", [FIRST, MIDDLE, LAST], ids=["first", "middle", "last"])
@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("workers", [1, 2])
def test_a_tampered_row_is_never_accepted_and_is_named(
    tmp_path: Path, small_chunks: None, attack: str, seq: int, workers: int
):
    store, keys, path = _fill(tmp_path)
    with store.read() as s:
        want = audit_log.root_at(s, N)
    _attack(store, *ATTACKS[attack](seq))

    # the fast pass itself: no root that matches, or no root at all
    try:
        full, roots, _slow = audit_verify.log_roots(path, N, [N], workers=workers)
    except audit_verify.Unverifiable:
        pass
    else:
        assert full != want and roots[N] != want

    report = audit_svc.verify_log(store, keys.verifier(store), "proofplane/test", workers=workers)
    assert not report.ok
    # the last row is swapped with the one before it
    expected = N - 2 if attack == "reorder" and seq == LAST else seq - 1
    assert report.first_bad_index == expected, report.problems
    store.dispose()


def test_a_gap_in_seq_is_caught_even_with_the_right_row_count(tmp_path: Path, small_chunks):
    """A row moved past the end (seq N+1) leaves the chunk one short and the count of rows
    the same: the fast pass refuses it, the exact pass names the gap."""
    store, keys, path = _fill(tmp_path)
    _attack(store, f"UPDATE events SET seq = {N + 1} WHERE seq = 13")
    with pytest.raises(audit_verify.Unverifiable):
        audit_verify.log_roots(path, N, [N], workers=1)
    report = audit_svc.verify_log(store, keys.verifier(store), "proofplane/test")
    assert not report.ok and report.first_bad_index == 12, report.problems
    store.dispose()


GOOD = (1, "2026-11-23 09:00:00.250000", "system", "a.b", "node", "n1", "success", '{"k":1}')


@pytest.mark.parametrize(
    "row",
    [
        (1, None, None, None, None, "n1", None, '{"k":1}'),  # NULLs (the schema rewritten)
        (1, GOOD[1], b"system", *GOOD[3:]),  # a blob
        (1, GOOD[1], 7, *GOOD[3:]),  # a number
        (1, GOOD[1], "system", "a.b", "node", "n1", "success", b'{"k":1}'),
        ("1", *GOOD[1:]),
        (1, "2026-11-23T09:00:00.250000", *GOOD[2:]),  # ts not as stored
        (1, '2026-11-23 09:00:00"', *GOOD[2:]),
    ],
)
def test_the_laid_out_leaves_refuse_what_is_no_stored_event(row):
    """As the first row, and after a good row with the same other columns."""
    for rows in ([row], [GOOD, (2, *row[1:]) if isinstance(row[0], int) else row]):
        with pytest.raises((TypeError, ValueError)):
            audit_verify._laid_out_leaves(rows)


def test_the_laid_out_leaves_are_the_exact_leaves():
    rows = [GOOD, (2, *GOOD[1:]), (3, GOOD[1], "alice", *GOOD[3:]), (4, *GOOD[1:])]
    rows.append((5, "2026-11-23 09:00:01.000000", 'q"\\\u2028', "x\ny", "t", "é", "denied", "{}"))
    assert audit_verify._laid_out_leaves(rows) == [audit_verify.exact_leaf(r) for r in rows]
