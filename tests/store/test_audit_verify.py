"""Tampering with the events table directly in the database (triggers dropped first, as an
attacker with database access would) is caught by ``proofplane audit verify --db``; bundles
verify offline and malformed ones are refused. SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from typer.testing import CliRunner

from proofplane.access import SYSTEM
from proofplane.audit import bundle as bundle_mod
from proofplane.audit import note
from proofplane.cli.main import app
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
runner = CliRunner()


@pytest.fixture
def keys(tmp_path: Path) -> audit_svc.AuditKeys:
    return audit_svc.AuditKeys(origin="proofplane/test", key_file=tmp_path / "signing.key")


def _fill(store: Store, keys: audit_svc.AuditKeys, n: int = 12) -> None:
    for i in range(n):
        with store.write(SYSTEM, now=T0 + timedelta(minutes=i)) as tx:
            tx.record(
                "workload.place",
                "workload",
                f"w{i}",
                details={"tenant": "acme" if i % 2 else "globex", "gpus": [i], "tags": {"h": 1}},
            )
        if i == 5:
            audit_svc.sign_checkpoint(store, SYSTEM, keys, T0)
    audit_svc.sign_checkpoint(store, SYSTEM, keys, T0 + timedelta(hours=1))


def _attack(store: Store, *statements: str) -> None:
    with store.engine.begin() as conn:
        if store.engine.dialect.name == "sqlite":
            conn.execute(text("DROP TRIGGER IF EXISTS events_no_update"))
            conn.execute(text("DROP TRIGGER IF EXISTS events_no_delete"))
        else:
            conn.execute(text("DROP TRIGGER IF EXISTS events_append_only ON events"))
        for s in statements:
            conn.execute(text(s))


def _cli_verify(db_url: str, store: Store, keys: audit_svc.AuditKeys):
    vkey = keys.verifier(store).text()
    return runner.invoke(app, ["audit", "verify", "--db", db_url, "--key", vkey, "--json"])


def test_untampered_log_verifies(db_url: str, store: Store, keys):
    _fill(store, keys)
    report = audit_svc.verify_log(store, keys.verifier(store), "proofplane/test")
    assert report.ok, report.problems
    assert (report.events, report.checkpoint_size) == (13, 13)  # with the key's key.create
    result = _cli_verify(db_url, store, keys)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "attack,first_bad",
    [
        (["UPDATE events SET actor = 'mallory' WHERE seq = 4"], 3),
        (["UPDATE events SET outcome = 'failure' WHERE seq = 12"], 11),
        (["DELETE FROM events WHERE seq = 7"], 6),
        (["DELETE FROM events WHERE seq = 12"], 11),
        (  # reorder: swap rows 3 and 9
            [
                "UPDATE events SET seq = -3 WHERE seq = 3",
                "UPDATE events SET seq = 3 WHERE seq = 9",
                "UPDATE events SET seq = 9 WHERE seq = -3",
            ],
            2,
        ),
    ],
    ids=["alter", "alter-last", "delete", "delete-last", "reorder"],
)
def test_tampering_is_caught(db_url: str, store: Store, keys, attack, first_bad):
    _fill(store, keys)
    _attack(store, *attack)
    report = audit_svc.verify_log(store, keys.verifier(store), "proofplane/test")
    assert not report.ok
    assert report.first_bad_index == first_bad, report.problems
    result = _cli_verify(db_url, store, keys)
    assert result.exit_code == 1
    assert f"first bad index: {first_bad}" in result.output


def test_text_that_is_not_utf8_is_named_not_raised(db_url: str, store: Store, keys):
    """A row altered to bytes SQLite will not decode as UTF-8 (PostgreSQL refuses such text
    outright, so only SQLite can hold it): a bad index, never a traceback."""
    _fill(store, keys)
    if not db_url.startswith("sqlite"):  # the database refuses the bytes: nothing to find
        with pytest.raises(DBAPIError):
            _attack(store, "UPDATE events SET actor = convert_from('\\xff6d616c', 'UTF8')")
        assert audit_svc.verify_log(store, keys.verifier(store), "proofplane/test").ok
        return
    _attack(store, "UPDATE events SET actor = CAST(X'ff6d616c' AS TEXT) WHERE seq = 5")
    for workers in (1, 2):
        report = audit_svc.verify_log(
            store, keys.verifier(store), "proofplane/test", workers=workers
        )
        assert not report.ok and report.first_bad_index == 4, report.problems
        assert "not UTF-8" in report.problems[0]
    result = _cli_verify(db_url, store, keys)
    assert result.exit_code == 1 and "first bad index: 4" in result.output
    assert "Traceback" not in result.output


def test_rewriting_the_stored_hashes_too_is_caught(store: Store, keys):
    """The attacker alters an event and its stored leaf hash: the signed checkpoint still
    catches it, localized to the stretch after the last checkpoint that still verifies."""
    _fill(store, keys)
    _attack(store, "UPDATE events SET actor = 'mallory' WHERE seq = 9")
    from proofplane.audit.canonical import event_leaf_hash
    from proofplane.service.events import event_from_row
    from proofplane.store import audit_log
    from proofplane.store.tables import EventRow

    with store.read() as s:
        leaf = event_leaf_hash(event_from_row(s.get(EventRow, 9)))
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE audit_hashes SET hash = :h WHERE id = :i"),
            {"h": leaf, "i": audit_log.node_id(0, 8)},
        )
    report = audit_svc.verify_log(store, keys.verifier(store))
    assert not report.ok
    assert report.first_bad_index == 7  # the checkpoint at size 7 (6 + key.create) verifies


def test_wrong_key_is_refused(store: Store, keys, tmp_path: Path):
    _fill(store, keys, 3)
    other = note.generate_signer("proofplane/test", os.urandom(32))
    report = audit_svc.verify_log(store, other.verifier)
    assert not report.ok and "does not verify" in report.problems[0]


def test_bundle_round_trip_and_tamper(store: Store, keys, tmp_path: Path):
    _fill(store, keys)
    data = audit_svc.export_bundle(
        store, SYSTEM, keys, tenant="acme", since=T0 + timedelta(minutes=2), now=T0
    )
    # (index 6: the audit key's key.create, in the first checkpoint's transaction)
    assert [e["index"] for e in data["entries"]] == [3, 5, 8, 10, 12]
    path = tmp_path / "bundle.json"
    path.write_text(json.dumps(data))
    vkey = keys.verifier(store).text()
    ok = runner.invoke(app, ["audit", "verify-bundle", str(path), "--key", vkey])
    assert ok.exit_code == 0, ok.output
    assert "ok: 5 entries" in ok.output

    # an altered entry, a foreign key, and malformed files
    bad = json.loads(json.dumps(data))
    entry = json.loads(__import__("base64").b64decode(bad["entries"][0]["entry"]))
    entry["actor"] = "mallory"
    forged = json.dumps(entry, separators=(",", ":"), sort_keys=True).encode()
    bad["entries"][0]["entry"] = __import__("base64").b64encode(forged).decode()
    report = bundle_mod.verify(json.dumps(bad))
    assert not report.ok and "entry 3" in report.failures[0]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    res = runner.invoke(app, ["audit", "verify-bundle", str(tmp_path / "bad.json")])
    assert res.exit_code == 1 and "does NOT verify" in res.output

    other = note.generate_signer("proofplane/test", os.urandom(32))
    res = runner.invoke(app, ["audit", "verify-bundle", str(path), "--key", other.verifier.text()])
    assert res.exit_code == 1

    for content in ["not json", "{}", json.dumps({**data, "entries": [{"index": -1}]})]:
        (tmp_path / "m.json").write_text(content)
        res = runner.invoke(app, ["audit", "verify-bundle", str(tmp_path / "m.json")])
        assert res.exit_code == 2 and "malformed bundle" in res.output
    res = runner.invoke(app, ["audit", "verify-bundle", str(tmp_path / "missing.json")])
    assert res.exit_code == 2
