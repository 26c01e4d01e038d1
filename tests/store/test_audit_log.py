"""The Merkle log on the database (SQLite and PostgreSQL): hashes written with the events,
proofs from O(log n) stored hashes equal to the pure functions over the exported entries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from proofplane.access import SYSTEM
from proofplane.audit import merkle
from proofplane.audit.canonical import entry_bytes
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.store import audit_log
from proofplane.store.tables import AuditHashRow, EventRow

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def _write(store: Store, batches: list[int]) -> None:
    n = 0
    for size in batches:
        with store.write(SYSTEM, now=T0 + timedelta(seconds=n)) as tx:
            for _ in range(size):
                n += 1
                tx.record(
                    "test.thing",
                    "thing",
                    f"t{n}",
                    details={"n": n, "tags": ("hipaa", "gdpr"), "x": 0.5, "s": "é\n"},
                )


def _entries(store: Store) -> list[bytes]:
    with store.read() as s:
        rows = s.scalars(select(EventRow).order_by(EventRow.seq)).all()
        return [entry_bytes(event_from_row(r)) for r in rows]


def test_stored_id_layout_is_append_only():
    ids = []
    for n in range(64):
        ids.append(audit_log.node_id(0, n))
        level = 1
        while (n + 1) % (1 << level) == 0:
            ids.append(audit_log.node_id(level, ((n + 1) >> level) - 1))
            level += 1
    assert ids == list(range(len(ids)))
    for n in range(200):
        assert audit_log.size_from_count(audit_log.stored_before(n)) == n


def test_hashes_written_with_events_and_proofs_match(store: Store):
    _write(store, [1, 2, 5, 1, 13, 3, 8])
    entries = _entries(store)
    n = len(entries)
    assert n == 33
    with store.read() as s:
        assert audit_log.tree_size(s) == n
        assert s.scalar(select(func.count()).select_from(AuditHashRow)) == audit_log.stored_before(
            n
        )
        for size in range(1, n + 1):
            assert audit_log.root_at(s, size) == merkle.root(entries[:size])
        for size in (1, 2, 7, 16, 33):
            for i in range(size):
                leaf, proof = audit_log.inclusion(s, i, size)
                assert leaf == merkle.leaf_hash(entries[i])
                assert proof == merkle.inclusion_proof(entries, i, size)
        for old in range(1, n + 1):
            for new in (old, 17, 32, n):
                if new >= old:
                    assert audit_log.consistency(s, old, new) == merkle.consistency_proof(
                        entries, old, new
                    )


def test_rolled_back_transaction_leaves_no_hashes(store: Store):
    _write(store, [3])
    with pytest.raises(RuntimeError), store.write(SYSTEM) as tx:
        tx.record("test.thing", "thing", "doomed")
        raise RuntimeError("crash between the change and the commit")
    with store.read() as s:
        assert audit_log.tree_size(s) == 3
        assert s.scalar(select(func.max(EventRow.seq))) == 3
    _write(store, [2])
    assert len(_entries(store)) == 5


def test_proof_requests_out_of_range(store: Store):
    _write(store, [4])
    with store.read() as s:
        for index, size in [(4, 4), (-1, 4), (0, 5), (0, 0)]:
            with pytest.raises(audit_log.ProofRangeError):
                audit_log.inclusion(s, index, size)
        for old, new in [(0, 4), (3, 2), (2, 5), (-1, 3)]:
            with pytest.raises(audit_log.ProofRangeError):
                audit_log.consistency(s, old, new)


def test_a_damaged_edge_hash_is_log_corruption_not_a_bare_value_error(store: Store):
    _write(store, [3])  # size 3: the edge is node (1, 0) and leaf 2
    edge_id = audit_log.node_id(0, 2)
    with store.write(SYSTEM, now=T0) as tx:
        tx.session.execute(
            update(AuditHashRow).where(AuditHashRow.id == edge_id).values(hash=b"\x00" * 31)
        )
    with store.read() as s, pytest.raises(audit_log.LogCorrupted, match="right edge"):
        audit_log.Appender.load(s, 3)


def _leaves(n: int) -> list[bytes]:
    return [merkle.leaf_hash(f"leaf-{i}".encode()) for i in range(n)]


def _appended(leaves: list[bytes]) -> audit_log.Appender:
    out = audit_log.Appender()
    out.append_leaves(leaves)
    return out


def test_an_edge_extended_by_the_stored_hashes_is_the_edge_of_the_longer_log() -> None:
    """``Appender.extended`` (issue 20: another writer's appends, come with the write lock)
    gives the edge appending the same leaves gives, for every pair of sizes up to 40, and
    leaves nothing to store."""
    for size in range(0, 40):
        for more in range(1, 41 - size):
            leaves = _leaves(size + more)
            stored = list(enumerate(_appended(leaves).pending))  # ids are storage order
            edge = _appended(leaves[:size]).range.hashes
            out = audit_log.Appender.extended(
                size, edge, stored[audit_log.stored_before(size) :], size + more
            )
            whole = _appended(leaves)
            assert (out.size, out.range.hashes, out.pending) == (
                whole.size,
                whole.range.hashes,
                [],
            )


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("drop_last", "holds hashes"),  # fewer stored than the events say
        ("extra", "holds hashes"),  # a hash past the log the events make
        ("subtree", "not those of its leaves"),  # a subtree's hash not its leaves'
        ("short", "damaged"),  # a leaf hash that is not 32 bytes
    ],
)
def test_an_edge_is_not_extended_by_hashes_that_are_not_the_logs(damage: str, match: str) -> None:
    size, to = 5, 12  # leaves 5..11 complete subtrees of 2, 4 and 8
    leaves = _leaves(to + 1)
    stored = list(enumerate(_appended(leaves[:to]).pending))[audit_log.stored_before(size) :]
    if damage == "drop_last":
        stored = stored[:-1]
    elif damage == "extra":
        stored.append((stored[-1][0] + 1, leaves[to]))
    elif damage == "subtree":
        last_id, _ = stored[-1]  # the last hash stored: the subtree leaf 11 completes
        stored[-1] = (last_id, b"\x00" * 32)
    else:
        first_id, _ = stored[0]  # leaf 5
        stored[0] = (first_id, b"\x01" * 31)
    edge = _appended(leaves[:size]).range.hashes
    with pytest.raises(audit_log.LogCorrupted, match=match):
        audit_log.Appender.extended(size, edge, stored, to)
