"""Identity and access: TOTP, login and lockout, MFA enrollment, tokens, scoping, cookies,
and that no secret ever leaves in an answer or an event."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from proofplane.access import totp
from proofplane.access.credentials import csrf_token
from proofplane.api.errors import status_for
from proofplane.errors import ProofplaneError
from proofplane.service import access as svc
from proofplane.service.context import Store
from proofplane.store.tables import EventRow

PASSWORD = "correct horse battery staple"
RFC_SECRET = "GEZDGNBVGY3TQOJQGEZDGNBVGY3TQOJQ"  # base32 of "12345678901234567890"


# --- TOTP, pure ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (59, "94287082"),
        (1111111109, "07081804"),
        (1111111111, "14050471"),
        (1234567890, "89005924"),
        (2000000000, "69279037"),
        (20000000000, "65353130"),
    ],
)
def test_totp_rfc6238_sha1_vectors(t: int, expected: str) -> None:
    assert totp.code_at_step(RFC_SECRET, totp.step_at(t), digits=8) == expected
    assert totp.code_at_step(RFC_SECRET, totp.step_at(t)) == expected[-6:]


def test_totp_drift_and_replay() -> None:
    now = 1_700_000_000.0
    step = totp.step_at(now)
    for delta in (-1, 0, 1):
        assert (
            totp.verify(RFC_SECRET, totp.code_at_step(RFC_SECRET, step + delta), now, None)
            == step + delta
        )
    for delta in (-2, 2):
        assert (
            totp.verify(RFC_SECRET, totp.code_at_step(RFC_SECRET, step + delta), now, None) is None
        )
    code = totp.code_at_step(RFC_SECRET, step)
    assert totp.verify(RFC_SECRET, code, now, last_step=step) is None  # once only
    assert totp.verify(RFC_SECRET, code, now, last_step=step - 1) == step
    assert totp.verify(RFC_SECRET, "12345", now, None) is None
    assert totp.verify(RFC_SECRET, "abcdef", now, None) is None


def test_provisioning_uri() -> None:
    uri = totp.provisioning_uri(RFC_SECRET, "alice", "proofplane")
    assert uri.startswith("otpauth://totp/proofplane%3Aalice?")
    assert f"secret={RFC_SECRET}" in uri and "period=30" in uri and "digits=6" in uri


# --- helpers -----------------------------------------------------------------------------------


def anon(client: TestClient, source: str | None = None) -> TestClient:
    """No credential; from ``source`` (a client address) when given."""
    if source is None:
        return TestClient(client.app, raise_server_exceptions=False)
    return TestClient(client.app, raise_server_exceptions=False, client=(source, 50000))


def bearer(client: TestClient, token: str) -> TestClient:
    return TestClient(
        client.app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"}
    )


def make_user(
    client: TestClient, name: str, roles: list[str], tenants: list[str] | None = None
) -> dict:
    r = client.post(
        "/api/v1/users",
        json={"username": name, "password": PASSWORD, "roles": roles, "tenants": tenants or []},
    )
    assert r.status_code == 201, r.text
    return r.json()


def login(
    client: TestClient,
    name: str,
    password: str = PASSWORD,
    code: str | None = None,
    source: str | None = None,
) -> Any:
    body: dict[str, Any] = {"username": name, "password": password}
    if code is not None:
        body["totp"] = code
    return anon(client, source).post("/api/v1/auth/login", json=body)


def botnet(i: int) -> str:
    """The ``i``-th address of a distributed attacker (each under the per-address throttle)."""
    return f"198.51.100.{i + 1}"


def code_now(secret: str, offset: int = 0) -> str:
    return totp.code_at_step(secret, totp.step_at(time.time()) + offset)


def events(store: Store, action: str | None = None) -> list[EventRow]:
    with store.read() as s:
        q = select(EventRow).order_by(EventRow.seq)
        if action:
            q = q.where(EventRow.action == action)
        return list(s.scalars(q))


def enroll(client: TestClient, name: str) -> str:
    """Log an MFA-requiring user in, enroll TOTP; return the secret."""
    r = login(client, name)
    assert r.status_code == 200 and r.json()["mfa_enrollment_required"] is True
    session = bearer(client, r.json()["token"])
    secret = session.post("/api/v1/auth/mfa/enroll").json()["secret"]
    confirmed = session.post("/api/v1/auth/mfa/confirm", json={"totp": code_now(secret)})
    assert confirmed.status_code == 200, confirmed.text
    return secret


# --- login, lockout ------------------------------------------------------------------------------


def test_unauthenticated_requests_are_refused(client: TestClient) -> None:
    r = anon(client).get("/api/v1/nodes")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = anon(client).get("/api/v1/nodes", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
    r = bearer(client, "ppt_not-a-real-token").get("/api/v1/nodes")
    assert r.json()["error"]["code"] == "invalid_token"
    assert anon(client).get("/healthz").status_code == 200


def test_developer_login_and_me(client: TestClient) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    make_user(client, "dev", ["developer"], ["lab"])
    r = login(client, "dev")
    assert r.status_code == 200 and r.json()["kind"] == "session"
    me = bearer(client, r.json()["token"]).get("/api/v1/auth/me").json()
    assert me == {
        "username": "dev",
        "roles": ["developer"],
        "tenants": ["lab"],
        "token_id": r.json()["id"],
        "mfa_enrollment_required": False,
    }
    assert login(client, "dev", "wrong password!!").json()["error"]["code"] == "invalid_credentials"
    assert login(client, "nobody").json()["error"]["code"] == "invalid_credentials"


def test_ten_failures_lock_for_thirty_minutes(client: TestClient, store: Store) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    make_user(client, "victim", ["developer"], ["lab"])
    t0 = datetime.now(UTC)
    for i in range(10):
        with pytest.raises(ProofplaneError) as exc:
            svc.login(
                store,
                "victim",
                f"guess number {i}",
                None,
                session_ttl=timedelta(hours=1),
                now=t0 + timedelta(seconds=i),
            )
        assert exc.value.code == "invalid_credentials"
    # Locked now: even the right password is refused with 423, without being checked.
    r = login(client, "victim")
    assert r.status_code == 423 and r.json()["error"]["code"] == "account_locked"
    assert [e.details["consecutive_failures"] for e in events(store, "account.lock")] == [10]
    assert len(events(store, "alert.auth_failure_burst")) == 1
    assert sum(e.outcome == "failure" for e in events(store, "auth.login")) == 10
    # 29 minutes later still locked; 31 minutes later the right password works.
    with pytest.raises(ProofplaneError) as exc:
        svc.login(
            store,
            "victim",
            PASSWORD,
            None,
            session_ttl=timedelta(hours=1),
            now=t0 + timedelta(minutes=29),
        )
    assert exc.value.code == "account_locked" and status_for(exc.value) == 423
    ok = svc.login(
        store,
        "victim",
        PASSWORD,
        None,
        session_ttl=timedelta(hours=1),
        now=t0 + timedelta(minutes=31),
    )
    assert ok.kind == "session"


def test_admin_unlocks_an_account(client: TestClient, store: Store) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    make_user(client, "victim", ["developer"], ["lab"])
    for i in range(10):  # from ten addresses: one would be made to wait (lockout module)
        login(client, "victim", "nope nope nope", source=botnet(i))
    assert login(client, "victim").status_code == 423
    r = client.post("/api/v1/users/victim/unlock")
    assert r.json()["locked_until"] is None and r.json()["failed_logins"] == 0
    assert login(client, "victim").status_code == 200
    assert events(store, "account.unlock")


def test_password_spraying_raises_one_alert(client: TestClient, store: Store) -> None:
    for i in range(25):
        login(client, f"user{i}", "spray spray spray", source=botnet(i))
    alerts = events(store, "alert.auth_failure_spray")
    assert len(alerts) == 1 and alerts[0].details["failed_logins"] == 20


# --- MFA -----------------------------------------------------------------------------------------


def test_mfa_enrollment_then_totp_login_with_replay_refused(
    client: TestClient, store: Store
) -> None:
    make_user(client, "ops", ["operator"])
    r = login(client, "ops")
    enrolling = bearer(client, r.json()["token"])
    # The enrollment session can enroll and nothing else.
    refused = enrolling.get("/api/v1/nodes")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "mfa_enrollment_required"
    started = enrolling.post("/api/v1/auth/mfa/enroll").json()
    secret = started["secret"]
    assert started["otpauth_uri"].startswith("otpauth://totp/proofplane%3Aops?")
    wrong = "000000" if code_now(secret) != "000000" else "111111"
    bad = enrolling.post("/api/v1/auth/mfa/confirm", json={"totp": wrong})
    assert bad.json()["error"]["code"] in ("invalid_totp",)
    # One step, fixed up front: the server accepts ±1 step, so crossing a 30 s boundary
    # during the test changes nothing below.
    step0 = totp.step_at(time.time())
    confirm = {"totp": totp.code_at_step(secret, step0)}
    codes = enrolling.post("/api/v1/auth/mfa/confirm", json=confirm).json()["recovery_codes"]
    assert len(codes) == 10 and len(set(codes)) == 10
    assert enrolling.get("/api/v1/auth/me").status_code == 401  # session ended by enrollment
    assert login(client, "ops").json()["error"]["code"] == "mfa_required"
    # The code used to confirm enrollment cannot log in (same step): wait-free, use next step.
    used = totp.code_at_step(secret, step0)
    assert login(client, "ops", code=used).json()["error"]["code"] == "invalid_totp"
    nxt = totp.code_at_step(secret, step0 + 1)
    assert login(client, "ops", code=nxt).status_code == 200
    replay = login(client, "ops", code=nxt)
    assert replay.status_code == 401 and replay.json()["error"]["code"] == "invalid_totp"
    assert any(e.details.get("reason") == "totp_replayed" for e in events(store, "auth.login"))
    # A recovery code works once.
    assert login(client, "ops", code=codes[0]).status_code == 200
    assert login(client, "ops", code=codes[0]).status_code == 401
    assert events(store, "mfa.recovery_code.use")[0].details["remaining"] == 9


def test_wrong_totp_counts_towards_lockout(client: TestClient) -> None:
    make_user(client, "aud", ["auditor"])
    secret = enroll(client, "aud")
    for i in range(10):
        wrong = "000000" if code_now(secret) != "000000" else "111111"
        r = login(client, "aud", code=wrong, source=botnet(i))
        assert r.status_code == 401
    assert login(client, "aud", code=code_now(secret, 1)).status_code == 423


# --- tokens ---------------------------------------------------------------------------------------


def test_tokens_scope_expiry_revoke_rotate(client: TestClient, store: Store) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    client.post("/api/v1/tenants", json={"name": "other"})
    make_user(client, "dev", ["developer"], ["lab"])
    dev = bearer(client, login(client, "dev").json()["token"])
    too_long = dev.post("/api/v1/tokens", json={"expires_in": 91 * 86400})
    assert too_long.status_code == 422 and too_long.json()["error"]["code"] == "invalid_expiry"
    assert (
        dev.post("/api/v1/tokens", json={"expires_in": 3600, "roles": ["admin"]}).status_code == 403
    )
    assert (
        dev.post("/api/v1/tokens", json={"expires_in": 3600, "tenants": ["other"]}).status_code
        == 403
    )
    assert dev.post("/api/v1/tokens", json={"roles": ["developer"]}).status_code == 422
    r = dev.post("/api/v1/tokens", json={"expires_in": 3600, "name": "ci"})
    assert r.status_code == 201
    issued = r.json()
    listed = dev.get("/api/v1/tokens").json()["items"]
    assert issued["id"] in [t["id"] for t in listed]
    assert issued["token"] not in json.dumps(listed)
    ci = bearer(client, issued["token"])
    assert ci.get("/api/v1/workloads").status_code == 200
    assert ci.get("/api/v1/events").status_code == 403  # developers do not read the log
    rotated = dev.post(f"/api/v1/tokens/{issued['id']}/rotate").json()
    assert ci.get("/api/v1/workloads").json()["error"]["code"] == "invalid_token"
    ci2 = bearer(client, rotated["token"])
    assert ci2.get("/api/v1/workloads").status_code == 200
    assert dev.delete(f"/api/v1/tokens/{rotated['id']}").json()["revoked_at"]
    assert ci2.get("/api/v1/workloads").status_code == 401
    # Somebody else's token id is simply not found.
    make_user(client, "dev2", ["developer"], ["lab"])
    dev2 = bearer(client, login(client, "dev2").json()["token"])
    mine = dev.post("/api/v1/tokens", json={"expires_in": 600}).json()
    assert dev2.delete(f"/api/v1/tokens/{mine['id']}").status_code == 404
    # Expiry is enforced at use.
    with pytest.raises(ProofplaneError) as exc:
        svc.authenticate(store, mine["token"], datetime.now(UTC) + timedelta(minutes=11))
    assert exc.value.code == "token_expired"


def test_token_never_exceeds_its_owner_now(client: TestClient) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    make_user(client, "dev", ["developer"], ["lab"])
    dev = bearer(client, login(client, "dev").json()["token"])
    api = bearer(client, dev.post("/api/v1/tokens", json={"expires_in": 3600}).json()["token"])
    # A grant added: the session ends (the next login carries it), the API token keeps working
    # with the scope it was issued with, never more than the owner holds.
    client.post("/api/v1/tenants", json={"name": "more"})
    client.patch("/api/v1/users/dev", json={"tenants": ["lab", "more"]})
    assert dev.get("/api/v1/workloads").status_code == 401
    assert api.get("/api/v1/workloads").status_code == 200
    assert api.get("/api/v1/workloads", params={"tenant": "more"}).status_code == 404
    # A grant taken away: every credential is revoked (tests/service/test_token_hardening.py).
    client.patch("/api/v1/users/dev", json={"tenants": ["lab"], "roles": []})
    assert api.get("/api/v1/workloads").status_code == 401


def test_agent_credentials_grant_no_user_access(client: TestClient) -> None:
    client.post("/api/v1/nodes", json={"name": "n1", "region": "r", "zone": "z", "gpus": []})
    r = client.post("/api/v1/nodes/n1/agent-credentials", json={"ttl_days": 7})
    assert r.status_code == 201 and r.json()["kind"] == "agent"
    agent = bearer(client, r.json()["token"])
    assert agent.get("/api/v1/auth/me").json()["username"] == "node:n1"
    assert agent.get("/api/v1/nodes").status_code == 403
    assert client.post("/api/v1/nodes/ghost/agent-credentials").status_code == 404


# --- users and tenant-admins ---------------------------------------------------------------------


def test_tenant_admin_manages_only_their_tenant(client: TestClient) -> None:
    for t in ("lab", "other"):
        client.post("/api/v1/tenants", json={"name": t})
    make_user(client, "ta", ["tenant-admin"], ["lab"])
    make_user(client, "stranger", ["developer"], ["other"])
    from proofplane.access import Actor, Role

    issued = svc.issue_token(
        Store(client.app.state.store.url, client.app.state.store.engine),
        Actor("ta", frozenset({Role.TENANT_ADMIN}), frozenset({"lab"})),
        roles=None,
        tenants=None,
        expires_in=3600,
    )
    ta = bearer(client, issued.token)
    ok = ta.post(
        "/api/v1/users",
        json={
            "username": "newdev",
            "password": PASSWORD,
            "roles": ["developer"],
            "tenants": ["lab"],
        },
    )
    assert ok.status_code == 201
    assert (
        ta.post(
            "/api/v1/users",
            json={"username": "x1", "password": PASSWORD, "roles": ["admin"], "tenants": ["lab"]},
        ).status_code
        == 403
    )
    other = ta.post(
        "/api/v1/users",
        json={"username": "x2", "password": PASSWORD, "roles": ["developer"], "tenants": ["other"]},
    )
    assert other.status_code == 404
    assert [u["username"] for u in ta.get("/api/v1/users").json()["items"]] == ["newdev", "ta"]
    assert ta.get("/api/v1/users/stranger").status_code == 404
    assert ta.patch("/api/v1/users/stranger", json={"disabled": True}).status_code == 404


def test_user_input_errors(client: TestClient, store: Store) -> None:
    before = len(events(store))
    cases = [
        ({"username": "ok", "password": "short", "roles": []}, 422, "weak_password"),
        ({"username": "Bad Name", "password": PASSWORD, "roles": []}, 422, "validation_failed"),
        ({"username": "ok", "password": PASSWORD, "roles": ["wizard"]}, 422, "unknown_role"),
        ({"username": "ok", "password": PASSWORD, "roles": ["developer"]}, 422, "tenant_required"),
        (
            {"username": "ok", "password": PASSWORD, "roles": ["developer"], "tenants": ["ghost"]},
            404,
            "not_found",
        ),
    ]
    for body, status, code in cases:
        r = client.post("/api/v1/users", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), body
    make_user(client, "dup", ["auditor"])
    assert (
        client.post(
            "/api/v1/users", json={"username": "dup", "password": PASSWORD, "roles": []}
        ).status_code
        == 409
    )
    assert len(events(store)) == before + 1  # only the successful create


# --- browser sessions ----------------------------------------------------------------------------


def test_cookie_session_needs_csrf_token_for_changes(client: TestClient) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    make_user(client, "dev", ["developer"], ["lab"])
    browser = anon(client)
    r = browser.post(
        "/api/v1/auth/login", json={"username": "dev", "password": PASSWORD, "cookie": True}
    )
    cookies = r.headers.get_list("set-cookie")
    session = next(c for c in cookies if c.startswith("proofplane_session="))
    assert "HttpOnly" in session and "SameSite=strict" in session and "Secure" in session
    assert r.json()["csrf_token"] == csrf_token(r.json()["token"])
    token = r.json()["token"]
    jar = TestClient(
        client.app, raise_server_exceptions=False, cookies={"proofplane_session": token}
    )
    assert jar.get("/api/v1/workloads").status_code == 200
    body = {"name": "w1", "tenant": "lab", "gpus": {"share_milli": 100}}
    refused = jar.post("/api/v1/workloads", json=body)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
    ok = jar.post("/api/v1/workloads", json=body, headers={"X-CSRF-Token": r.json()["csrf_token"]})
    assert ok.status_code == 201


# --- bootstrap and secrecy ----------------------------------------------------------------------


def test_bootstrap_admin_only_on_a_fresh_control_plane(store: Store) -> None:
    assert svc.bootstrap_admin(store, "ppt_first-token-abcdefgh") is True
    assert svc.bootstrap_admin(store, "ppt_second-token-abcdefgh") is False
    with pytest.raises(ProofplaneError) as exc:
        svc.bootstrap_admin(store, "short")
    assert exc.value.code == "weak_token"
    actor = svc.authenticate(store, "ppt_first-token-abcdefgh", datetime.now(UTC))
    assert actor.name == "admin" and {r.value for r in actor.roles} == {"admin"}
    with pytest.raises(ProofplaneError):
        svc.authenticate(store, "ppt_second-token-abcdefgh", datetime.now(UTC))


def test_no_secret_in_events_or_listings(
    client: TestClient, store: Store, admin_token: str
) -> None:
    client.post("/api/v1/tenants", json={"name": "lab"})
    make_user(client, "ops", ["operator"])
    secret = enroll(client, "ops")
    session = login(client, "ops", code=code_now(secret, 1)).json()["token"]
    api = bearer(client, session).post("/api/v1/tokens", json={"expires_in": 600}).json()["token"]
    login(client, "ops", PASSWORD + "x")  # a failure, recorded
    login(client, PASSWORD, "whatever")  # a password typed into the username box
    dumped = json.dumps([e.details for e in events(store)]) + json.dumps(
        [
            client.get(p).json()
            for p in ("/api/v1/users", "/api/v1/tokens", "/api/v1/events", "/api/v1/users/ops")
        ]
    )
    for s in (PASSWORD, secret, session, api, admin_token):
        assert s not in dumped
    assert "<invalid>" in json.dumps([e.target_id for e in events(store, "auth.login")])


@pytest.mark.parametrize("value", ["short", "x" * 15, "x" * 257])
def test_admin_token_setting_is_checked_at_start(value: str) -> None:
    from proofplane import config

    with pytest.raises(ProofplaneError) as info:
        config.from_env({"PROOFPLANE_ADMIN_TOKEN": value})
    assert info.value.code == "invalid_setting"
    assert value not in info.value.message  # the secret is never echoed back


def test_admin_token_setting_accepts_a_long_enough_token() -> None:
    from proofplane import config

    assert config.from_env({"PROOFPLANE_ADMIN_TOKEN": "y" * 16}).admin_token == "y" * 16
    assert config.from_env({}).admin_token is None
