"""Migration 0012 (secrets at rest) on SQLite and PostgreSQL: a database at 0011 with secrets in
the clear (a TOTP seed, sink tokens, an OIDC login in flight) is upgraded; the values become
ciphertext of the key ``secrets`` (made by the migration, with its ``key.create`` event in the
Merkle log), the server still works with them, running the migration again changes nothing,
and a downgrade gives the plaintext back."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import insert, select

from ci import unavailable
from proofplane.access import credentials as cred
from proofplane.access import oidc as oidc_client
from proofplane.access import totp
from proofplane.audit.canonical import event_leaf_hash
from proofplane.config import OidcSettings
from proofplane.keys import envelope
from proofplane.service import access
from proofplane.service import keys as keys_svc
from proofplane.service import sinks as sinks_svc
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.store import audit_log, migrate
from proofplane.store.tables import EventRow, OidcLoginRow, SinkRow, UserRow

PG_ADMIN = os.environ.get("PROOFPLANE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
PASSWORD = "correct horse battery staple"
SEED = "JBSWY3DPEHPK3PXPJBSWY3DPEHPK3PXP"
HEC_TOKEN = "aaaaaaaa-bbbb-cccc-dddd-migrated-token"
BEARER = "migrated-bearer-token-0123456789"
KEY_FILE = "/etc/proofplane/sink-client.key"
STATE, NONCE, VERIFIER = "s" * 43, "n" * 43, "v" * 64


@pytest.fixture(params=["sqlite", "postgresql"])
def blank(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty database of each kind, not migrated."""
    if request.param == "sqlite":
        store = Store(f"sqlite:///{tmp_path / 'old.db'}")
        yield store
        store.dispose()
        return
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL unreachable at {PG_ADMIN}: {exc}")
    name = f"pp_mig_{uuid.uuid4().hex[:10]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    store = Store(f"{base}/{name}")
    yield store
    store.dispose()
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def alembic(store: Store) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrate.MIGRATIONS_DIR))
    cfg.attributes["engine"] = store.engine
    return cfg


def old_rows(store: Store, now: datetime) -> None:
    """What a server before 0012 stored: secrets in the clear."""
    with store.engine.begin() as conn:
        conn.execute(
            insert(UserRow).values(
                id=7, username="ops", source="local", external_subject=None,
                password_hash=cred.hash_password(PASSWORD), roles=["operator"], tenants=[],
                totp_secret=SEED, totp_enabled=True, totp_last_step=None,
                recovery_codes=[], failed_logins=0, locked_until=None, disabled=False,
                created_at=now, updated_at=now,
            )
        )  # fmt: skip
        conn.execute(
            insert(SinkRow),
            [
                dict(id=3, name="splunk", kind="splunk-hec", enabled=True,
                     config={"url": "http://127.0.0.1:9", "token": HEC_TOKEN, "batch_size": 100},
                     cursor=0, consecutive_failures=0, created_at=now, updated_at=now),
                dict(id=4, name="lake", kind="ocsf-http", enabled=True,
                     config={"url": "https://lake.example/ingest", "bearer_token": BEARER,
                             "key_file": KEY_FILE},
                     cursor=0, consecutive_failures=0, created_at=now, updated_at=now),
                dict(id=5, name="file", kind="ocsf-file", enabled=True, config={"path": "o.jsonl"},
                     cursor=0, consecutive_failures=0, created_at=now, updated_at=now),
            ],
        )  # fmt: skip
        conn.execute(
            insert(OidcLoginRow).values(
                state=STATE, nonce=NONCE, code_verifier=VERIFIER, return_to="/x",
                expires_at=now + timedelta(minutes=10),
            )
        )  # fmt: skip


def stored(store: Store) -> dict[str, Any]:
    with store.read() as s:
        user = s.get(UserRow, 7)
        login = s.get(OidcLoginRow, STATE)
        assert user is not None and login is not None
        configs = {r.name: dict(r.config) for r in s.scalars(select(SinkRow))}
        return {
            "totp": user.totp_secret,
            "nonce": login.nonce,
            "verifier": login.code_verifier,
            "token": configs["splunk"]["token"],
            "bearer": configs["lake"]["bearer_token"],
            "key_file": configs["lake"]["key_file"],
            "file": configs["file"],
        }


def merkle_matches_events(store: Store) -> list[str]:
    """Every event's leaf hash is the stored leaf; the actions, in order."""
    with store.read() as s:
        rows = list(s.scalars(select(EventRow).order_by(EventRow.seq)))
        leaves = audit_log.leaf_hashes(s, 0, len(rows))
        assert audit_log.tree_size(s) == len(rows)
    assert [event_leaf_hash(event_from_row(r)) for r in rows] == leaves
    return [r.action for r in rows]


