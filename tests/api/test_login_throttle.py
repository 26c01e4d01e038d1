"""Lockout without a login (issue 19, §4): the account lockout of PCI DSS 8.3.4 stays, but it
no longer tells which usernames exist, and one source address cannot lock out every account.

Each test performs the attack: an enumeration through the lockout's answers, and one address
hammering many usernames.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from proofplane.access import Actor, Role
from proofplane.access import credentials as cred
from proofplane.api.errors import status_for
from proofplane.errors import ProofplaneError
from proofplane.model import Tenant
from proofplane.service import access as svc
from proofplane.service import tenants as tenants_svc
from proofplane.service.access import lockout
from proofplane.service.context import Store
from proofplane.store.tables import AuthFailureRow, EventRow, UserRow

PASSWORD = "correct horse battery staple"
WRONG = "not the password at all"
ADMIN = Actor("system", frozenset({Role.ADMIN}))


def from_address(client: TestClient, address: str) -> TestClient:
    """An unauthenticated client calling from ``address``."""
    return TestClient(client.app, raise_server_exceptions=False, client=(address, 40000))


def attempt(client: TestClient, username: str, password: str = WRONG, address: str = "") -> Any:
    sender = (
        from_address(client, address)
        if address
        else TestClient(client.app, raise_server_exceptions=False)
    )
    return sender.post("/api/v1/auth/login", json={"username": username, "password": password})


def users(client: TestClient, *names: str, password: str | None = PASSWORD) -> None:
    """Developers on ``lab`` (``password`` None: single sign-on only, no hash to compute)."""
    client.post("/api/v1/tenants", json={"name": "lab"})
    for name in names:
        body = {"username": name, "password": password, "roles": ["developer"], "tenants": ["lab"]}
        assert client.post("/api/v1/users", json=body).status_code == 201


def shape(response: Any) -> tuple[Any, ...]:
    """What an attacker can compare: status, code, message, headers that matter, and the body
    with the lock's time reduced to whether it is there."""
    body = response.json()
    error = body.get("error", {})
    details = error.get("details")
    if isinstance(details, dict) and "locked_until" in details:
        details = {**details, "locked_until": "<time>"}
    return (
        response.status_code,
        sorted(body),
        error.get("code"),
        error.get("message"),
        details,
        response.headers.get("www-authenticate"),
        response.headers.get("retry-after"),
    )


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str | None]]:
    """Every password hash checked (None: the dummy hash): the cost of an attempt."""
    seen: list[str | None] = []
    real = cred.verify_password

    def counting(password_hash: str | None, password: str) -> bool:
        seen.append(password_hash)
        return real(password_hash, password)

    monkeypatch.setattr(cred, "verify_password", counting)
    yield seen


# --- an unknown username is answered exactly like a known one ----------------------------------


def test_unknown_username_answers_exactly_like_a_known_one_through_the_lockout(
    client: TestClient, store: Store, hashes: list[str | None]
) -> None:
    users(client, "victim")
    known, unknown = [], []
    for i in range(svc.LOCK_AFTER + 3):
        # from a fresh address each time (a distributed attacker: the address throttle is not
        # what this test is about), the same guess for an account and for a name nobody has
        hashes.clear()
        known.append(attempt(client, "victim", address=f"198.51.100.{i + 1}"))
        cost_known = len(hashes)
        hashes.clear()
        unknown.append(attempt(client, "victin", address=f"203.0.113.{i + 1}"))
        assert len(hashes) == cost_known == 1  # one password hash checked either way
    assert [shape(r) for r in known] == [shape(r) for r in unknown]
    codes = [r.json()["error"]["code"] for r in unknown]
    assert codes == ["invalid_credentials"] * svc.LOCK_AFTER + ["account_locked"] * 3
    assert {r.status_code for r in unknown[svc.LOCK_AFTER :]} == {423}
    # Both locks run 30 minutes from the tenth failure.
    for responses in (known, unknown):
        until = datetime.fromisoformat(responses[-1].json()["error"]["details"]["locked_until"])
        assert timedelta(minutes=29) < until - datetime.now(UTC) <= timedelta(minutes=30)
    # The right password on the real account is refused the same way while it is locked.
    assert shape(attempt(client, "victim", PASSWORD, "192.0.2.1")) == shape(unknown[-1])


