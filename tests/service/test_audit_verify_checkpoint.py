"""``audit verify`` on a log with no signed checkpoint yet is a distinct outcome: ``ok`` (the
events reproduce the stored tree) but ``"checkpoint": null`` and
``"verified_against_checkpoint": false``, a line that says so, and exit 3 under
``--require-checkpoint``. With a checkpoint, the report names it. Service, CLI on the database
and CLI against a server."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dbtest import ADMIN_TOKEN
from live_server import serve
from proofplane.access import SYSTEM
from proofplane.cli.main import app
from proofplane.config import Settings
from proofplane.service import audit as audit_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
runner = CliRunner()


@pytest.fixture
def keys(tmp_path: Path) -> audit_svc.AuditKeys:
    return audit_svc.AuditKeys(origin="proofplane/test", key_file=tmp_path / "signing.key")


def _fill(store: Store, n: int = 4) -> None:
    for i in range(n):
        with store.write(SYSTEM, now=T0) as tx:
            tx.record("workload.place", "workload", f"w{i}", details={"tenant": "acme"})


def _verify(db_url: str, keys: audit_svc.AuditKeys, store: Store, *extra: str):
    """The CLI on the database, with the verifiers the database knows (the KMS key's)."""
    args = ["audit", "verify", "--db", db_url, "--origin", "proofplane/test", *extra]
    return runner.invoke(app, args)


def test_no_checkpoint_is_ok_but_not_verified_against_one(db_url: str, store: Store, keys):
    _fill(store)
    report = audit_svc.verify_log(store, audit_svc.known_verifiers(store, keys), "proofplane/test")
    assert report.ok and not report.verified_against_checkpoint
    assert report.checkpoint_size is None and report.problems == [audit_svc.NO_CHECKPOINT]
    d = report.to_dict()
    assert d["checkpoint"] is None and d["verified_against_checkpoint"] is False
    assert {"ok", "events", "tree_size", "checkpoint_size", "first_bad_index", "problems"} <= set(d)

    res = _verify(db_url, keys, store, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["ok"] is True and out["checkpoint"] is None
    assert out["verified_against_checkpoint"] is False

    res = _verify(db_url, keys, store)
    assert res.exit_code == 0, res.output
    assert "NO signed checkpoint yet" in res.output

    res = _verify(db_url, keys, store, "--require-checkpoint")
    assert res.exit_code == 3, res.output
    assert "no signed checkpoint to verify against" in res.output
    assert "audit checkpoint --sign" in res.output


def test_with_a_checkpoint_the_report_names_it(db_url: str, store: Store, keys):
    _fill(store)
    audit_svc.sign_checkpoint(store, SYSTEM, keys, T0)
    report = audit_svc.verify_log(store, audit_svc.known_verifiers(store, keys), "proofplane/test")
    assert report.ok and report.verified_against_checkpoint, report.problems
    d = report.to_dict()
    assert d["checkpoint"]["size"] == report.checkpoint_size == report.events
    assert len(bytes.fromhex(d["checkpoint"]["root_hash"])) == 32
    res = _verify(db_url, keys, store, "--require-checkpoint", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["verified_against_checkpoint"] is True


def test_a_tampered_log_without_checkpoint_still_fails(db_url: str, store: Store, keys):
    """The distinct outcome is for an intact log only: a broken one is still a failure (1)."""
    _fill(store)
    from sqlalchemy import text

    with store.engine.begin() as conn:
        if store.engine.dialect.name == "sqlite":
            conn.execute(text("DROP TRIGGER IF EXISTS events_no_update"))
        else:
            conn.execute(text("DROP TRIGGER IF EXISTS events_append_only ON events"))
        conn.execute(text("UPDATE events SET actor = 'mallory' WHERE seq = 2"))
    report = audit_svc.verify_log(store, audit_svc.known_verifiers(store, keys), "proofplane/test")
    assert not report.ok and not report.verified_against_checkpoint
    res = _verify(db_url, keys, store, "--require-checkpoint")
    assert res.exit_code == 1 and "FAILED" in res.output


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_against_a_server_without_checkpoint(db_url: str, store: Store) -> None:
    bootstrap_admin(store, ADMIN_TOKEN)
    _fill(store)
    with serve(store, Settings(cookie_secure=False)) as url:
        base = ["--server", url, "--token", ADMIN_TOKEN, "audit", "verify"]
        res = runner.invoke(app, [*base, "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["checkpoint"] is None and out["verified_against_checkpoint"] is False
        res = runner.invoke(app, [*base, "--require-checkpoint"])
        assert res.exit_code == 3, res.output
        runner.invoke(
            app, ["--server", url, "--token", ADMIN_TOKEN, "audit", "checkpoint", "--sign"]
        )
        res = runner.invoke(app, [*base, "--require-checkpoint", "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["verified_against_checkpoint"] is True and out["checkpoint"]["size"] > 0