def test_0012_seals_what_0011_stored_in_the_clear(
    blank: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = blank
    migrate.upgrade(store.engine, "0011")
    now = datetime.now(UTC)
    old_rows(store, now)
    before = stored(store)
    assert before["totp"] == SEED and before["token"] == HEC_TOKEN

    migrate.upgrade(store.engine)
    assert migrate.is_current(store.engine)
    after = stored(store)
    aads = {"totp": "users/7/totp_secret", "nonce": f"oidc_logins/{STATE}/nonce",
            "verifier": f"oidc_logins/{STATE}/code_verifier", "token": "siem_sinks/3/token",
            "bearer": "siem_sinks/4/bearer_token", "key_file": "siem_sinks/4/key_file"}  # fmt: skip
    kms = keys_svc.kms_for(store)
    with store.read() as s:
        for field, aad in aads.items():
            assert envelope.is_ciphertext(after[field]), field
            assert envelope.parse(after[field]).key == "secrets"
            assert kms.decrypt(s, after[field], aad.encode()).decode() == before[field]
    assert after["file"] == before["file"]  # no secret in it: untouched
    assert merkle_matches_events(store) == ["key.create"]

    # the server works with them: a TOTP login, a delivery with the token, the OIDC verifier
    issued = access.login(
        store, "ops", PASSWORD, totp.code_at_step(SEED, totp.step_at(time.time())),
        session_ttl=timedelta(hours=1),
    )  # fmt: skip
    assert issued.token
    with store.read() as s:
        row = s.get(SinkRow, 3)
        assert row is not None
        opened = sinks_svc.open_config(store, s, row.id, dict(row.config))
    assert opened["token"] == HEC_TOKEN
    seen: dict[str, str] = {}

    def complete(config: Any, *, code: str, code_verifier: str, nonce: str) -> Any:
        seen.update(verifier=code_verifier, nonce=nonce)
        raise oidc_client.OidcFailed("stop here", reason="test")

    monkeypatch.setattr(oidc_client, "complete_login", complete)
    settings = OidcSettings(issuer="https://idp.invalid", client_id="c", client_secret="s",
                            redirect_uri="http://127.0.0.1:9/cb")  # fmt: skip
    with pytest.raises(oidc_client.OidcFailed):
        access.complete_oidc_login(
            store, settings, code="c", state=STATE, session_ttl=timedelta(hours=1)
        )
    assert seen == {"verifier": VERIFIER, "nonce": NONCE}


def test_0012_runs_again_without_change_and_downgrades_to_the_plaintext(blank: Store) -> None:
    store = blank
    migrate.upgrade(store.engine, "0011")
    old_rows(store, datetime.now(UTC))
    migrate.upgrade(store.engine, "0012")
    sealed = stored(store)
    # again over values that already are ciphertext: nothing changes, no second key
    command.stamp(alembic(store), "0011")
    migrate.upgrade(store.engine, "0012")
    assert stored(store) == sealed
    assert merkle_matches_events(store) == ["key.create"]

    command.downgrade(alembic(store), "0011")
    assert migrate.current_revision(store.engine) == "0011"
    plain = stored(store)
    assert (plain["totp"], plain["token"], plain["bearer"], plain["key_file"]) == (
        SEED, HEC_TOKEN, BEARER, KEY_FILE,
    )  # fmt: skip
    assert (plain["nonce"], plain["verifier"]) == (NONCE, VERIFIER)
    # and up again: sealed anew under the key that is there
    migrate.upgrade(store.engine)
    again = stored(store)
    assert all(envelope.is_ciphertext(again[k]) for k in ("totp", "token", "nonce"))
    assert merkle_matches_events(store) == ["key.create"]


def test_0012_on_a_database_without_secrets_needs_no_kms(
    blank: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROOFPLANE_KMS", "no-such-kms")
    migrate.upgrade(blank.engine)
    assert migrate.is_current(blank.engine)
    assert merkle_matches_events(blank) == []


def test_0012_fails_whole_when_the_kms_cannot_be_used(
    blank: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate.upgrade(blank.engine, "0011")
    old_rows(blank, datetime.now(UTC))
    monkeypatch.setenv("PROOFPLANE_KMS", "no-such-kms")
    with pytest.raises(Exception, match="no-such-kms"):
        migrate.upgrade(blank.engine)
    assert migrate.current_revision(blank.engine) == "0011"
    assert stored(blank)["totp"] == SEED  # nothing of it kept
    assert merkle_matches_events(blank) == []