def test_an_unknown_name_lock_runs_out_like_an_account_lock(store: Store) -> None:
    t0 = datetime.now(UTC)

    def fail(name: str, at: timedelta) -> str:
        with pytest.raises(ProofplaneError) as exc:
            svc.login(store, name, WRONG, None, session_ttl=timedelta(hours=1), now=t0 + at)
        return exc.value.code

    tenants_svc.create_tenant(store, ADMIN, Tenant("lab"))
    svc.create_user(store, ADMIN, "victim", PASSWORD, ["developer"], ["lab"])
    for name in ("victim", "nobody"):
        seen = [fail(name, timedelta(seconds=i)) for i in range(svc.LOCK_AFTER + 1)]
        assert seen[-1] == "account_locked", (name, seen)
        assert fail(name, timedelta(minutes=29)) == "account_locked"
        # Once the lock has run out, the count starts again for both.
        assert fail(name, timedelta(minutes=31)) == "invalid_credentials"
        assert fail(name, timedelta(minutes=31, seconds=1)) == "invalid_credentials"


def test_what_cannot_be_a_username_is_not_stored(store: Store) -> None:
    """A password typed into the username box is not kept, not even hashed."""
    with pytest.raises(ProofplaneError):
        svc.login(store, "Correct Horse Battery!", WRONG, None, session_ttl=timedelta(hours=1))
    with store.read() as s:
        keys = list(s.scalars(select(AuthFailureRow.key)))
    assert keys == []


# --- one address cannot lock out everyone ------------------------------------------------------


def test_one_address_hammering_many_usernames_is_throttled_before_it_locks_them(
    client: TestClient, store: Store
) -> None:
    names = [f"staff{i}" for i in range(12)]
    users(client, *names[1:], password=None)  # (a password login fails for these all the same)
    users(client, names[0])
    statuses: dict[int, int] = {}
    # Round after round, one wrong password for every account: without the throttle, the
    # tenth round locks them all.
    for _ in range(svc.LOCK_AFTER):
        for name in names:
            r = attempt(client, name, address="203.0.113.66")
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 429 == status_for(svc.TooManyAttempts):
                assert r.json()["error"]["code"] == "too_many_attempts"
                retry = int(r.headers["retry-after"])
                assert retry >= 1 and r.json()["error"]["details"]["retry_after"] == retry
    # After THROTTLE_FREE failures the address waits 1 s, 2 s, 4 s … between guesses: only a
    # few more were even checked (the loop takes seconds), and no account was locked.
    checked = statuses.get(401, 0)
    assert set(statuses) == {401, 429}
    assert svc.THROTTLE_FREE <= checked <= svc.THROTTLE_FREE + 5, statuses
    with store.read() as s:
        locked = s.scalar(
            select(func.count()).select_from(UserRow).where(UserRow.locked_until.is_not(None))
        )
        assert locked == 0
        alerts = list(
            s.scalars(select(EventRow).where(EventRow.action == "alert.auth_source_throttled"))
        )
        # One alert, and the refusals themselves wrote nothing (no event per refused attempt).
        assert [a.target_id for a in alerts] == ["203.0.113.66"]
        failures = s.scalar(
            select(func.count()).select_from(EventRow).where(EventRow.action == "auth.login")
        )
        assert failures == checked
    # The users themselves, from their own addresses, still log in.
    assert attempt(client, names[0], PASSWORD, "192.0.2.10").status_code == 200


