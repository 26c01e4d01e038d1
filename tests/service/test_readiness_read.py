"""The nodes placement reads to know which may not take new work (``netstate.load_readiness``,
issue 14; issue 20: read without ORM rows, and only the drifted ones). Whatever the reported
and desired states of the nodes, the readiness read is the one every reporting node gives:
a node in line with its desired state blocks nothing, so leaving it unread changes nothing."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.service import netstate
from proofplane.service.context import Store
from proofplane.store.tables import NodeNetworkRow, NodeRow

SHAS = ("a" * 64, "b" * 64, None)


def _every_reporting_node(store: Store) -> tuple[frozenset[str], dict[int, frozenset[str]]]:
    """The blocked-for-all nodes and the nodes blocked per segment, from every reporting node
    (what the readiness was read from before issue 20)."""
    blocked_all: set[str] = set()
    by_vni: dict[int, set[str]] = {}
    with store.read() as session:
        rows = session.execute(
            select(NodeNetworkRow, NodeRow.name)
            .join(NodeRow, NodeRow.id == NodeNetworkRow.node_id)
            .where(NodeNetworkRow.reported_at.is_not(None))
        ).all()
        for row, name in rows:
            if netstate.BLOCKS_ALL & set(netstate.drift_reasons(row)):
                blocked_all.add(name)
            for text, since in (row.segment_since or {}).items():
                if int(since) > (row.applied_generation or 0):
                    by_vni.setdefault(int(text), set()).add(name)
    return frozenset(blocked_all), {v: frozenset(n) for v, n in by_vni.items()}


def test_the_readiness_read_is_every_reporting_nodes(demo: Store) -> None:
    rnd = random.Random(20)
    with demo.read() as session:
        node_ids = list(session.scalars(select(NodeNetworkRow.node_id)))
    assert len(node_ids) >= 4
    seen_blocking = seen_none = 0
    for round_ in range(30):
        in_line = round_ % 3 == 0  # every node applied its desired state: nothing blocks
        with demo.write(SYSTEM) as tx:
            for nid in node_ids:
                row = tx.session.get(NodeNetworkRow, nid)
                assert row is not None
                row.desired_generation = rnd.randint(0, 5)
                # a segment arrives with a generation: never after the desired one
                row.segment_since = {
                    str(v): rnd.randint(1, row.desired_generation)
                    for v in rnd.sample([5001, 5002, 5003], rnd.randint(0, 2))
                    if row.desired_generation >= 1
                }
                row.desired_sha256 = rnd.choice(SHAS[:2])
                row.expected_ruleset_sha256 = rnd.choice(SHAS)
                if rnd.random() < 0.2:  # never reported: not under network management
                    row.reported_at = None
                    row.applied_generation = None
                else:
                    row.reported_at = datetime.now(UTC)
                    row.applied_generation = min(
                        row.desired_generation, rnd.choice([row.desired_generation] * 3 + [0, 1])
                    )
                    row.applied_sha256 = rnd.choice([row.desired_sha256] * 3 + [SHAS[1]])
                    row.ruleset_sha256 = rnd.choice([row.expected_ruleset_sha256] * 3 + [SHAS[0]])
                    row.self_check = {"ok": rnd.random() < 0.85}
                    if in_line:
                        row.applied_generation = row.desired_generation
                        row.applied_sha256 = row.desired_sha256
                        row.ruleset_sha256 = row.expected_ruleset_sha256
                        row.self_check = {"ok": True}
                row.drift = netstate.note_drift(row)  # as a report or a new generation sets it
            tx.record("test.readiness", "test", "states")
        blocked_all, by_vni = _every_reporting_node(demo)
        with demo.read() as session:
            got = netstate.load_readiness(session)
        if got is None:
            seen_none += 1
            assert (blocked_all, by_vni) == (frozenset(), {})
        else:
            seen_blocking += 1
            assert (got.blocked_all, dict(got.by_vni)) == (blocked_all, by_vni)
    assert seen_blocking and seen_none  # both outcomes were exercised
