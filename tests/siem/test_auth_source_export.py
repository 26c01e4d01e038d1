"""Issue 21: every authentication event says where the client was. Single sign-on logins and
their failures, logouts and recovery-code logins record the client's address (``source_ip``)
as password logins do, and export as OCSF Authentication with ``auth_protocol_id`` 4 (OpenID)
for SSO, ``src_endpoint`` the address and ``is_remote`` only when the address is known, valid
against the published OCSF 1.1.0 schema with zero errors, and as CEF with ``src``/``c6a2``.

Two halves: the use cases with the provider's HTTP half stubbed (an address from the
documentation range, so ``is_remote`` is true), and the whole flow through a real, OpenID
Certified provider (``node oidc-provider``, the fixtures of tests/api/test_oidc.py) and a real
uvicorn server, whose client is 127.0.0.1 (``is_remote`` false).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from proofplane.access import SYSTEM, totp
from proofplane.access import oidc as oidc_client
from proofplane.config import OidcSettings
from proofplane.errors import ProofplaneError
from proofplane.model import Event, Outcome
from proofplane.service import access as svc
from proofplane.service.context import Store
from siem_checks import cef_source as _cef_source
from siem_checks import events_of as _events
from siem_checks import valid_ocsf as _ocsf

ISSUER = "http://127.0.0.1:1/oidc"  # never contacted: discovery and the exchange are stubbed
CONFIG = OidcSettings(
    issuer=ISSUER,
    client_id="proofplane",
    client_secret="s3cret",
    redirect_uri="http://127.0.0.1:8470/api/v1/auth/oidc/callback",
)
CLIENT = "203.0.113.9"
CLIENT_V6 = "2001:db8::9"
TTL = timedelta(hours=1)
PASSWORD = "correct horse battery staple"


# --- the use cases, the provider stubbed ------------------------------------------------------


@pytest.fixture
def stub_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    metadata = oidc_client.ProviderMetadata(
        issuer=ISSUER,
        authorization_endpoint=f"{ISSUER}/authorize",
        token_endpoint=f"{ISSUER}/token",
        jwks_uri=f"{ISSUER}/jwks",
    )

    def complete_login(config: OidcSettings, **_: Any) -> oidc_client.FederatedIdentity:
        return oidc_client.FederatedIdentity("sub-1", "alice", ("staff",), (), ())

    monkeypatch.setattr(oidc_client, "discover", lambda issuer, **_: metadata)
    monkeypatch.setattr(oidc_client, "complete_login", complete_login)


def _state(store: Store) -> str:
    url = svc.begin_oidc_login(store, CONFIG, "/")
    return parse_qs(urlsplit(url).query)["state"][0]


def test_an_sso_login_exports_as_openid_from_the_client(store: Store, stub_provider: None) -> None:
    done = svc.complete_oidc_login(
        store, CONFIG, code="c", state=_state(store), session_ttl=TTL, source=CLIENT
    )
    [login] = _events(store, "auth.login")
    assert login.details["source_ip"] == CLIENT and login.details["method"] == "oidc"
    out = _ocsf(login)
    assert (out["class_uid"], out["type_uid"]) == (3002, 300201)
    assert (out["auth_protocol_id"], out["auth_protocol"]) == (4, "OpenID")
    assert out["src_endpoint"] == {"ip": CLIENT} and out["is_remote"] is True
    assert out["status_id"] == 1 and out["user"]["name"] == "alice"
    assert out["session"]["uid"] == done.issued.id
    assert _cef_source(login) == CLIENT
    # the session's logout, from another address (IPv6)
    actor = svc.authenticate(store, done.issued.token, datetime.now(UTC))
    svc.logout(store, actor, source=CLIENT_V6)
    [logout] = _events(store, "auth.logout")
    assert logout.details["source_ip"] == CLIENT_V6
    out = _ocsf(logout)
    assert out["type_uid"] == 300202 and out["src_endpoint"] == {"ip": CLIENT_V6}
    assert _cef_source(logout) == CLIENT_V6


@pytest.mark.parametrize(
    ("callback", "reason"),
    [
        ({"code": "c", "state": "never-issued"}, "invalid_state"),
        ({"code": None, "state": "x", "error": "access_denied"}, "provider_error"),
    ],
)
def test_a_failed_sso_login_says_where_it_came_from(
    store: Store, stub_provider: None, callback: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ProofplaneError):
        svc.complete_oidc_login(store, CONFIG, session_ttl=TTL, source=CLIENT, **callback)
    [failed] = _events(store, "auth.login")
    assert failed.outcome is Outcome.FAILURE and failed.details["reason"] == reason
    assert failed.details["source_ip"] == CLIENT
    out = _ocsf(failed)
    assert (out["auth_protocol_id"], out["status_id"], out["status_detail"]) == (4, 2, reason)
    assert out["src_endpoint"] == {"ip": CLIENT} and out["is_remote"] is True


def test_a_disabled_federated_user_is_refused_from_the_client(
    store: Store, stub_provider: None
) -> None:
    svc.complete_oidc_login(store, CONFIG, code="c", state=_state(store), session_ttl=TTL)
    svc.update_user(store, SYSTEM, "alice", disabled=True)
    with pytest.raises(ProofplaneError):
        svc.complete_oidc_login(
            store, CONFIG, code="c", state=_state(store), session_ttl=TTL, source=CLIENT
        )
    failed = _events(store, "auth.login")[-1]
    assert failed.details == {"method": "oidc", "reason": "disabled", "source_ip": CLIENT}
    assert _ocsf(failed)["src_endpoint"] == {"ip": CLIENT}


def test_a_recovery_code_login_says_where_it_came_from(store: Store) -> None:
    svc.create_user(store, SYSTEM, "ops1", PASSWORD, ["operator"], [])
    enrolling = svc.login(store, "ops1", PASSWORD, None, session_ttl=TTL, source=CLIENT)
    actor = svc.authenticate(store, enrolling.token, datetime.now(UTC))
    secret, _ = svc.mfa_begin(store, actor)
    recovery = svc.mfa_confirm(
        store, actor, totp.code_at_step(secret, totp.step_at(datetime.now(UTC).timestamp()))
    )
    svc.login(store, "ops1", PASSWORD, recovery[0], session_ttl=TTL, source=CLIENT)
    [used] = _events(store, "mfa.recovery_code.use")
    assert used.details["source_ip"] == CLIENT
    out = _ocsf(used)
    assert out["class_uid"] == 3002 and out["is_mfa"] is True
    assert out["src_endpoint"] == {"ip": CLIENT} and out["is_remote"] is True


@pytest.mark.parametrize("source", [None, "", "unknown", "testclient"])
def test_an_unknown_address_is_not_recorded_and_is_remote_not_claimed(
    store: Store, source: str | None
) -> None:
    svc.create_user(store, SYSTEM, "aud1", PASSWORD, ["auditor"], [])
    svc.login(store, "aud1", PASSWORD, None, session_ttl=TTL, source=source)
    [login] = _events(store, "auth.login")
    assert "source_ip" not in login.details
    out = _ocsf(login)
    assert "src_endpoint" not in out and "is_remote" not in out
    assert _cef_source(login) is None


def test_is_remote_follows_the_address() -> None:
    ts = datetime(2026, 1, 2, tzinfo=UTC)
    for address, remote in (("127.0.0.1", False), ("::1", False), ("10.0.0.8", True)):
        event = Event(1, ts, "alice", "auth.login", "user", "alice", Outcome.SUCCESS,
                      {"method": "oidc", "source_ip": address})  # fmt: skip
        assert _ocsf(event)["is_remote"] is remote
