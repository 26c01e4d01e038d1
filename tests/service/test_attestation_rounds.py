"""One attestation round at fleet scale (issue 20): what the server may remember between rounds
and what it must check anew every time, the statements a round costs, and the staleness pass
that reads only stale nodes.

The server keeps a memo of pure functions of bytes (``VERIFIER_CACHE``: an event log's parse and
replay by its SHA-256, parsed AKs by their bytes) and of parsed policies by their hash; never a
verdict. So a log seen before still has its replay compared with the quote, every quote's
signature and nonce are checked, and a policy changed between two rounds judges the second.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event

from proofplane.access import SYSTEM, Actor, Forbidden
from proofplane.attest import Evidence, Policy
from proofplane.attest import eventlog as el
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.demo.attester import BOOTLOADERS, DEMO_POLICY, GOOD_KERNEL
from proofplane.model import Gpu, Node, NodeState
from proofplane.service import attestation as svc
from proofplane.service.context import Store
from proofplane.service.nodes import get_node, register_node, set_node_state

LOG = demo_boot_log(GOOD_KERNEL, bootloaders=BOOTLOADERS)
T0 = datetime(2026, 11, 27, 12, tzinfo=UTC)
# SQL statements of one round on PostgreSQL (every one goes through SQLAlchemy there): nonce =
# node + identity and policy, a read (the nonce carries its own authenticated issue time);
# evidence = the lock and the newest seq (one round trip), node + identity, the policies, INSERT
# the spent nonce (nothing returned for a replay), INSERT evidence, GPU uuids, the event's four
# (Merkle size, its edge, INSERT event, INSERT its leaf hash), UPDATE the identity. The Merkle
# log's subtree hashes, one more INSERT each time the log's size completes one, are left out.
# Before issue 20's change: 12 and 15; before the MAC nonce: 9 (the write lock, an INSERT and an
# event) and 12; 12 for the evidence until the newest seq came with the lock. Rounds committed
# as a group share the lock, the policies, the log's reads and the commit.
BUDGET = {"nonce": 2, "evidence": 11}
STALE_PASS_STATEMENTS = (
    3  # a pass that finds nothing stale: policies + stale nodes (+ BEGIN on SQLite)
)
BUDGET_SQLITE = {"nonce": 4, "evidence": 13}  # SQLite: BEGIN and COMMIT counted too


def _node(store: Store, name: str, labels: dict[str, str] | None = None) -> None:
    gpus = (Gpu(0, f"GPU-{name}", "H100-80GB", 81920),)
    register_node(store, SYSTEM, Node(name, "r1", "z1", gpus=gpus, labels=labels or {}))


def _enrolled(store: Store, name: str, labels: dict[str, str] | None = None) -> SimulatedAttester:
    _node(store, name, labels)
    a = SimulatedAttester.create()
    a.boot(LOG)
    actor = Actor(f"node:{name}")
    challenge = svc.enroll(store, actor, name, a.ek_public, a.ak_public,
                           simulated=True, allow_simulated=True, now=T0)  # fmt: skip
    svc.activate(store, actor, name, a.activate(challenge.credential), now=T0)
    return a


def _evidence(store: Store, a: SimulatedAttester, now: datetime = T0) -> tuple[bytes, Evidence]:
    """A fresh nonce for n1 and the attester's evidence over it."""
    issued = svc.issue_nonce(store, SYSTEM, "n1", now=now)
    return issued.nonce, a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)


def _submit(store: Store, nonce: bytes, ev: Evidence, *, demo: bool = True) -> list[str]:
    """Submit n1's evidence; the verdict's reasons ([] when it passed)."""
    out = svc.submit_evidence(store, SYSTEM, "n1", nonce, ev, now=T0, allow_simulated=demo)
    assert out.verdict["ok"] == (not out.verdict["reasons"])
    return list(out.verdict["reasons"])


def _round(
    store: Store, name: str, a: SimulatedAttester, now: datetime = T0, **change: Any
) -> dict[str, Any]:
    """Issue a nonce, make the evidence (``change``: fields of it replaced), submit it."""
    issued = svc.issue_nonce(store, SYSTEM, name, now=now)
    ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)
    out = svc.submit_evidence(store, SYSTEM, name, issued.nonce, replace(ev, **change),
                              now=now, allow_simulated=True)  # fmt: skip
    return out.verdict


