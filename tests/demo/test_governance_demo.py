"""The demo's governance seed (issue 12): a pending certification grant by the admin, a second
admin and a security officer with working tokens; the admin cannot approve their own request,
the other two can, and once applied the node holds the certification."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from dbtest import demo_text
from proofplane.access import SYSTEM, Actor, Role
from proofplane.demo.governance import PENDING_GRANT, seed_governance
from proofplane.errors import ProofplaneError
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service import access
from proofplane.service import changes as svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.nodes import get_node
from proofplane.store import migrate

ADMIN = Actor("admin", frozenset({Role.ADMIN}))


def test_the_seeded_change_is_approved_by_the_two_others_and_applied(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'demo.db'}")
    migrate.upgrade(store.engine)
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    seed = seed_governance(store)
    change = svc.get_change(store, SYSTEM, seed.change_id)
    assert (change["state"], change["type"], change["requested_by"]) == (
        "pending", "certification.grant", "admin")  # fmt: skip
    assert change["payload"] == PENDING_GRANT
    with pytest.raises(ProofplaneError) as own:
        svc.vote(store, ADMIN, seed.change_id, "approve")
    assert own.value.code == "separation_of_duties"
    now = datetime.now(UTC)
    admin2 = access.authenticate(store, seed.second_admin_token, now)
    security = access.authenticate(store, seed.security_officer_token, now)
    assert (admin2.name, security.name) == ("admin2", "security")
    assert Role.SECURITY_OFFICER in security.roles
    assert svc.vote(store, admin2, seed.change_id, "approve")["state"] == "pending"
    assert svc.vote(store, security, seed.change_id, "approve")["state"] == "approved"
    with pytest.raises(ProofplaneError):  # a security officer approves, never applies
        svc.apply_change(store, security, seed.change_id)
    applied = svc.apply_change(store, ADMIN, seed.change_id)
    assert applied["state"] == "applied" and applied["applied_by"] == "admin"
    node = get_node(store, SYSTEM, PENDING_GRANT["node"])
    assert node.certifications[PENDING_GRANT["key"]] == PENDING_GRANT["value"]
    store.dispose()
