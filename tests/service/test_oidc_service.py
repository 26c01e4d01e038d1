"""The single sign-on use cases without a browser or a provider: ``begin_oidc_login`` and
``complete_oidc_login`` refuse what they must (no provider configured, a return_to off the
site, an unknown, used or expired state, a provider error), record every refused completion,
and use a state up exactly once. The provider's HTTP half is replaced by stand-ins; the
real flow against a real provider is tests/test_oidc.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import select

from proofplane.access import SYSTEM, Unauthenticated
from proofplane.access import oidc as oidc_client
from proofplane.config import OidcSettings
from proofplane.errors import NotFound, ValidationFailed
from proofplane.service import access as svc
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, OidcLoginRow, UserRow

ISSUER = "http://127.0.0.1:1/oidc"  # never contacted: discovery and the exchange are stubbed
CONFIG = OidcSettings(
    issuer=ISSUER,
    client_id="proofplane",
    client_secret="s3cret",
    redirect_uri="http://127.0.0.1:8470/api/v1/auth/oidc/callback",
)
METADATA = oidc_client.ProviderMetadata(
    issuer=ISSUER,
    authorization_endpoint=f"{ISSUER}/authorize",
    token_endpoint=f"{ISSUER}/token",
    jwks_uri=f"{ISSUER}/jwks",
)
TTL = timedelta(hours=1)


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Stand-ins for the provider's HTTP half; returns the calls to ``complete_login``."""
    calls: list[dict[str, Any]] = []

    def discover(issuer: str, **_: Any) -> oidc_client.ProviderMetadata:
        assert issuer == ISSUER
        return METADATA

    def complete_login(
        config: OidcSettings, *, code: str, code_verifier: str, nonce: str
    ) -> oidc_client.FederatedIdentity:
        calls.append({"code": code, "code_verifier": code_verifier, "nonce": nonce})
        return oidc_client.FederatedIdentity("sub-1", "alice", ("staff",), (), ())

    monkeypatch.setattr(oidc_client, "discover", discover)
    monkeypatch.setattr(oidc_client, "complete_login", complete_login)
    return calls


def _failures(store: Store) -> list[dict[str, Any]]:
    with store.read() as session:
        rows = session.scalars(
            select(EventRow).where(EventRow.action == "auth.login").order_by(EventRow.seq)
        )
        return [r.details for r in rows if r.outcome == "failure"]


def _states(store: Store) -> list[str]:
    with store.read() as session:
        return list(session.scalars(select(OidcLoginRow.state)))


def _begin(store: Store, return_to: str | None = None) -> str:
    url = svc.begin_oidc_login(store, CONFIG, return_to)
    return parse_qs(urlsplit(url).query)["state"][0]


def _complete(store: Store, **kw: Any) -> svc.OidcSession:
    kw.setdefault("code", "the-code")
    return svc.complete_oidc_login(store, CONFIG, session_ttl=TTL, **kw)


# --- not configured ---------------------------------------------------------------------------


def test_both_halves_answer_not_configured_without_a_provider(store: Store) -> None:
    with pytest.raises(NotFound) as begin:
        svc.begin_oidc_login(store, None, "/")
    with pytest.raises(NotFound) as complete:
        svc.complete_oidc_login(store, None, code="c", state="s", session_ttl=TTL)
    assert begin.value.code == complete.value.code == "oidc_not_configured"
    assert _failures(store) == []  # nothing to record: SSO is not a thing here


