"""The change register (issue 12, §7): per change its approvers with times, the separation-of-
duties checks as booleans, who applied it and when, the emergency flag and review state, and
the audit-log index of each of its events, which ``proofplane audit prove --index`` proves
against a signed checkpoint; CSV that the csv module reads, one row per change."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from live_server import serve
from proofplane.access import SYSTEM, Actor, Role
from proofplane.api.app import create_app
from proofplane.cli.main import app as cli_app
from proofplane.errors import ProofplaneError
from proofplane.model import Gpu, Node, NodeState
from proofplane.service import change_register as register
from proofplane.service import changes as svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.service.nodes import register_node, set_node_state
from proofplane.store import migrate
from proofplane.store.tables import EventRow

ALICE = Actor("alice", frozenset({Role.ADMIN}))
BOB = Actor("bob", frozenset({Role.ADMIN}))
SEC = Actor("sec", frozenset({Role.SECURITY_OFFICER}))
AUD = Actor("aud", frozenset({Role.AUDITOR}))
DEV = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"t1"}))
GRANT = {"node": "gpu-01", "key": "hipaa", "value": "true"}
TOKEN = "ppt_change-register-admin-token-0123456789"


def _store(path: Path) -> Store:
    s = Store(f"sqlite:///{path}")
    migrate.upgrade(s.engine)
    register_node(
        s, SYSTEM, Node("gpu-01", "r1", "z1", gpus=(Gpu(0, "GPU-1", "H100-80GB", 81920),))
    )
    set_node_state(s, SYSTEM, "gpu-01", NodeState.ADMITTED, "test")
    return s


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = _store(tmp_path / "register.db")
    yield s
    s.dispose()


def history(store: Store) -> dict[str, int]:
    """A register's worth of changes: applied by two, edited then applied, denied, an
    emergency with its review, one still pending."""
    ids = {}
    c = svc.create_change(store, ALICE, "certification.grant", GRANT, reason="audit")
    svc.vote(store, BOB, c["id"], "approve", "ok")
    svc.vote(store, SEC, c["id"], "approve")
    svc.apply_change(store, ALICE, c["id"])
    ids["applied"] = c["id"]
    c = svc.create_change(store, ALICE, "certification.grant", {**GRANT, "key": "tier"})
    svc.vote(store, SEC, c["id"], "approve")
    svc.edit_change(store, BOB, c["id"], {**GRANT, "key": "tier", "value": "gold"})
    carol = Actor("carol", frozenset({Role.ADMIN}))
    svc.vote(store, SEC, c["id"], "approve")
    svc.vote(store, carol, c["id"], "approve")
    svc.apply_change(store, ALICE, c["id"])
    ids["edited"] = c["id"]
    c = svc.create_change(store, ALICE, "certification.revoke", {"node": "gpu-01", "key": "x"})
    svc.vote(store, SEC, c["id"], "deny", "no")
    ids["denied"] = c["id"]
    c = svc.create_change(store, ALICE, "certification.grant", {**GRANT, "key": "pci"},
                          emergency=True, reason="regulator")  # fmt: skip
    svc.vote(store, BOB, c["id"], "review")
    ids["emergency"] = c["id"]
    ids["pending"] = svc.create_change(store, BOB, "quota.set", {"tenant": "t", "gpus": 1})["id"]
    return ids


def change_events(store: Store, change_id: int) -> list[tuple[int, str]]:
    with store.read() as session:
        rows = session.query(EventRow).filter(
            EventRow.target_type == "change", EventRow.target_id == str(change_id)
        )
        return [(e.seq, e.action) for e in rows.order_by(EventRow.seq)]


def test_the_register_says_who_approved_and_that_duties_were_separated(store: Store) -> None:
    ids = history(store)
    data = register.export_register(store, AUD)
    assert data["format"] == register.REGISTER_FORMAT and data["count"] == 5
    assert "proofplane audit prove --index" in data["verify"]
    items = {item["id"]: item for item in data["items"]}
    assert list(items) == sorted(items)  # oldest first

    applied = items[ids["applied"]]
    assert applied["requested_by"] == "alice" and applied["applied_by"] == "alice"
    assert [a["by"] for a in applied["approvals"]] == ["bob", "sec"]
    assert all(a["current"] and a["at"] for a in applied["approvals"])
    assert applied["sod"] == {"requester_not_approver": True, "editor_not_approver": True,
                              "approvals_on_applied_payload": True}  # fmt: skip
    assert applied["sod_passed"] is True and applied["required_approvals"] == 2
    assert applied["emergency"] is False and applied["review_state"] is None

    edited = items[ids["edited"]]
    assert [(a["by"], a["current"]) for a in edited["approvals"]] == [
        ("sec", False), ("sec", True), ("carol", True)]  # fmt: skip
    assert edited["last_edited_by"] == "bob" and edited["sod_passed"] is True
    assert edited["sod"]["approvals_on_applied_payload"] is True

    denied = items[ids["denied"]]
    assert denied["state"] == "denied" and denied["denials"][0]["by"] == "sec"
    assert denied["sod"]["approvals_on_applied_payload"] is None  # nothing was applied

    emergency = items[ids["emergency"]]
    assert emergency["emergency"] is True and emergency["review_state"] == "pending"
    assert [r["by"] for r in emergency["reviews"]] == ["bob"]
    assert emergency["sod"]["approvals_on_applied_payload"] is None
    assert emergency["applied_by"] == "alice" and emergency["applied_at"]

    for cid, item in items.items():  # every event of the change, with its audit-log index
        want = change_events(store, cid)
        assert [(e["seq"], e["action"]) for e in item["events"]] == want
        assert all(e["index"] == e["seq"] - 1 for e in item["events"])
    assert [e["action"] for e in applied["events"]] == [
        "change.create", "change.approve", "change.approve", "change.apply"]  # fmt: skip


def test_a_broken_separation_shows_as_false(store: Store) -> None:
    """Were a requester's approval ever stored (a bug, a hand-edited database), the register
    shows the check failing rather than hiding it."""
    from proofplane.store.tables import ChangeVoteRow

    c = svc.create_change(store, ALICE, "certification.revoke", {"node": "gpu-01", "key": "x"})
    with store.write(SYSTEM) as tx:
        tx.session.add(ChangeVoteRow(change_id=c["id"], decision="approve", by="alice",
                                     roles=["admin"], at=tx.now, comment="",
                                     payload_sha256=c["payload_sha256"]))  # fmt: skip
    item = register.export_register(store, AUD)["items"][0]
    assert item["sod"]["requester_not_approver"] is False
    assert item["sod"]["editor_not_approver"] is False  # alice also last edited it
    assert item["sod_passed"] is False


def test_the_window_selects_changes_by_their_events(store: Store) -> None:
    ids = history(store)
    now = datetime.now(UTC)
    assert register.export_register(store, AUD, start=now + timedelta(hours=1))["count"] == 0
    assert register.export_register(store, AUD, end=now - timedelta(hours=1))["count"] == 0
    naive = (now - timedelta(hours=1)).replace(tzinfo=None)  # no zone: UTC
    window = register.export_register(store, AUD, start=naive, end=now + timedelta(hours=1))
    assert window["count"] == len(ids)
    later = now + timedelta(days=8)  # the pending one expires: an event in a later window
    svc.vote(store, SEC, ids["pending"], "approve", now=later)
    late = register.export_register(store, AUD, start=later - timedelta(minutes=1))
    assert [i["id"] for i in late["items"]] == [ids["pending"]]
    assert late["items"][0]["state"] == "expired"
    assert late["items"][0]["events"][0]["action"] == "change.create"  # its whole history
    with pytest.raises(ProofplaneError) as bad:
        register.export_register(store, AUD, start=now, end=now)
    assert bad.value.code == "invalid_window"
    with pytest.raises(ProofplaneError) as refused:
        register.export_register(store, DEV)
    assert refused.value.code == "forbidden"


def test_csv_is_one_row_per_change(store: Store) -> None:
    ids = history(store)
    data = register.export_register(store, AUD)
    rows = list(csv.DictReader(io.StringIO(register.register_csv(data))))
    assert [int(r["id"]) for r in rows] == sorted(ids.values())
    assert set(rows[0]) == set(register.CSV_COLUMNS)
    by_id = {int(r["id"]): r for r in rows}
    applied = by_id[ids["applied"]]
    approvers = applied["approvers"].split(";")
    assert [a.split("@", 1)[0] for a in approvers] == ["bob", "sec"]
    assert all(datetime.fromisoformat(a.split("@", 1)[1]) for a in approvers)
    assert (applied["sod_requester_not_approver"], applied["sod_editor_not_approver"],
            applied["sod_approvals_on_applied_payload"], applied["sod_passed"]) == (
        "true", "true", "true", "true")  # fmt: skip
    seqs = [s for s, _ in change_events(store, ids["applied"])]
    assert applied["event_seqs"] == ";".join(map(str, seqs))
    assert applied["audit_indexes"] == ";".join(str(s - 1) for s in seqs)
    assert applied["emergency"] == "false" and applied["applied_by"] == "alice"
    edited = by_id[ids["edited"]]
    assert edited["voided_approvals"].startswith("sec@")
    assert [a.split("@")[0] for a in edited["approvers"].split(";")] == ["sec", "carol"]
    assert by_id[ids["denied"]]["sod_approvals_on_applied_payload"] == ""
    assert by_id[ids["denied"]]["denials"].startswith("sec@")
    assert by_id[ids["emergency"]]["emergency"] == "true"
    assert by_id[ids["emergency"]]["review_state"] == "pending"
    assert by_id[ids["emergency"]]["reviewers"].startswith("bob@")


def test_the_export_route_and_proving_an_entry(tmp_path: Path) -> None:
    """Through the API as an auditor would: CSV and JSON, then each index of a change proved
    with ``proofplane audit prove --index`` against a signed checkpoint."""
    store = _store(tmp_path / "route.db")
    bootstrap_admin(store, TOKEN)
    ids = history(store)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(store), raise_server_exceptions=False, headers=auth) as client:
        response = client.get("/api/v1/changes/export", params={"format": "csv"})
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/csv")  # fmt: skip
        rows = list(csv.DictReader(io.StringIO(response.text)))
        assert len(rows) == len(ids)
        data = client.get("/api/v1/changes/export", params={"from": "2000-01-01T00:00:00Z"}).json()
        assert data["count"] == len(ids)
        for params, code in (({"from": "2030-01-01", "to": "2020-01-01"}, "invalid_window"),
                             ({"from": "yesterday"}, "validation_failed"),
                             ({"format": "xml"}, "validation_failed")):  # fmt: skip
            bad = client.get("/api/v1/changes/export", params=params)
            assert bad.status_code == 422 and bad.json()["error"]["code"] == code, bad.text
        assert client.post("/api/v1/audit/checkpoint").status_code == 200
    row = next(r for r in rows if int(r["id"]) == ids["applied"])
    with serve(store) as url:
        for index in row["audit_indexes"].split(";"):
            result = CliRunner().invoke(
                cli_app, ["--server", url, "--token", TOKEN, "audit", "prove", "--index", index]
            )
            assert result.exit_code == 0, result.output
            proof: dict[str, Any] = json.loads(result.stdout)
            assert proof["verified"] is True and proof["index"] == int(index)