@pytest.fixture
def attested(store: Store) -> Iterator[tuple[Store, SimulatedAttester]]:
    svc.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    a = _enrolled(store, "n1")
    assert _round(store, "n1", a)["ok"]
    yield store, a


def test_a_tampered_log_of_the_same_length_is_refused_after_the_genuine_one_was_seen(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    store, a = attested
    kernel = next(e for e in el.parse_eventlog(LOG).events if e.pcr == 9)
    at = LOG.index(kernel.digests["sha256"])
    tampered = LOG[:at] + bytes([LOG[at] ^ 1]) + LOG[at + 1 :]
    assert len(tampered) == len(LOG)
    v = _round(store, "n1", a, eventlog=tampered)
    assert not v["ok"] and "eventlog_replay_mismatch" in v["reasons"]
    assert get_node(store, SYSTEM, "n1").state == NodeState.QUARANTINED
    assert _round(store, "n1", a)["ok"]  # the genuine log again (from the memo): released
    assert get_node(store, SYSTEM, "n1").state == NodeState.ADMITTED


def test_a_remembered_log_does_not_excuse_a_quote_over_another_nonce(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    store, a = attested
    nonce, ev = _evidence(store, a)
    other = a.evidence(b"\x42" * 32, sorted(ev.pcrs["sha256"]))
    hits = svc.VERIFIER_CACHE.hits
    assert _submit(store, nonce, other) == ["nonce_mismatch"]
    assert svc.VERIFIER_CACHE.hits == hits + 1  # the log's replay came from the memo


def test_a_remembered_log_is_still_compared_with_the_quoted_pcrs(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    store, a = attested
    # PCR values that do not hash to the quote's pcrDigest
    nonce, ev = _evidence(store, a)
    pcrs = {b: dict(v) for b, v in ev.pcrs.items()}
    pcrs["sha256"][9] = bytes(32)
    assert _submit(store, nonce, replace(ev, pcrs=pcrs)) == ["pcr_digest_mismatch"]
    # a TPM that measured one more thing than its log says: the quote is self-consistent,
    # the log (same bytes, its replay from the memo) does not give the quoted PCR 9
    a.soft.extend(9, {"sha256": bytes(32), "sha1": bytes(20)})
    hits = svc.VERIFIER_CACHE.hits
    v = _round(store, "n1", a)
    assert not v["ok"] and v["reasons"] == ["eventlog_replay_mismatch"]
    assert svc.VERIFIER_CACHE.hits == hits + 1


def test_a_policy_changed_between_two_rounds_judges_the_second(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    store, a = attested
    stricter = {**DEMO_POLICY, "id": "stricter", "allowed_kernels": ["00" * 32]}
    svc.set_policy(store, SYSTEM, stricter, enforce=True)
    v = _round(store, "n1", a)
    assert not v["ok"] and v["reasons"] == ["kernel_not_allowed"]
    assert v["policy_id"] == "stricter"
    assert get_node(store, SYSTEM, "n1").state == NodeState.QUARANTINED
    svc.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    v = _round(store, "n1", a)
    assert v["ok"] and v["policy_id"] == DEMO_POLICY["id"]
    assert get_node(store, SYSTEM, "n1").state == NodeState.ADMITTED


def test_rounds_sent_together_commit_together_and_each_gets_its_own_verdict(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit (``Store.write_grouped``): rounds that wait while one holds the write lock
    are recorded in one transaction after it, each with its own verdict, event and actor (a
    round over another node's nonce is refused in the group, as a verdict). The log stays
    gap-free and verifies."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import select

    from proofplane.service import audit as audit_svc
    from proofplane.store.tables import EventRow

    svc.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    names = [f"g{i}" for i in range(6)]
    agents = {n: _enrolled(store, n) for n in names}
    rounds = {}
    for n in names:
        issued = svc.issue_nonce(store, SYSTEM, n, now=T0)
        rounds[n] = (issued.nonce, agents[n].evidence(issued.nonce, list(issued.pcrs)))
    rounds["g5"] = rounds["g4"][0], rounds["g5"][1]  # g4's nonce: not g5's, refused
    hold, queued = threading.Event(), threading.Event()
    record = svc._record_round
    transactions: list[list[str]] = []

    def held(tx: Any, r: Any) -> Any:
        if not transactions or transactions[-1][0] is not tx:
            transactions.append([tx])  # type: ignore[list-item]
        transactions[-1].append(r.name)
        if r.name == "g0":
            queued.wait(10)  # the others queue meanwhile
        return record(tx, r)

    monkeypatch.setattr(svc, "_record_round", held)

    def send(n: str) -> tuple[str, Any]:
        if n != "g0":
            hold.wait(10)
        nonce, ev = rounds[n]
        out = svc.submit_evidence(store, Actor(f"node:{n}"), n, nonce, ev, now=T0,
                                  allow_simulated=True)  # fmt: skip
        return n, out.verdict["reasons"]

    with ThreadPoolExecutor(len(names)) as pool:
        first = pool.submit(send, "g0")
        while not transactions:
            threading.Event().wait(0.01)
        hold.set()
        rest = [pool.submit(send, n) for n in names[1:]]
        group = store._groups[held]
        for _ in range(1000):
            if len(group.queue) == len(names) - 1:
                break
            threading.Event().wait(0.01)
        queued.set()
        got = dict([first.result(), *(f.result() for f in rest)])
    assert got == {**{n: [] for n in names[:5]}, "g5": ["nonce_unknown"]}
    # g0 alone, then the other five in one transaction (the refused one with them: a verdict)
    assert [len(t) - 1 for t in transactions] == [1, 5]
    with store.read() as session:
        attests = session.execute(
            select(EventRow.actor, EventRow.target_id).where(EventRow.action == "node.attest")
            .where(EventRow.target_id.in_(names))
        ).all()  # fmt: skip
        seqs = list(session.scalars(select(EventRow.seq).order_by(EventRow.seq)))
    assert sorted(attests) == sorted((f"node:{n}", n) for n in names)
    assert seqs == list(range(1, len(seqs) + 1))
    report = audit_svc.verify_log(store, [])
    assert report.ok and report.first_bad_index is None
    assert report.events == report.tree_size == len(seqs)


def test_a_policy_document_is_parsed_once_and_each_document_gets_its_own() -> None:
    doc = {**DEMO_POLICY, "id": "memo"}
    first = svc.parsed_policy(doc)
    assert svc.parsed_policy(dict(reversed(list(doc.items())))) is first  # the same document
    assert first.to_json() == Policy.from_json(doc).to_json()
    other = svc.parsed_policy({**doc, "allowed_kernels": ["00" * 32]})
    assert other is not first and other.hash != first.hash
    assert other.allowed_kernels == frozenset({bytes(32)})


def test_unknown_and_replayed_nonces_are_still_told_apart(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    store, a = attested
    nonce, ev = _evidence(store, a)
    assert _submit(store, nonce, ev) == []
    assert _submit(store, nonce, ev) == ["nonce_replayed"]
    assert _submit(store, b"\x01" * 32, ev) == ["nonce_unknown"]
    # outside demo mode the simulated attester is refused, and the nonce is spent all the same
    nonce, ev = _evidence(store, a)
    assert _submit(store, nonce, ev, demo=False) == ["simulated_attester_refused"]
    assert _submit(store, nonce, ev) == ["nonce_replayed"]


def test_a_round_stays_within_its_statements(
    attested: tuple[Store, SimulatedAttester], db_url: str
) -> None:
    """Every statement a round runs, counted on the connection: on PostgreSQL through
    SQLAlchemy's cursor hook, on SQLite by the driver's trace callback (the audit log appends
    through the DB-API connection there, which the hook does not see; the trace also shows
    BEGIN and COMMIT)."""
    store, a = attested
    seen: list[str] = []
    sqlite = not db_url.startswith("postgresql")
    budget = BUDGET_SQLITE if sqlite else BUDGET

    def merkle_subtree(statement: str) -> bool:
        """An audit_hashes INSERT after the leaf's: a subtree the new leaf completed."""
        return statement.startswith("INSERT INTO audit_hashes") and any(
            s.startswith("INSERT INTO audit_hashes") for s in seen
        )

    def count(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if not merkle_subtree(statement):
            seen.append(statement)

    def traced(statement: str) -> None:
        # a new connection's settings, and the subtree hashes
        if not statement.startswith("PRAGMA") and not merkle_subtree(statement):
            seen.append(statement)

    def trace(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.set_trace_callback(traced)

    if sqlite:
        event.listen(store.engine, "connect", trace)
        store.engine.dispose()  # new connections, each traced
    else:
        event.listen(store.engine, "before_cursor_execute", count)
    try:
        for _ in range(5):  # the Merkle edge differs at each size: the budget holds at any
            seen.clear()
            nonce, ev = _evidence(store, a)
            assert 0 < len(seen) <= budget["nonce"], seen
            seen.clear()
            assert _submit(store, nonce, ev) == []
            assert 0 < len(seen) <= budget["evidence"], seen
    finally:
        if sqlite:
            event.remove(store.engine, "connect", trace)
            store.engine.dispose()
        else:
            event.remove(store.engine, "before_cursor_execute", count)


def test_staleness_reads_policies_by_class_and_quarantines_only_stale_nodes(
    store: Store,
) -> None:
    svc.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    lab = {**DEMO_POLICY, "id": "lab", "node_class": "lab"}
    svc.set_policy(store, SYSTEM, lab, enforce=False)
    fresh = _enrolled(store, "fresh")
    stale = _enrolled(store, "stale")
    in_lab = _enrolled(store, "in-lab", {"node-class": "lab"})
    classless = _enrolled(store, "classless", {"node-class": "nobody-has-this-class"})
    _node(store, "never")  # registered, never enrolled: not in service, not checked
    for name, a in (("stale", stale), ("in-lab", in_lab), ("classless", classless)):
        assert _round(store, name, a)["ok"]
    # a non-enforcing policy admits nobody: the lab node is put in service by hand
    set_node_state(store, SYSTEM, "in-lab", NodeState.ADMITTED, "lab bench")
    later = T0 + timedelta(minutes=10)
    assert _round(store, "fresh", fresh, now=later)["ok"]
    grace = timedelta(minutes=5)
    # the lab's policy does not enforce; the classless node falls back to the default one
    assert svc.check_stale(store, SYSTEM, grace, now=later) == ["classless", "stale"]
    for name, state in (("fresh", NodeState.ADMITTED), ("in-lab", NodeState.ADMITTED),
                        ("stale", NodeState.QUARANTINED), ("classless", NodeState.QUARANTINED),
                        ("never", NodeState.REGISTERED)):  # fmt: skip
        assert get_node(store, SYSTEM, name).state == state, name
    assert "last pass" in (get_node(store, SYSTEM, "stale").state_reason or "")
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:  # nothing stale now: the policies and the stale nodes are read, nothing per node
        assert svc.check_stale(store, SYSTEM, grace, now=later) == []  # already quarantined
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    assert 0 < len(seen) <= STALE_PASS_STATEMENTS, seen


# --- the nonce: a read, checked by its MAC, spent once --------------------------------------


def _count(store: Store, table: Any, **where: Any) -> int:
    from sqlalchemy import func, select

    with store.read() as session:
        q = select(func.count()).select_from(table)
        for column, value in where.items():
            q = q.where(getattr(table.c, column) == value)
        return int(session.execute(q).scalar_one())


def test_issuing_a_nonce_writes_nothing_and_its_evidence_spends_it_once(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    from proofplane.store.tables import AttestationNonceRow, EventRow

    store, a = attested
    events, spent = EventRow.__table__, AttestationNonceRow.__table__
    before = (_count(store, events), _count(store, spent))
    issued = [svc.issue_nonce(store, SYSTEM, "n1", now=T0) for _ in range(3)]
    assert len({i.nonce for i in issued}) == 3
    assert (_count(store, events), _count(store, spent)) == before  # no event, no row
    ev = a.evidence(issued[1].nonce, list(issued[1].pcrs), issued[1].pcr_bank)
    assert _submit(store, issued[1].nonce, ev) == []
    assert _count(store, events) == before[0] + 1  # the verdict's node.attest, nothing else
    with store.read() as session:
        row = session.execute(spent.select().where(spent.c.nonce == issued[1].nonce.hex())).one()
    assert (row.issued_at, row.used_at) == (issued[1].issued_at, T0)
    assert row.expires_at == issued[1].expires_at
    assert _submit(store, issued[1].nonce, ev) == ["nonce_replayed"]
    assert _count(store, spent) == before[1] + 1  # a replay spends nothing more


def test_the_nonce_key_is_made_once_sealed_and_shared_by_every_process(
    attested: tuple[Store, SimulatedAttester], db_url: str
) -> None:
    from sqlalchemy import select

    from proofplane.store.tables import AttestationNonceKeyRow, EventRow

    store, a = attested
    key = svc.nonce_key(store, SYSTEM)
    assert key is not None and len(key) == 32
    with store.read() as session:
        rows = session.scalars(select(AttestationNonceKeyRow)).all()
        made = session.scalars(
            select(EventRow).where(EventRow.action == "attest.nonce_key.create")
        ).all()
    assert len(rows) == 1 and len(made) == 1
    assert key.hex() not in rows[0].key_sealed and key not in rows[0].key_sealed.encode()
    # another process (or replica) on the database: it opens the same key, so a nonce one
    # issued is judged by the other, and spent for both
    other = Store(db_url)
    try:
        assert other.nonce_key is None
        issued = svc.issue_nonce(store, SYSTEM, "n1", now=T0)
        ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)
        out = svc.submit_evidence(other, SYSTEM, "n1", issued.nonce, ev, now=T0,
                                  allow_simulated=True)  # fmt: skip
        assert out.verdict["ok"] and other.nonce_key == key
        assert _submit(store, issued.nonce, ev) == ["nonce_replayed"]
    finally:
        other.dispose()
    with store.read() as session:
        again = session.scalars(select(AttestationNonceKeyRow)).all()
    assert [(r.id, r.key_sealed) for r in again] == [(rows[0].id, rows[0].key_sealed)]


def test_a_nonce_is_accepted_only_from_its_node_unaltered_and_fresh(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    store, a = attested
    b = _enrolled(store, "n2")
    issued = svc.issue_nonce(store, SYSTEM, "n1", now=T0)
    # n2 answers with a quote over n1's nonce: not a nonce issued to n2
    ev = b.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)
    out = svc.submit_evidence(store, SYSTEM, "n2", issued.nonce, ev, now=T0,
                              allow_simulated=True)  # fmt: skip
    assert out.verdict["reasons"] == ["nonce_unknown"]
    # an issue time moved (its MAC no longer matches)
    moved = bytearray(issued.nonce)
    moved[6] ^= 1
    ev = a.evidence(bytes(moved), list(issued.pcrs), issued.pcr_bank)
    assert _submit(store, bytes(moved), ev) == ["nonce_unknown"]
    # n1's own nonce, still unspent by n2's attempt, passes
    ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)
    assert _submit(store, issued.nonce, ev) == []
    # a nonce issued an hour before its evidence: authentic, but expired (2 minutes), and
    # refused as such before any verification; it is not recorded as spent
    old = svc.issue_nonce(store, SYSTEM, "n1", now=T0 - timedelta(hours=1))
    assert old.expires_at == old.issued_at + svc.NONCE_TTL
    ev = a.evidence(old.nonce, list(old.pcrs), old.pcr_bank)
    assert _submit(store, old.nonce, ev) == ["nonce_expired"]
    assert _submit(store, old.nonce, ev) == ["nonce_expired"]  # still expired, not replayed
    # at its expiry it still counts; a millisecond later it does not
    edge = svc.issue_nonce(store, SYSTEM, "n1", now=T0 - svc.NONCE_TTL)
    ev = a.evidence(edge.nonce, list(edge.pcrs), edge.pcr_bank)
    assert _submit(store, edge.nonce, ev) == []
    late = svc.issue_nonce(store, SYSTEM, "n1", now=T0 - svc.NONCE_TTL - timedelta(milliseconds=1))
    ev = a.evidence(late.nonce, list(late.pcrs), late.pcr_bank)
    assert _submit(store, late.nonce, ev) == ["nonce_expired"]


def test_evidence_before_any_nonce_was_issued_is_an_unknown_nonce(store: Store) -> None:
    from sqlalchemy import select

    from proofplane.store.tables import AttestationNonceKeyRow

    svc.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    a = _enrolled(store, "n1")
    ev = a.evidence(b"\x01" * 32, [0], "sha256")
    assert _submit(store, b"\x01" * 32, ev) == ["nonce_unknown"]
    with store.read() as session:  # judging it made no key
        assert session.scalars(select(AttestationNonceKeyRow)).all() == []


def test_one_nonce_sent_twice_at_once_through_two_stores_passes_once(
    attested: tuple[Store, SimulatedAttester], db_url: str
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store, a = attested
    other = Store(db_url)
    try:
        issued = svc.issue_nonce(store, SYSTEM, "n1", now=T0)
        ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)

        def send(s: Store) -> list[str]:
            out = svc.submit_evidence(s, SYSTEM, "n1", issued.nonce, ev, now=T0,
                                      allow_simulated=True)  # fmt: skip
            return list(out.verdict["reasons"])

        with ThreadPoolExecutor(2) as pool:
            got = sorted(map(tuple, pool.map(send, [store, other])))
        assert got == [(), ("nonce_replayed",)]
    finally:
        other.dispose()


def test_spent_nonces_are_forgotten_once_they_can_no_longer_be_presented(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    from proofplane.store.tables import AttestationNonceRow, EventRow

    store, a = attested
    spent = AttestationNonceRow.__table__
    first, ev_first = _evidence(store, a)  # issued and spent at T0
    assert _submit(store, first, ev_first) == []
    assert svc.prune_spent_nonces(store, SYSTEM, now=T0) == 0  # all still young: a read
    later = T0 + svc.SPENT_NONCE_KEEP
    issued = svc.issue_nonce(store, SYSTEM, "n1", now=later)
    ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)
    out = svc.submit_evidence(store, SYSTEM, "n1", issued.nonce, ev, now=later,
                              allow_simulated=True)  # fmt: skip
    assert out.verdict["ok"] and _count(store, spent) == 3  # the fixture's, first, this one
    events = _count(store, EventRow.__table__)
    # the two issued at T0 are past keeping; the one just spent is not
    assert svc.prune_spent_nonces(store, SYSTEM, now=later + timedelta(milliseconds=1)) == 2
    assert _count(store, spent) == 1 and _count(store, spent, nonce=issued.nonce.hex()) == 1
    assert _count(store, EventRow.__table__) == events  # bookkeeping, not a record
    assert svc.prune_spent_nonces(store, SYSTEM, now=later) == 0
    # a forgotten nonce sent again is still refused: it expired before it was forgotten
    out = svc.submit_evidence(store, SYSTEM, "n1", first, ev_first, now=later,
                              allow_simulated=True)  # fmt: skip
    assert out.verdict["reasons"] == ["nonce_expired"]


def test_pruning_spent_nonces_is_for_operators(store: Store) -> None:
    with pytest.raises(Forbidden):
        svc.prune_spent_nonces(store, Actor("node:n1"))


def test_the_staleness_pass_forgets_spent_nonces_too(
    attested: tuple[Store, SimulatedAttester],
) -> None:
    from proofplane.store.tables import AttestationNonceRow
    from proofplane.workers import StaleWorker

    store, _a = attested
    worker = StaleWorker(store, interval_s=60, grace=timedelta(days=1))
    assert worker.run_once(now=T0) == [] and worker.nonces_pruned == 0
    assert worker.run_once(now=T0 + svc.SPENT_NONCE_KEEP + timedelta(seconds=1)) == []
    assert worker.nonces_pruned == 1  # the fixture's round
    assert _count(store, AttestationNonceRow.__table__) == 0
