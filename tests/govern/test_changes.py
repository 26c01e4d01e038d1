"""Change control (issue 12): a certification grant needs two other people's approvals of the
payload as it stands, applies exactly what the direct call does, atomically; separation of
duties holds (requester, last editor); an edit voids approvals; one denial denies; expired,
denied and unapproved requests never apply; an emergency change applies at once and is
reviewed afterwards, an overdue review raising an alert."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proofplane.access import SYSTEM, Actor, Role
from proofplane.errors import InvalidState, NotFound, ProofplaneError
from proofplane.govern import changes as rules
from proofplane.model import Gpu, Node, NodeState
from proofplane.service import changes as svc
from proofplane.service.context import Store
from proofplane.service.nodes import get_node, register_node, set_node_state
from proofplane.store import migrate
from proofplane.store.tables import EventRow

ALICE = Actor("alice", frozenset({Role.ADMIN}))
BOB = Actor("bob", frozenset({Role.ADMIN}))
SEC = Actor("sec", frozenset({Role.SECURITY_OFFICER}))
AUD = Actor("aud", frozenset({Role.AUDITOR}))
OPS = Actor("ops", frozenset({Role.OPERATOR}))
GRANT = {"node": "gpu-01", "key": "hipaa", "value": "true"}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'chg.db'}")
    migrate.upgrade(s.engine)
    register_node(
        s, SYSTEM, Node("gpu-01", "r1", "z1", gpus=(Gpu(0, "GPU-1", "H100-80GB", 81920),))
    )
    set_node_state(s, SYSTEM, "gpu-01", NodeState.ADMITTED, "test")
    return s


def _actions(store: Store) -> list[str]:
    with store.read() as session:
        return [e.action for e in session.query(EventRow).order_by(EventRow.seq)]


def test_two_other_people_approve_then_it_applies_what_the_direct_call_does(store: Store) -> None:
    change = svc.create_change(store, ALICE, "certification.grant", GRANT, reason="audit")
    assert change["state"] == "pending" and change["payload_sha256"] == rules.payload_sha256(GRANT)
    with pytest.raises(ProofplaneError) as own:
        svc.vote(store, ALICE, change["id"], "approve")
    assert own.value.code == "separation_of_duties"
    with pytest.raises(ProofplaneError) as auditor:
        svc.vote(store, AUD, change["id"], "approve")
    assert auditor.value.code == "not_an_approver"
    with pytest.raises(InvalidState) as early:
        svc.apply_change(store, ALICE, change["id"])
    assert early.value.code == "change_not_approved"
    assert svc.vote(store, BOB, change["id"], "approve", "ok")["state"] == "pending"
    with pytest.raises(ProofplaneError) as twice:
        svc.vote(store, BOB, change["id"], "approve")
    assert twice.value.code == "already_voted"
    assert svc.vote(store, SEC, change["id"], "approve")["state"] == "approved"
    with pytest.raises(ProofplaneError):  # the security officer applies nothing
        svc.apply_change(store, SEC, change["id"])
    applied = svc.apply_change(store, ALICE, change["id"])
    assert applied["state"] == "applied" and applied["applied_by"] == "alice"
    assert get_node(store, SYSTEM, "gpu-01").certifications == {"hipaa": "true"}
    acts = _actions(store)
    i = acts.index("change.apply")
    assert acts[i - 1] == "node.certification.grant"  # the direct call's own event, same tx
    with pytest.raises(InvalidState):
        svc.apply_change(store, ALICE, change["id"])  # never twice


def test_an_edit_voids_approvals_and_the_editor_cannot_approve(store: Store) -> None:
    change = svc.create_change(store, ALICE, "certification.grant", GRANT)
    svc.vote(store, BOB, change["id"], "approve")
    edited = svc.edit_change(store, BOB, change["id"], {**GRANT, "value": "false"})
    assert edited["payload_sha256"] != change["payload_sha256"] and edited["state"] == "pending"
    assert [a["current"] for a in edited["approvals"]] == [False]
    with pytest.raises(ProofplaneError) as editor:
        svc.vote(store, BOB, change["id"], "approve")
    assert editor.value.code == "separation_of_duties"
    svc.vote(store, SEC, change["id"], "approve")
    carol = Actor("carol", frozenset({Role.ADMIN}))
    assert svc.vote(store, carol, change["id"], "approve")["state"] == "approved"
    svc.apply_change(store, carol, change["id"])
    assert get_node(store, SYSTEM, "gpu-01").certifications == {"hipaa": "false"}


def test_one_denial_denies_and_expired_or_cancelled_never_apply(store: Store) -> None:
    denied = svc.create_change(store, ALICE, "certification.grant", GRANT)
    svc.vote(store, BOB, denied["id"], "approve")
    assert svc.vote(store, SEC, denied["id"], "deny", "no")["state"] == "denied"
    with pytest.raises(InvalidState):
        svc.apply_change(store, ALICE, denied["id"])
    later = datetime.now(UTC) + timedelta(days=8)
    old = svc.create_change(store, ALICE, "certification.revoke", {"node": "gpu-01", "key": "x"})
    assert svc.vote(store, BOB, old["id"], "approve", now=later)["state"] == "expired"
    with pytest.raises(InvalidState):
        svc.apply_change(store, ALICE, old["id"])
    gone = svc.create_change(store, ALICE, "quota.set", {"tenant": "t", "gpus": 1})
    with pytest.raises(ProofplaneError):
        svc.cancel_change(store, BOB.__class__("eve", frozenset({Role.OPERATOR})), gone["id"])
    assert svc.cancel_change(store, ALICE, gone["id"])["state"] == "cancelled"
    assert get_node(store, SYSTEM, "gpu-01").certifications == {}


def test_a_failed_apply_leaves_it_approved_with_the_error_and_changes_nothing(store: Store) -> None:
    change = svc.create_change(store, ALICE, "certification.revoke",
                               {"node": "gpu-01", "key": "hipaa"})  # fmt: skip
    svc.vote(store, BOB, change["id"], "approve")
    with pytest.raises(NotFound):  # the node holds no such certification now
        svc.apply_change(store, ALICE, change["id"])
    after = svc.get_change(store, SYSTEM, change["id"])
    assert after["state"] == "approved" and "hipaa" in after["error"]


@pytest.mark.parametrize(
    ("change_type", "payload", "code"),
    [
        ("nope", {}, "unknown_change_type"),
        ("certification.grant", {"node": "gpu-01"}, "invalid_payload"),
        ("certification.grant", {**GRANT, "extra": 1}, "invalid_payload"),
        ("certification.grant", [], "invalid_payload"),
        ("quota.set", {"tenant": "t", "gpus": "1"}, "invalid_payload"),
    ],
)
def test_bad_requests_are_refused_and_write_nothing(
    store: Store, change_type: str, payload: object, code: str
) -> None:
    before = _actions(store)
    with pytest.raises(ProofplaneError) as bad:
        svc.create_change(store, ALICE, change_type, payload)
    assert bad.value.code == code and _actions(store) == before


def test_who_may_ask(store: Store) -> None:
    with pytest.raises(ProofplaneError) as refused:  # operators cannot certify
        svc.create_change(store, OPS, "certification.grant", GRANT)
    assert refused.value.code in ("forbidden", "permission_denied")
    svc.create_change(store, OPS, "node.decommission", {"node": "gpu-01", "reason": "eol"})
    with pytest.raises(ProofplaneError):  # an emergency is an admin's
        svc.create_change(store, OPS, "node.readmit", {"node": "gpu-01", "reason": "x"},
                          emergency=True, reason="now")  # fmt: skip


def test_an_emergency_applies_at_once_and_is_reviewed(store: Store) -> None:
    change = svc.create_change(store, ALICE, "certification.grant", GRANT, emergency=True,
                               reason="regulator deadline")  # fmt: skip
    assert change["state"] == "applied" and change["review_state"] == "pending"
    assert get_node(store, SYSTEM, "gpu-01").certifications == {"hipaa": "true"}
    now = datetime.now(UTC)
    assert svc.overdue_reviews(store, now) == []
    late = now + timedelta(hours=25)
    assert svc.overdue_reviews(store, late) == [change["id"]]
    assert svc.overdue_reviews(store, late + timedelta(minutes=10)) == []  # hourly
    assert svc.overdue_reviews(store, late + timedelta(hours=1, minutes=1)) == [change["id"]]
    with pytest.raises(ProofplaneError) as own:
        svc.vote(store, ALICE, change["id"], "review")
    assert own.value.code == "separation_of_duties"
    svc.vote(store, BOB, change["id"], "review")
    assert svc.vote(store, SEC, change["id"], "review")["review_state"] == "done"
    assert svc.overdue_reviews(store, late + timedelta(hours=5)) == []
    assert _actions(store).count("alert.change_review_overdue") == 2