def _login(
    store: Store, password: str, at: datetime, source: str = "203.0.113.9", username: str = "dev"
) -> str:
    try:
        svc.login(
            store, username, password, None, session_ttl=timedelta(hours=1), now=at, source=source
        )
    except svc.TooManyAttempts as exc:
        return f"wait {exc.details['retry_after']}"
    except ProofplaneError as exc:
        return exc.code
    return "ok"


def test_the_delay_doubles_and_is_forgotten(store: Store) -> None:
    tenants_svc.create_tenant(store, ADMIN, Tenant("lab"))
    svc.create_user(store, ADMIN, "dev", PASSWORD, ["developer"], ["lab"])
    guesses = (f"user{i}" for i in range(100))  # a spray: one guess per name, none locked

    def guess(at: datetime) -> str:
        return _login(store, WRONG, at, username=next(guesses))

    t = datetime.now(UTC)
    for _ in range(svc.THROTTLE_FREE):
        assert guess(t) == "invalid_credentials"
    # 1 s after the last free failure, then 2 s, 4 s, 8 s …; the right password waits too
    # (a throttled address learns nothing, not even that a password was right).
    for delay in (1, 2, 4, 8):
        assert _login(store, PASSWORD, t) == f"wait {delay}"
        assert guess(t + timedelta(seconds=delay) / 2) == f"wait {delay // 2 or 1}"
        t += timedelta(seconds=delay)
        assert guess(t) == "invalid_credentials"
    # Another address is not affected; an IPv6 /64 is one source.
    assert _login(store, PASSWORD, t, source="192.0.2.77") == "ok"
    assert svc.source_key("2001:db8:1:2::1") == svc.source_key("2001:db8:1:2:ffff::9")
    assert svc.source_key("2001:db8:1:3::1") != svc.source_key("2001:db8:1:2::1")
    assert svc.source_key("::ffff:192.0.2.1") == svc.source_key("192.0.2.1")
    # A success does not reset the address (one valid account must not buy more guesses).
    assert _login(store, PASSWORD, t) == "wait 16"
    # The delay is capped, and an hour without failures forgets the address.
    assert svc.throttle_delay(1000) == svc.THROTTLE_MAX_DELAY == timedelta(minutes=15)
    t += svc.THROTTLE_FORGET
    assert _login(store, PASSWORD, t) == "ok"


def test_the_failure_table_stays_bounded(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lockout, "MAX_TRACKED", 4)
    t = datetime.now(UTC)
    for i in range(8):
        with pytest.raises(ProofplaneError):
            svc.login(
                store,
                f"ghost{i}",
                WRONG,
                None,
                session_ttl=timedelta(hours=1),
                now=t + timedelta(seconds=i),
                source=f"192.0.2.{i}",
            )
    with store.read() as s:
        assert (s.scalar(select(func.count()).select_from(AuthFailureRow)) or 0) <= 4


def test_an_unknown_name_lock_is_recorded_in_its_transaction(store: Store) -> None:
    """Rule 1: locking a name nobody has is a state change (``auth_failures.locked_until``),
    so it writes its ``account.lock`` event, as an account's lock does."""
    t0 = datetime.now(UTC)
    for i in range(svc.LOCK_AFTER):
        with pytest.raises(ProofplaneError):
            svc.login(
                store,
                "nobody",
                WRONG,
                None,
                session_ttl=timedelta(hours=1),
                now=t0 + timedelta(seconds=i),
            )
    with store.read() as s:
        locks = list(s.scalars(select(EventRow).where(EventRow.action == "account.lock")))
        row = s.get(AuthFailureRow, lockout.name_key("nobody"))
        assert row is not None and row.locked_until is not None
        assert [(e.target_id, e.details) for e in locks] == [
            (
                "nobody",
                {
                    "consecutive_failures": svc.LOCK_AFTER,
                    "locked_until": row.locked_until.isoformat(),
                    "unknown_user": True,
                },
            )
        ]