# --- begin ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["https://evil.example/", "//evil.example/", "/\\evil.example", "/a\tb", "relative"]
)
def test_begin_refuses_a_return_to_off_the_site_before_contacting_the_provider(
    store: Store, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    def discover(*_: Any, **__: Any) -> None:
        raise AssertionError("the provider must not be contacted")

    monkeypatch.setattr(oidc_client, "discover", discover)
    with pytest.raises(ValidationFailed) as exc:
        svc.begin_oidc_login(store, CONFIG, bad)
    assert exc.value.code == "invalid_return_to"
    assert _states(store) == []


def test_begin_stores_one_state_and_drops_the_expired_ones(
    store: Store, provider: list[dict[str, Any]]
) -> None:
    with store.write(SYSTEM) as tx:
        tx.session.add(
            OidcLoginRow(
                state="old",
                nonce="n",
                code_verifier="v",
                return_to="/",
                expires_at=tx.now - timedelta(seconds=1),
            )
        )
    url = svc.begin_oidc_login(store, CONFIG, None)
    query = parse_qs(urlsplit(url).query)
    assert url.startswith(f"{ISSUER}/authorize?")
    assert query["code_challenge_method"] == ["S256"]
    assert _states(store) == query["state"]
    with store.read() as session:
        row = session.get(OidcLoginRow, query["state"][0])
        assert row is not None and row.return_to == "/"  # the default
        assert row.expires_at - datetime.now(UTC) <= svc.LOGIN_TTL


# --- complete: the state ----------------------------------------------------------------------


@pytest.mark.parametrize("state", [None, "", "no-such-state"])
def test_complete_refuses_an_unknown_state_and_records_it(
    store: Store, provider: list[dict[str, Any]], state: str | None
) -> None:
    with pytest.raises(svc.InvalidOidcState) as exc:
        _complete(store, state=state)
    assert exc.value.code == "invalid_oidc_state"
    assert provider == []  # no code was exchanged
    assert _failures(store) == [{"method": "oidc", "reason": "invalid_state", "issuer": ISSUER}]


def test_complete_refuses_an_expired_state_and_uses_it_up(
    store: Store, provider: list[dict[str, Any]]
) -> None:
    state = _begin(store, "/somewhere")
    with store.write(SYSTEM) as tx:
        row = tx.session.get(OidcLoginRow, state)
        assert row is not None
        row.expires_at = tx.now - timedelta(seconds=1)
    with pytest.raises(svc.InvalidOidcState):
        _complete(store, state=state)
    assert _states(store) == []
    assert provider == []
    assert [f["reason"] for f in _failures(store)] == ["invalid_state"]


def test_a_state_is_used_once(store: Store, provider: list[dict[str, Any]]) -> None:
    state = _begin(store, "/after")
    done = _complete(store, state=state)
    assert done.return_to == "/after"
    assert done.issued.kind == "session"
    assert svc.authenticate(store, done.issued.token, datetime.now(UTC)).name == "alice"
    assert len(provider) == 1 and provider[0]["code"] == "the-code"
    with pytest.raises(svc.InvalidOidcState):
        _complete(store, state=state)
    assert len(provider) == 1
    with store.read() as session:
        user = session.scalar(select(UserRow).where(UserRow.username == "alice"))
        assert user is not None and user.external_subject == f"{ISSUER}#sub-1"


# --- complete: what the provider sends back ---------------------------------------------------


def test_a_provider_error_uses_the_state_up_and_is_recorded(
    store: Store, provider: list[dict[str, Any]]
) -> None:
    state = _begin(store)
    with pytest.raises(svc.OidcProviderError) as exc:
        _complete(
            store, state=state, error="access_denied", error_description="no " * 200, code=None
        )
    assert exc.value.code == "oidc_error"
    assert exc.value.details["error"] == "access_denied"
    assert len(exc.value.details["error_description"]) == 300
    assert _states(store) == []
    assert _failures(store) == [
        {"method": "oidc", "reason": "provider_error", "issuer": ISSUER, "error": "access_denied"}
    ]


def test_a_provider_error_word_that_is_not_one_is_not_recorded_verbatim(
    store: Store, provider: list[dict[str, Any]]
) -> None:
    with pytest.raises(svc.OidcProviderError):
        _complete(store, state=None, error="<script>")
    assert _failures(store)[0]["error"] == "<invalid>"


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"code": None}, "no_code"),
        ({"code": ""}, "no_code"),
        ({"iss": "https://another.example"}, "issuer_mismatch"),
    ],
)
def test_a_callback_without_a_code_or_from_another_issuer_fails_and_is_recorded(
    store: Store, provider: list[dict[str, Any]], kw: dict[str, Any], reason: str
) -> None:
    state = _begin(store)
    with pytest.raises(oidc_client.OidcFailed) as exc:
        _complete(store, state=state, **kw)
    assert exc.value.reason == reason
    assert provider == []
    assert [f["reason"] for f in _failures(store)] == [reason]


def test_a_disabled_federated_user_is_refused_and_recorded_once(
    store: Store, provider: list[dict[str, Any]]
) -> None:
    _complete(store, state=_begin(store))
    with store.write(SYSTEM) as tx:
        user = tx.session.scalar(select(UserRow).where(UserRow.username == "alice"))
        assert user is not None
        user.disabled = True
    with pytest.raises(Unauthenticated):
        _complete(store, state=_begin(store))
    assert _failures(store) == [{"method": "oidc", "reason": "disabled"}]
