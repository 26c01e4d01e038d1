"""Tokens that outlive what minted them, credentials that survive their owner's disabling, and
admins that rotate other people's tokens (issue 19, §4): each test performs the attack.

The rules (README, "Access control"): a token minted with an API token expires no later than
that token and is revoked with it (a session may mint up to 90 days); disabling a user, changing
their password or taking a grant away revokes every credential they hold, for good; only a
token's owner may rotate it, an admin revokes it instead.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from proofplane.access import Actor, Role
from proofplane.errors import ProofplaneError
from proofplane.model import Tenant
from proofplane.service import access as svc
from proofplane.service import tenants as tenants_svc
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, TokenRow

PASSWORD = "correct horse battery staple"
DAY = 86400
ADMIN = Actor("system", frozenset({Role.ADMIN}))


def anon(client: TestClient) -> TestClient:
    return TestClient(client.app, raise_server_exceptions=False)


def bearer(client: TestClient, token: str) -> TestClient:
    return TestClient(
        client.app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"}
    )


def developer(client: TestClient, name: str = "dev", tenants: tuple[str, ...] = ("lab",)) -> Any:
    """A developer on ``tenants``, signed in with a session."""
    for t in tenants:
        client.post("/api/v1/tenants", json={"name": t})
    body = {"username": name, "password": PASSWORD, "roles": ["developer"], "tenants": tenants}
    assert client.post("/api/v1/users", json=body).status_code == 201
    r = anon(client).post("/api/v1/auth/login", json={"username": name, "password": PASSWORD})
    assert r.status_code == 200, r.text
    return bearer(client, r.json()["token"])


def mint(as_: TestClient, expires_in: int, **body: Any) -> Any:
    return as_.post("/api/v1/tokens", json={"expires_in": expires_in, **body})


def works(as_: TestClient) -> bool:
    r = as_.get("/api/v1/workloads")
    assert r.status_code in (200, 401), r.text
    return r.status_code == 200


def parse(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def row(store: Store, token_id: str) -> TokenRow:
    with store.read() as s:
        found = s.get(TokenRow, token_id)
        assert found is not None
        s.expunge(found)
        return found


# --- a token does not outlive what minted it --------------------------------------------------


def test_a_60_second_token_cannot_mint_a_90_day_token(client: TestClient, store: Store) -> None:
    session = developer(client)
    short = mint(session, 60)
    assert short.status_code == 201, short.text
    with_short = bearer(client, short.json()["token"])

    # The attack: a 60-second token mints a 90-day one. Refused, and says how long it may be.
    r = mint(with_short, 90 * DAY)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "expiry_beyond_parent"
    assert error["details"]["parent"] == short.json()["id"]
    assert 0 <= error["details"]["max_expires_in"] <= 60
    # Nor even a minute: less than that is left of it, and a minute is the shortest token.
    assert mint(with_short, 60).json()["error"]["code"] == "expiry_beyond_parent"

    # Within its parent's life, a token may mint (and the child records who minted it).
    five = mint(session, 300).json()
    ok = mint(bearer(client, five["token"]), 240)
    assert ok.status_code == 201, ok.text
    assert parse(ok.json()["expires_at"]) <= parse(five["expires_at"])
    assert row(store, ok.json()["id"]).parent_id == five["id"]
    assert mint(bearer(client, five["token"]), 301).status_code == 422

    # A session is the user in person: it may mint up to the 90-day maximum.
    long = mint(session, 90 * DAY)
    assert long.status_code == 201, long.text
    # ... and a 90-day token, in turn, may mint a 90-day token only up to its own end.
    with_long = bearer(client, long.json()["token"])
    assert mint(with_long, 90 * DAY).json()["error"]["code"] == "expiry_beyond_parent"
    assert mint(with_long, 89 * DAY).status_code == 201


def test_the_bound_holds_at_the_service_too(store: Store) -> None:
    """The rule lives in the service, not in the route: a caller in the process is held to it."""
    tenants_svc.create_tenant(store, ADMIN, Tenant("lab"))
    svc.create_user(store, ADMIN, "dev", PASSWORD, ["developer"], ["lab"])
    session = svc.login(store, "dev", PASSWORD, None, session_ttl=timedelta(hours=1))
    me = svc.authenticate(store, session.token, datetime.now(UTC))
    parent = svc.issue_token(store, me, roles=None, tenants=None, expires_in=120)
    as_parent = svc.authenticate(store, parent.token, datetime.now(UTC))
    with pytest.raises(ProofplaneError) as exc:
        svc.issue_token(store, as_parent, roles=None, tenants=None, expires_in=90 * DAY)
    assert exc.value.code == "expiry_beyond_parent"


def test_revoking_a_token_revokes_what_it_minted(client: TestClient, store: Store) -> None:
    session = developer(client)
    parent = mint(session, 3600).json()
    child = mint(bearer(client, parent["token"]), 600).json()
    grandchild = mint(bearer(client, child["token"]), 300).json()
    sibling = mint(session, 600).json()  # minted in the session, not by the parent
    assert all(works(bearer(client, t["token"])) for t in (parent, child, grandchild, sibling))

    assert session.delete(f"/api/v1/tokens/{parent['id']}").status_code == 200
    assert not works(bearer(client, parent["token"]))
    assert not works(bearer(client, child["token"]))
    assert not works(bearer(client, grandchild["token"]))
    assert works(bearer(client, sibling["token"]))
    with store.read() as s:
        reasons = {
            e.target_id: e.details.get("reason")
            for e in s.scalars(select(EventRow).where(EventRow.action == "token.revoke"))
        }
    assert reasons[child["id"]] == reasons[grandchild["id"]] == "parent revoked"

    # Tokens minted in a session are the user's own: logging out leaves them working.
    assert session.post("/api/v1/auth/logout").status_code == 204
    assert works(bearer(client, sibling["token"]))


def test_rotation_cannot_stretch_a_token_past_its_parent(client: TestClient) -> None:
    session = developer(client)
    parent = mint(session, 3600).json()
    with_parent = bearer(client, parent["token"])
    child = mint(with_parent, 1800).json()
    # Rotating the child for a day longer than its parent lives: refused.
    r = session.post(f"/api/v1/tokens/{child['id']}/rotate", json={"expires_in": DAY})
    assert r.status_code == 422 and r.json()["error"]["code"] == "expiry_beyond_parent"
    # A token rotating itself cannot extend its own life either (default: as long as before).
    rotated = with_parent.post(f"/api/v1/tokens/{parent['id']}/rotate")
    assert rotated.status_code == 201, rotated.text
    assert parse(rotated.json()["expires_at"]) <= parse(parent["expires_at"])
    # Rotation revokes the old token and, with it, what it minted.
    assert not works(bearer(client, child["token"]))
    assert works(bearer(client, rotated.json()["token"]))


# --- disabling, a grant taken away, a new password: revoked for good -----------------------------

CHANGES = {  # what is taken, what is given back
    "disable": ({"disabled": True}, {"disabled": False}),
    "role-removed": ({"roles": []}, {"roles": ["developer"]}),
    "tenant-removed": ({"tenants": ["lab"]}, {"tenants": ["lab", "lab2"]}),
    "password": ({"password": "a brand new passphrase"}, None),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_credentials_do_not_survive_and_do_not_come_back(
    change: str, client: TestClient, store: Store
) -> None:
    session = developer(client, tenants=("lab", "lab2"))
    api = bearer(client, mint(session, 3600).json()["token"])
    assert works(api) and works(session)

    take, give_back = CHANGES[change]
    r = client.patch("/api/v1/users/dev", json=take)
    assert r.status_code == 200, r.text
    assert not works(api) and not works(session)
    if give_back is not None:
        assert client.patch("/api/v1/users/dev", json=give_back).status_code == 200
    # Re-enabling or granting the role back revives nothing.
    assert not works(api) and not works(session)
    for who in (api, session):
        assert who.get("/api/v1/auth/me").json()["error"]["code"] == "invalid_token"
    with store.read() as s:
        update = s.scalars(
            select(EventRow).where(EventRow.action == "user.update").order_by(EventRow.seq)
        ).first()
        assert update is not None and update.details["credentials_revoked"] == 2
    # A fresh login works once the user is whole again.
    if change != "password" and give_back is not None:
        fresh = anon(client).post(
            "/api/v1/auth/login", json={"username": "dev", "password": PASSWORD}
        )
        assert fresh.status_code == 200 and works(bearer(client, fresh.json()["token"]))


def test_a_grant_added_keeps_api_tokens(client: TestClient) -> None:
    session = developer(client)
    api = bearer(client, mint(session, 3600).json()["token"])
    client.post("/api/v1/tenants", json={"name": "more"})
    assert client.patch("/api/v1/users/dev", json={"tenants": ["lab", "more"]}).status_code == 200
    assert works(api)  # nothing was taken away


def test_a_grant_removed_at_the_identity_provider_revokes_too(store: Store) -> None:
    tenants_svc.create_tenant(store, ADMIN, Tenant("lab"))

    def sso(roles: list[str]) -> svc.IssuedToken:
        return svc.login_federated(
            store,
            subject="sub-1",
            username="hal",
            roles=roles,
            tenants=["lab"],
            issuer="https://idp.example",
            session_ttl=timedelta(hours=1),
        )

    first = sso(["developer"])
    me = svc.authenticate(store, first.token, datetime.now(UTC))
    api = svc.issue_token(store, me, roles=None, tenants=None, expires_in=3600)
    sso([])  # the provider took the group away
    sso(["developer"])  # ... and gave it back
    for token in (first.token, api.token):
        with pytest.raises(ProofplaneError) as exc:
            svc.authenticate(store, token, datetime.now(UTC))
        assert exc.value.code == "invalid_token"


# --- only the owner rotates ---------------------------------------------------------------------


def test_an_admin_cannot_rotate_another_users_token_but_can_revoke_it(client: TestClient) -> None:
    session = developer(client)
    issued = mint(session, 3600).json()
    api = bearer(client, issued["token"])

    # The attack: the admin rotates the developer's token and receives a credential that
    # acts as the developer.
    r = client.post(f"/api/v1/tokens/{issued['id']}/rotate")
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden"
    assert "owner" in r.json()["error"]["message"]
    assert works(api)  # untouched
    # Another developer does not even see it.
    other = developer(client, "dev2")
    assert other.post(f"/api/v1/tokens/{issued['id']}/rotate").status_code == 404
    # The owner may; the admin may revoke.
    assert session.post(f"/api/v1/tokens/{issued['id']}/rotate").status_code == 201
    mine = mint(session, 3600).json()
    assert client.delete(f"/api/v1/tokens/{mine['id']}").status_code == 200
    assert not works(bearer(client, mine["token"]))
