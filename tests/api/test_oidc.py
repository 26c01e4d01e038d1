"""OIDC single sign-on: the pure parts (mapping, URL, ID-token checks) against keys made here,
the HTTP parts against a scripted provider (httpx.MockTransport), and the whole flow against a
real, OpenID Certified provider (node ``oidc-provider`` 9, ``tests/oidc/provider.mjs``) on
loopback, driven through its real login and consent pages.

The real-provider tests need ``node`` and ``tests/oidc/node_modules`` (``scripts/test-deps.sh``
installs them). Without them they are skipped locally and FAIL in CI (``CI=true``).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, unquote_plus, urlencode, urljoin, urlsplit

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, OctKey, RSAKey
from sqlalchemy import select

from ci import TESTS, unavailable
from proofplane.access import SYSTEM, oidc
from proofplane.api.app import create_app
from proofplane.api.errors import status_for
from proofplane.config import OidcSettings, Settings
from proofplane.model import Outcome
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, OidcLoginRow, UserRow
from siem_checks import cef_source, events_of, valid_ocsf

OIDC_DIR = TESTS / "oidc"
CLIENT_ID = "proofplane-test"
CLIENT_SECRET = "s3cret:with/odd+chars &more"  # exercises client_secret_basic's urlencoding
GROUP_MAP: dict[str, dict[str, list[str]]] = {
    "pp-admins": {"roles": ["admin"]},
    "clinic-devs": {"roles": ["developer"], "tenants": ["clinic"]},
    "auditors": {"roles": ["auditor"]},
}
API = "/api/v1"


@pytest.fixture(autouse=True)
def _fresh_oidc_caches() -> Iterator[None]:
    oidc.clear_caches()
    yield
    oidc.clear_caches()


# --- pure: groups, usernames, claims -----------------------------------------------------------


def test_map_groups_is_the_union_over_known_groups() -> None:
    group_map = {
        "a": {"roles": ["admin"], "tenants": ["t1"]},
        "b": {"roles": ["developer"], "tenants": ["t2", "t1"]},
        "c": {"roles": ["developer"]},
    }
    assert oidc.map_groups(["b", "a", "zzz", "b"], group_map) == (
        ["admin", "developer"],
        ["t1", "t2"],
    )
    assert oidc.map_groups(["c"], group_map) == (["developer"], [])
    assert oidc.map_groups(["unmapped"], group_map) == ([], [])
    assert oidc.map_groups([], group_map) == ([], [])


def test_map_groups_refuses_an_unknown_role_in_the_map() -> None:
    with pytest.raises(oidc.OidcMisconfigured, match="unknown role 'root'"):
        oidc.map_groups(["g"], {"g": {"roles": ["root"]}})
    # a group the user is not in is not looked at
    assert oidc.map_groups(["h"], {"g": {"roles": ["root"]}}) == ([], [])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("alice", "alice"),
        ("Alice.Smith@Example.COM", "alice.smith@example.com"),
        ("  Bob  ", "bob"),
        ("José Müller", "jose-muller"),
        ("auth0|0123", "auth0-0123"),
        ("__admin", "admin"),
        ("x" * 80, "x" * 63),
        ("Ωμέγα", None),
        ("---", None),
        ("", None),
        (None, None),
        (42, None),
    ],
)
def test_normalize_username(raw: Any, expected: str | None) -> None:
    got = oidc.normalize_username(raw)
    assert got == expected
    if got is not None:
        assert re.fullmatch(r"[a-z0-9][a-z0-9._@-]{0,62}", got)


def test_username_falls_back_to_email_local_part_then_sub() -> None:
    claims = {"sub": "S-1", "preferred_username": "Carol", "email": "c.x@example.test"}
    assert oidc.username_from_claims(claims, "preferred_username") == "carol"
    assert oidc.username_from_claims(claims, "nickname") == "c.x"
    assert oidc.username_from_claims({"sub": "S-1", "email": "bad"}, "nickname") == "s-1"
    assert oidc.username_from_claims({"sub": "S-1", "upn": "Ωμ"}, "upn") == "s-1"
    with pytest.raises(oidc.OidcFailed, match="no usable username"):
        oidc.username_from_claims({"sub": "Ωμ"}, "preferred_username")


def test_groups_claim_shapes() -> None:
    assert oidc.groups_from_claims({"groups": ["a", 3, "b"]}, "groups") == ["a", "b"]
    assert oidc.groups_from_claims({"groups": "solo"}, "groups") == ["solo"]
    assert oidc.groups_from_claims({"groups": {"a": 1}}, "groups") == []
    assert oidc.groups_from_claims({}, "groups") is None
    assert oidc.groups_from_claims({"roles": ["x"]}, "roles") == ["x"]


def test_identity_from_claims() -> None:
    settings = _settings("https://idp.example.test", group_map=GROUP_MAP)
    ident = oidc.identity_from_claims(
        {"sub": "u-9", "preferred_username": "Dave", "groups": ["auditors", "clinic-devs", "x"]},
        settings,
    )
    assert ident == oidc.FederatedIdentity(
        subject="u-9",
        username="dave",
        groups=("auditors", "clinic-devs", "x"),
        roles=("auditor", "developer"),
        tenants=("clinic",),
    )
    nobody = oidc.identity_from_claims({"sub": "u-10"}, settings)
    assert (nobody.username, nobody.roles, nobody.tenants) == ("u-10", (), ())


# --- pure: metadata, PKCE, the authorization URL ----------------------------------------------


def _doc(issuer: str, **over: Any) -> dict[str, Any]:
    doc = {
        "issuer": issuer,
        "authorization_endpoint": f"{issuer}/auth",
        "token_endpoint": f"{issuer}/token",
        "jwks_uri": f"{issuer}/jwks",
        "userinfo_endpoint": f"{issuer}/me",
        "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
        "id_token_signing_alg_values_supported": ["RS256"],
        "code_challenge_methods_supported": ["S256"],
    }
    doc.update(over)
    return {k: v for k, v in doc.items() if v is not None}


def test_parse_metadata_checks_the_issuer_and_endpoints() -> None:
    iss = "https://idp.example.test"
    meta = oidc.parse_metadata(_doc(iss), iss)
    assert meta.token_endpoint == f"{iss}/token"
    assert oidc.parse_metadata(_doc(iss + "/"), iss).issuer == iss  # trailing slash only
    with pytest.raises(oidc.OidcUnavailable, match="another issuer"):
        oidc.parse_metadata(_doc("https://evil.example"), iss)
    with pytest.raises(oidc.OidcUnavailable, match="https"):
        oidc.parse_metadata(_doc(iss, token_endpoint="http://idp.example.test/token"), iss)
    with pytest.raises(oidc.OidcUnavailable, match="no jwks_uri"):
        oidc.parse_metadata(_doc(iss, jwks_uri=None), iss)
    with pytest.raises(oidc.OidcUnavailable, match="S256"):
        oidc.parse_metadata(_doc(iss, code_challenge_methods_supported=["plain"]), iss)
    loop = "http://127.0.0.1:9"
    assert oidc.parse_metadata(_doc(loop), loop).jwks_uri == f"{loop}/jwks"


def test_token_auth_method_follows_discovery() -> None:
    iss = "https://idp.example.test"
    settings = _settings(iss)
    both = oidc.parse_metadata(_doc(iss), iss)
    post = oidc.parse_metadata(
        _doc(iss, token_endpoint_auth_methods_supported=["client_secret_post"]), iss
    )
    default = oidc.parse_metadata(_doc(iss, token_endpoint_auth_methods_supported=None), iss)
    jwt_only = oidc.parse_metadata(
        _doc(iss, token_endpoint_auth_methods_supported=["private_key_jwt"]), iss
    )
    assert oidc.token_auth_method(settings, both) == "client_secret_basic"
    assert oidc.token_auth_method(settings, post) == "client_secret_post"
    assert oidc.token_auth_method(settings, default) == "client_secret_basic"
    assert oidc.token_auth_method(replace(settings, client_secret=None), both) == "none"
    with pytest.raises(oidc.OidcUnavailable):
        oidc.token_auth_method(settings, jwt_only)


def test_pkce_s256_rfc7636_appendix_b() -> None:
    verifier = "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"
    assert oidc.code_challenge(verifier) == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
    fresh = oidc.new_code_verifier()
    assert 43 <= len(fresh) <= 128 and re.fullmatch(r"[A-Za-z0-9._~-]+", fresh)
    assert fresh != oidc.new_code_verifier()


def test_authorization_url_carries_the_whole_request() -> None:
    iss = "https://idp.example.test"
    meta = oidc.parse_metadata(_doc(iss, authorization_endpoint=f"{iss}/authorize?tenant=x"), iss)
    settings = _settings(iss)
    req = oidc.new_authorization_request(meta, settings)
    parts = urlsplit(req.url)
    assert f"{parts.scheme}://{parts.netloc}{parts.path}" == f"{iss}/authorize"
    q = {k: v[0] for k, v in parse_qs(parts.query).items()}
    expected_challenge = (
        base64.urlsafe_b64encode(hashlib.sha256(req.code_verifier.encode()).digest())
        .rstrip(b"=")
        .decode()
    )
    assert q == {
        "tenant": "x",
        "response_type": "code",
        "client_id": CLIENT_ID,
        "redirect_uri": settings.redirect_uri,
        "scope": "openid profile email groups",
        "state": req.state,
        "nonce": req.nonce,
        "code_challenge": expected_challenge,
        "code_challenge_method": "S256",
    }
    assert len(req.state) <= 64 and len(req.nonce) <= 64 and len(req.code_verifier) <= 128
    other = oidc.new_authorization_request(meta, settings)
    assert {other.state, other.nonce, other.code_verifier}.isdisjoint(
        {req.state, req.nonce, req.code_verifier}
    )


# --- pure: ID-token validation with keys made here ---------------------------------------------

ISS = "https://idp.example.test"
NOW = 1_700_000_000
NONCE = "nonce-0123456789"
RSA = RSAKey.generate_key(2048, {"use": "sig", "alg": "RS256"}, auto_kid=True)
RSA_OTHER = RSAKey.generate_key(2048, {"use": "sig", "alg": "RS256"}, auto_kid=True)
EC = ECKey.generate_key("P-256", {"use": "sig", "alg": "ES256"}, auto_kid=True)


def public_set(*keys: Any) -> KeySet:
    return KeySet.import_key_set({"keys": [k.as_dict(private=False) for k in keys]})


KEYS = public_set(RSA, EC)


def claims_of(**over: Any) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "iss": ISS,
        "aud": CLIENT_ID,
        "sub": "user-1",
        "nonce": NONCE,
        "iat": NOW - 5,
        "exp": NOW + 300,
    }
    claims.update(over)
    return {k: v for k, v in claims.items() if v is not None}


def sign(claims: dict[str, Any], key: Any = RSA, alg: str = "RS256", kid: Any = "same") -> str:
    header: dict[str, Any] = {"alg": alg}
    kid = key.kid if kid == "same" else kid
    if kid is not None:
        header["kid"] = kid
    return jwt.encode(header, claims, key, algorithms=[alg])


def validate(token: str, keys: KeySet = KEYS, **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "issuer": ISS,
        "client_id": CLIENT_ID,
        "nonce": NONCE,
        "now": NOW,
    }
    kw.update(over)
    return oidc.validate_id_token(token, keys, **kw)


def test_a_good_id_token_passes() -> None:
    assert validate(sign(claims_of()))["sub"] == "user-1"
    assert validate(sign(claims_of(), EC, "ES256"))["sub"] == "user-1"
    assert validate(sign(claims_of(), kid=None), public_set(RSA))["sub"] == "user-1"
    assert validate(sign(claims_of(aud=[CLIENT_ID, "api"], azp=CLIENT_ID)))["sub"] == "user-1"
    assert validate(sign(claims_of(iss=ISS + "/")))["sub"] == "user-1"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"nonce": "nonce-of-another-login"}, "nonce does not match"),
        ({"nonce": None}, "nonce does not match"),
        ({"aud": "another-client"}, "audience"),
        ({"aud": ["another-client", "api"]}, "audience"),
        ({"aud": None}, "audience"),
        ({"aud": [CLIENT_ID, "api"]}, "azp"),
        ({"azp": "another-client"}, "azp"),
        ({"iss": "https://evil.example"}, "issuer"),
        ({"iss": None}, "issuer"),
        ({"exp": NOW - 61}, "expired"),
        ({"exp": None}, "no expiry"),
        ({"exp": True}, "no expiry"),
        ({"iat": NOW + 61}, "future"),
        ({"iat": None}, "no issue time"),
        ({"nbf": NOW + 61}, "not valid yet"),
        ({"sub": ""}, "subject"),
        ({"sub": None}, "subject"),
    ],
)
def test_id_token_claim_checks(over: dict[str, Any], message: str) -> None:
    token = sign(claims_of(**over))
    with pytest.raises(oidc.OidcFailed, match=message) as err:
        validate(token)
    assert status_for(err.value) == 401 and err.value.code == "oidc_failed"
    assert token not in str(err.value.to_dict())


def test_clock_skew_leeway_is_small() -> None:
    assert validate(sign(claims_of(exp=NOW - 59, iat=NOW - 600)))["sub"] == "user-1"
    assert validate(sign(claims_of(iat=NOW + 59, nbf=NOW + 59)))["sub"] == "user-1"
    with pytest.raises(oidc.OidcFailed, match="expired"):
        validate(sign(claims_of(exp=NOW - 59)), leeway=0)


def test_wrong_nonce_and_wrong_audience_are_refused_even_when_signed() -> None:
    good = sign(claims_of())
    with pytest.raises(oidc.OidcFailed, match="nonce"):
        validate(good, nonce="the-nonce-stored-for-this-state")
    with pytest.raises(oidc.OidcFailed, match="audience"):
        validate(good, client_id="another-client")
    with pytest.raises(oidc.OidcFailed, match="issuer"):
        validate(good, issuer="https://other-idp.example.test")


def test_signature_must_verify_against_the_jwks() -> None:
    # another key under the same kid: the signature does not verify
    forged = sign(claims_of(), RSA_OTHER, kid=RSA.kid)
    with pytest.raises(oidc.OidcFailed, match="signature does not verify"):
        validate(forged)
    # a payload changed after signing
    head, payload, sig = sign(claims_of()).split(".")
    evil = json.loads(base64.urlsafe_b64decode(payload + "=="))
    evil["sub"] = "admin"
    evil_payload = base64.urlsafe_b64encode(json.dumps(evil).encode()).rstrip(b"=").decode()
    with pytest.raises(oidc.OidcFailed, match="signature does not verify"):
        validate(f"{head}.{evil_payload}.{sig}")
    # a key the JWKS does not have: UnknownSigningKey, so the caller refreshes the JWKS once
    with pytest.raises(oidc.UnknownSigningKey):
        validate(sign(claims_of(), RSA_OTHER))


def test_symmetric_and_unsigned_tokens_are_refused() -> None:
    secret = OctKey.import_key(CLIENT_SECRET.encode() * 2)
    hs = jwt.encode({"alg": "HS256"}, claims_of(), secret, algorithms=["HS256"])
    with pytest.raises(oidc.OidcFailed, match="algorithm 'HS256' is not accepted"):
        validate(hs)

    def b64(obj: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    with pytest.raises(oidc.OidcFailed, match="algorithm 'none' is not accepted"):
        validate(f"{b64({'alg': 'none'})}.{b64(claims_of())}.")
    with pytest.raises(oidc.OidcFailed, match="not a signed JWT"):
        validate("not-a-jwt")
    with pytest.raises(oidc.OidcFailed, match="well-formed"):
        validate("a.b.c")
    # only what the provider says it signs with
    with pytest.raises(oidc.OidcFailed, match="not accepted"):
        validate(sign(claims_of()), algorithms=["ES256"])


# --- HTTP parts against a scripted provider ----------------------------------------------------


@dataclass
class FakeIdp:
    """A provider scripted in Python (httpx.MockTransport), for the HTTP edge cases."""

    issuer: str
    key: Any = field(default_factory=lambda: RSA)
    id_claims: dict[str, Any] = field(default_factory=dict)
    userinfo: dict[str, Any] | None = None
    auth_methods: list[str] = field(default_factory=lambda: ["client_secret_basic"])
    token_status: int = 200
    jwks_keys: list[Any] = field(default_factory=lambda: [RSA])
    calls: list[str] = field(default_factory=list)
    token_requests: list[httpx.Request] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        if path == "/.well-known/openid-configuration":
            return httpx.Response(
                200, json=_doc(self.issuer, token_endpoint_auth_methods_supported=self.auth_methods)
            )
        if path == "/jwks":
            return httpx.Response(
                200, json={"keys": [k.as_dict(private=False) for k in self.jwks_keys]}
            )
        if path == "/token":
            self.token_requests.append(request)
            if self.token_status != 200:
                return httpx.Response(
                    self.token_status,
                    json={
                        "error": "invalid_grant",
                        "error_description": "grant request is invalid",
                    },
                )
            claims = claims_of(iss=self.issuer, iat=int(time.time()), exp=int(time.time()) + 300)
            claims.update(self.id_claims)
            token = sign({k: v for k, v in claims.items() if v is not None}, self.key)
            return httpx.Response(
                200, json={"access_token": "at-1", "token_type": "Bearer", "id_token": token}
            )
        if path == "/me":
            assert request.headers["authorization"] == "Bearer at-1"
            return httpx.Response(200, json=self.userinfo or {})
        return httpx.Response(404)

    def login(self, **over: Any) -> oidc.FederatedIdentity:
        settings = _settings(self.issuer, group_map=GROUP_MAP, **over)
        with httpx.Client(transport=httpx.MockTransport(self.handler)) as http:
            return oidc.complete_login(
                settings, code="code-1", code_verifier="v" * 43, nonce=NONCE, http=http
            )


def test_claims_in_the_id_token_need_no_userinfo() -> None:
    idp = FakeIdp(
        "https://a.idp.example.test",
        id_claims={"preferred_username": "Alice", "groups": ["pp-admins"]},
    )
    ident = idp.login()
    assert (ident.username, ident.roles) == ("alice", ("admin",))
    assert "/me" not in idp.calls
    form = parse_qs(idp.token_requests[0].content.decode())
    assert form["grant_type"] == ["authorization_code"]
    assert form["code_verifier"] == ["v" * 43]
    assert "client_secret" not in form
    scheme, _, value = idp.token_requests[0].headers["authorization"].partition(" ")
    user, _, secret = base64.b64decode(value).decode().partition(":")
    assert scheme == "Basic"
    assert unquote_plus(user) == CLIENT_ID and unquote_plus(secret) == CLIENT_SECRET
    assert secret != CLIENT_SECRET  # form-urlencoded before encoding (RFC 6749 §2.3.1)


def test_client_secret_post_when_that_is_all_the_provider_takes() -> None:
    idp = FakeIdp(
        "https://b.idp.example.test",
        auth_methods=["client_secret_post"],
        id_claims={"preferred_username": "bob", "groups": []},
    )
    idp.login()
    request = idp.token_requests[0]
    form = parse_qs(request.content.decode())
    assert form["client_id"] == [CLIENT_ID] and form["client_secret"] == [CLIENT_SECRET]
    assert "authorization" not in request.headers


def test_groups_from_userinfo_when_the_id_token_lacks_them() -> None:
    idp = FakeIdp(
        "https://c.idp.example.test",
        userinfo={"sub": "user-1", "preferred_username": "Carol", "groups": ["auditors"]},
    )
    ident = idp.login()
    assert (ident.username, ident.roles) == ("carol", ("auditor",))
    assert "/me" in idp.calls


def test_userinfo_about_another_subject_is_refused() -> None:
    idp = FakeIdp(
        "https://d.idp.example.test", userinfo={"sub": "someone-else", "groups": ["pp-admins"]}
    )
    with pytest.raises(oidc.OidcFailed, match="userinfo describes another subject"):
        idp.login()


def test_a_rotated_key_is_fetched_once() -> None:
    idp = FakeIdp("https://e.idp.example.test", id_claims={"groups": [], "preferred_username": "e"})
    idp.login()
    assert idp.calls.count("/jwks") == 1
    idp.key, idp.jwks_keys = RSA_OTHER, [RSA_OTHER]  # the provider rotates its key
    idp.login()
    assert idp.calls.count("/jwks") == 2
    idp.key = RSAKey.generate_key(2048, {"use": "sig"}, auto_kid=True)  # never published
    with pytest.raises(oidc.OidcFailed, match="no key in the provider's JWKS"):
        idp.login()


def test_token_endpoint_errors_are_named_without_tokens() -> None:
    idp = FakeIdp("https://f.idp.example.test", token_status=400)
    with pytest.raises(oidc.OidcFailed, match="token exchange failed: invalid_grant") as err:
        idp.login()
    assert err.value.reason == "token_exchange"


def test_a_wrong_nonce_from_the_provider_is_refused() -> None:
    idp = FakeIdp("https://g.idp.example.test", id_claims={"nonce": "replayed-nonce"})
    with pytest.raises(oidc.OidcFailed, match="nonce"):
        idp.login()


# --- routes without a provider ------------------------------------------------------------------


def test_not_configured_is_404(client: TestClient) -> None:
    for path in (f"{API}/auth/oidc/login", f"{API}/auth/oidc/callback?code=x&state=y"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "oidc_not_configured"


@pytest.fixture
def offline(store: Store) -> Iterator[TestClient]:
    """The API with OIDC configured for a provider that is never contacted."""
    settings = Settings(oidc=_settings("https://idp.invalid"))
    with TestClient(create_app(store, settings), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize(
    "target",
    [
        "//evil.example",
        "//evil.example/path",
        "https://evil.example",
        "http://evil.example/",
        "javascript:alert(1)",
        "evil.example",
        "/\\evil.example",
        "/\t/evil.example",
    ],
)
def test_return_to_must_be_a_local_path(offline: TestClient, target: str) -> None:
    r = offline.get(f"{API}/auth/oidc/login", params={"return_to": target}, follow_redirects=False)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_return_to"


def test_provider_error_in_the_callback(offline: TestClient, store: Store) -> None:
    r = offline.get(
        f"{API}/auth/oidc/callback",
        params={"error": "access_denied", "error_description": "End-User aborted", "state": "s"},
    )
    assert r.status_code == 400
    body = r.json()["error"]
    assert body["code"] == "oidc_error"
    assert "access_denied" in body["message"] and "End-User aborted" in body["message"]
    assert failures(store)[-1].details == {
        "method": "oidc",
        "reason": "provider_error",
        "issuer": "https://idp.invalid",
        "error": "access_denied",
    }


def test_unknown_state_without_a_provider(offline: TestClient, store: Store) -> None:
    for params in ({"code": "c", "state": "never-issued"}, {"code": "c"}):
        r = offline.get(f"{API}/auth/oidc/callback", params=params)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_oidc_state"
    assert [e.details["reason"] for e in failures(store)] == ["invalid_state", "invalid_state"]


# --- the real provider ---------------------------------------------------------------------------


def _settings(issuer: str, **over: Any) -> OidcSettings:
    base = OidcSettings(
        issuer=issuer,
        client_id=CLIENT_ID,
        client_secret=CLIENT_SECRET,
        redirect_uri="http://127.0.0.1:9/api/v1/auth/oidc/callback",
    )
    return replace(base, **over)


def _need(reason: str) -> None:
    unavailable(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Provider:
    issuer: str
    app_base: str

    @property
    def redirect_uri(self) -> str:
        return f"{self.app_base}{API}/auth/oidc/callback"


@pytest.fixture(scope="session")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    """``node tests/oidc/provider.mjs`` on a free loopback port, for the whole session."""
    node = shutil.which("node")
    if node is None:
        _need(
            "node is not installed: the SSO tests run a real OIDC provider (scripts/test-deps.sh)"
        )
    if not (OIDC_DIR / "node_modules" / "oidc-provider").is_dir():
        _need("tests/oidc/node_modules is missing: run scripts/test-deps.sh (npm ci in tests/oidc)")
    port, app_port = _free_port(), _free_port()
    found = Provider(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{app_port}")
    log_path = tmp_path_factory.mktemp("oidc-provider") / "provider.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                str(node),
                str(OIDC_DIR / "provider.mjs"),
                "--port",
                str(port),
                "--client-id",
                CLIENT_ID,
                "--client-secret",
                CLIENT_SECRET,
                "--redirect-uri",
                found.redirect_uri,
            ],
            cwd=OIDC_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the OIDC provider exited ({proc.returncode}):\n{log_path.read_text()}"
                )
            try:
                if httpx.get(
                    f"{found.issuer}/.well-known/openid-configuration", timeout=1
                ).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the OIDC provider did not answer in 30 s:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield found
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Switch:
    """The ASGI app the loopback server serves: each test plugs in its own application."""

    app: Callable[..., Any] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert self.app is not None, "no application plugged in"
        await self.app(scope, receive, send)


@pytest.fixture(scope="session")
def app_server(provider: Provider) -> Iterator[_Switch]:
    """A real uvicorn server on the port the provider redirects to (the redirect_uri)."""
    switch = _Switch()
    port = urlsplit(provider.app_base).port
    assert port is not None
    server = uvicorn.Server(
        uvicorn.Config(switch, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield switch
    server.should_exit = True
    thread.join(timeout=10)


@dataclass
class Sso:
    base: str
    callback: str
    store: Store
    settings: Settings


@pytest.fixture
def sso(store: Store, provider: Provider, app_server: _Switch) -> Iterator[Sso]:
    """Our API, configured for the real provider, served on the redirect_uri's port."""
    settings = Settings(
        cookie_secure=False,  # plain http on loopback; Secure is tested where it is set
        session_ttl=timedelta(minutes=30),
        oidc=_settings(provider.issuer, redirect_uri=provider.redirect_uri, group_map=GROUP_MAP),
    )
    app_server.app = create_app(store, settings)
    yield Sso(provider.app_base, provider.redirect_uri, store, settings)
    app_server.app = None


def reconfigure(sso: Sso, app_server: _Switch, **over: Any) -> None:
    assert sso.settings.oidc is not None
    sso.settings = replace(sso.settings, oidc=replace(sso.settings.oidc, **over))
    app_server.app = create_app(sso.store, sso.settings)


_FORM = re.compile(r'<form[^>]*\baction="([^"]+)"[^>]*>(.*?)</form>', re.S)
_HIDDEN = re.compile(r'<input type="hidden" name="([^"]+)" value="([^"]*)"')


def _follow(browser: httpx.Client, response: httpx.Response, stop: str) -> httpx.Response:
    """Follow redirects like a browser, but stop before one to ``stop`` (our callback)."""
    for _ in range(20):
        if response.status_code not in (301, 302, 303, 307, 308):
            return response
        target = urljoin(str(response.url), response.headers["location"])
        if target.startswith(stop):
            return response
        response = browser.get(target)
    raise AssertionError("too many redirects")


def _submit(browser: httpx.Client, page: httpx.Response, **fields: str) -> httpx.Response:
    """POST the page's form: its action and hidden inputs, plus ``fields``."""
    assert page.status_code == 200, page.text
    match = _FORM.search(page.text)
    assert match, f"no form on the provider's page:\n{page.text[:2000]}"
    data = {html.unescape(n): html.unescape(v) for n, v in _HIDDEN.findall(match.group(2))}
    data.update(fields)
    return browser.post(urljoin(str(page.url), html.unescape(match.group(1))), data=data)


def authorize(browser: httpx.Client, sso: Sso, account: str, return_to: str | None = None) -> str:
    """Our login → the provider's login page → its consent page → the callback URL the provider
    sends the browser to (returned, not visited)."""
    params = {"return_to": return_to} if return_to else None
    start = browser.get(f"{sso.base}{API}/auth/oidc/login", params=params)
    assert start.status_code == 302, start.text
    assert start.headers["location"].startswith(sso.settings.oidc.issuer)  # type: ignore[union-attr]
    page = _follow(browser, start, sso.callback)
    assert 'name="prompt" value="login"' in page.text, page.text[:2000]
    page = _follow(
        browser, _submit(browser, page, login=account, password="anything"), sso.callback
    )
    if 'name="prompt" value="consent"' in page.text:
        page = _follow(browser, _submit(browser, page), sso.callback)
    assert page.status_code in (302, 303), page.text[:2000]
    target = urljoin(str(page.url), page.headers["location"])
    assert target.startswith(sso.callback + "?"), target
    return target


def browser() -> httpx.Client:
    """A cookie-keeping client that does not follow redirects on its own."""
    return httpx.Client(follow_redirects=False, timeout=15)


def sign_in(
    b: httpx.Client, sso: Sso, account: str, return_to: str | None = None
) -> httpx.Response:
    """The whole SSO login in browser ``b``; returns our callback's answer."""
    return b.get(authorize(b, sso, account, return_to))


def failures(store: Store) -> list[EventRow]:
    with store.read() as session:
        return list(
            session.scalars(
                select(EventRow)
                .where(EventRow.action == "auth.login", EventRow.outcome == "failure")
                .order_by(EventRow.seq)
            )
        )


def logins(store: Store) -> list[EventRow]:
    with store.read() as session:
        return list(
            session.scalars(
                select(EventRow)
                .where(EventRow.action == "auth.login", EventRow.outcome == "success")
                .order_by(EventRow.seq)
            )
        )


def test_alice_signs_in_through_the_real_provider(sso: Sso, provider: Provider) -> None:
    with browser() as b:
        done = sign_in(b, sso, "alice", return_to="/ui/nodes?view=all")
        assert done.status_code == 303, done.text
        assert done.headers["location"] == "/ui/nodes?view=all"
        cookies = {c.split("=", 1)[0]: c for c in done.headers.get_list("set-cookie")}
        session_cookie = cookies["proofplane_session"]
        assert "HttpOnly" in session_cookie and "samesite=strict" in session_cookie.lower()
        assert "Path=/" in session_cookie
        assert "HttpOnly" not in cookies["proofplane_csrf"]
        me = b.get(f"{sso.base}{API}/auth/me")
        assert me.status_code == 200, me.text
        assert me.json()["username"] == "alice"
        assert me.json()["roles"] == ["admin"]
        assert b.get(f"{sso.base}{API}/nodes").status_code == 200
        # the session cookie works like a password login's: changes need the CSRF token
        assert b.post(f"{sso.base}{API}/auth/logout").status_code == 403
        csrf = b.cookies["proofplane_csrf"]
        out = b.post(f"{sso.base}{API}/auth/logout", headers={"x-csrf-token": csrf})
        assert out.status_code == 204
    with sso.store.read() as session:
        user = session.scalar(select(UserRow).where(UserRow.username == "alice"))
        assert user is not None
        assert (user.source, user.roles, user.external_subject) == (
            "oidc",
            ["admin"],
            f"{provider.issuer}#alice",
        )
        assert user.password_hash is None
        assert session.scalar(select(OidcLoginRow)) is None  # the state was used up
    [event] = logins(sso.store)
    assert event.target_id == "alice"
    assert event.details["method"] == "oidc" and event.details["issuer"] == provider.issuer
    # a second login finds the same user (keyed on issuer + sub), no second account
    with browser() as b:
        again = sign_in(b, sso, "alice")
    assert again.status_code == 303 and again.headers["location"] == "/"
    with sso.store.read() as session:
        assert len(list(session.scalars(select(UserRow).where(UserRow.source == "oidc")))) == 1
    assert len(logins(sso.store)) == 2


def test_bob_sees_only_his_tenant(sso: Sso, client: TestClient) -> None:
    for name in ("clinic", "other"):
        assert client.post(f"{API}/tenants", json={"name": name}).status_code == 201
    with browser() as b:
        done = sign_in(b, sso, "bob")
        assert done.status_code == 303, done.text
        me = b.get(f"{sso.base}{API}/auth/me").json()
        assert (me["roles"], me["tenants"]) == (["developer"], ["clinic"])
        listed = b.get(f"{sso.base}{API}/tenants").json()["items"]
        assert [t["name"] for t in listed] == ["clinic"]
        assert b.get(f"{sso.base}{API}/tenants/other").status_code == 404
        assert b.get(f"{sso.base}{API}/tenants/clinic").status_code == 200


def test_groups_are_united(sso: Sso, client: TestClient) -> None:
    assert client.post(f"{API}/tenants", json={"name": "clinic"}).status_code == 201
    with browser() as b:
        done = sign_in(b, sso, "dave")  # clinic-devs + auditors + unmapped
        assert done.status_code == 303, done.text
        me = b.get(f"{sso.base}{API}/auth/me").json()
        assert (me["roles"], me["tenants"]) == (["auditor", "developer"], ["clinic"])


def test_carol_in_an_unmapped_group_signs_in_with_no_roles(sso: Sso) -> None:
    with browser() as b:
        done = sign_in(b, sso, "carol")
        assert done.status_code == 303, done.text
        me = b.get(f"{sso.base}{API}/auth/me").json()
        assert (me["username"], me["roles"], me["tenants"]) == ("carol", [], [])
        nodes = b.get(f"{sso.base}{API}/nodes")
        assert nodes.status_code == 403 and nodes.json()["error"]["code"] == "forbidden"


def test_a_callback_works_once(sso: Sso) -> None:
    with browser() as b:
        callback = authorize(b, sso, "alice")
        assert b.get(callback).status_code == 303
        replay = b.get(callback)
        assert replay.status_code == 400
        assert replay.json()["error"]["code"] == "invalid_oidc_state"
        assert "set-cookie" not in replay.headers
    assert [e.details["reason"] for e in failures(sso.store)] == ["invalid_state"]


def test_a_tampered_state_is_refused_and_the_real_one_still_works(sso: Sso) -> None:
    with browser() as b:
        callback = authorize(b, sso, "alice")
        query = parse_qs(urlsplit(callback).query)
        state = query["state"][0]
        forged = {k: v[0] for k, v in query.items()} | {
            "state": state[:-1] + ("A" if state[-1] != "A" else "B")
        }
        bad = b.get(f"{sso.callback}?{urlencode(forged)}")
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_oidc_state"
        assert b.get(callback).status_code == 303


def test_an_expired_state_is_refused(sso: Sso) -> None:
    with browser() as b:
        callback = authorize(b, sso, "alice")
        state = parse_qs(urlsplit(callback).query)["state"][0]
        with sso.store.write(SYSTEM) as tx:
            row = tx.session.get(OidcLoginRow, state)
            assert row is not None
            assert timedelta(minutes=9) < row.expires_at - tx.now <= timedelta(minutes=10)
            row.expires_at = tx.now - timedelta(seconds=1)
        r = b.get(callback)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_oidc_state"
    with sso.store.read() as session:
        assert session.get(OidcLoginRow, state) is None


def _tamper(sso: Sso, callback: str, **values: str) -> None:
    state = parse_qs(urlsplit(callback).query)["state"][0]
    with sso.store.write(SYSTEM) as tx:
        row = tx.session.get(OidcLoginRow, state)
        assert row is not None
        kms = keys_svc.kms_for(sso.store)
        for name, value in values.items():
            # stored sealed for this row (issue 13): a valid ciphertext of another value
            aad = keys_svc.secret_aad("oidc_logins", state, name)
            setattr(row, name, keys_svc.seal_secret(kms, tx, value, aad))


@pytest.mark.parametrize(
    ("tamper", "message", "reason"),
    [
        # PKCE: the provider refuses a code redeemed with another verifier
        ({"code_verifier": "x" * 64}, "token exchange failed: invalid_grant", "token_exchange"),
        # the ID token carries the nonce sent at login, not the one now stored
        ({"nonce": "not-the-nonce-sent"}, "nonce does not match", "id_token"),
    ],
)
def test_pkce_and_nonce_are_enforced_end_to_end(
    sso: Sso, tamper: dict[str, str], message: str, reason: str
) -> None:
    with browser() as b:
        callback = authorize(b, sso, "alice")
        _tamper(sso, callback, **tamper)
        r = b.get(callback)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["code"] == "oidc_failed" and message in err["message"]
        assert "set-cookie" not in r.headers
    [failure] = failures(sso.store)
    assert failure.details["method"] == "oidc" and failure.details["reason"] == reason
    assert logins(sso.store) == []


def test_a_forged_code_or_issuer_fails(sso: Sso) -> None:
    with browser() as b:
        callback = authorize(b, sso, "alice")
        query = {k: v[0] for k, v in parse_qs(urlsplit(callback).query).items()}
        r = b.get(f"{sso.callback}?{urlencode(query | {'code': 'forged-code'})}")
        assert r.status_code == 401 and "token exchange failed" in r.json()["error"]["message"]
    with browser() as b:
        callback = authorize(b, sso, "alice")
        query = {k: v[0] for k, v in parse_qs(urlsplit(callback).query).items()}
        assert query["iss"] == sso.settings.oidc.issuer  # type: ignore[union-attr]
        r = b.get(f"{sso.callback}?{urlencode(query | {'iss': 'https://evil.example'})}")
        assert r.status_code == 401 and "another issuer" in r.json()["error"]["message"]
    assert [e.details["reason"] for e in failures(sso.store)] == [
        "token_exchange",
        "issuer_mismatch",
    ]


def test_a_wrong_client_secret_fails_the_exchange(sso: Sso, app_server: _Switch) -> None:
    reconfigure(sso, app_server, client_secret="not-the-secret")
    with browser() as b:
        r = b.get(authorize(b, sso, "alice"))
        assert r.status_code == 401
        assert r.json()["error"]["message"].startswith("token exchange failed: invalid_client")
        assert "not-the-secret" not in r.text


def test_cancelling_at_the_provider_is_an_oidc_error(sso: Sso) -> None:
    with browser() as b:
        page = _follow(b, b.get(f"{sso.base}{API}/auth/oidc/login"), sso.callback)
        abort = re.search(r'href="([^"]*/abort)"', page.text)
        assert abort, page.text[:2000]
        back = _follow(b, b.get(urljoin(str(page.url), abort.group(1))), sso.callback)
        r = b.get(urljoin(str(back.url), back.headers["location"]))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "oidc_error"
        assert "access_denied" in r.json()["error"]["message"]
    [failure] = failures(sso.store)
    assert failure.details["reason"] == "provider_error"
    with sso.store.read() as session:
        assert session.scalar(select(OidcLoginRow)) is None  # that state is used up too


def test_login_redirect_and_stored_request(sso: Sso) -> None:
    r = httpx.get(f"{sso.base}{API}/auth/oidc/login", params={"return_to": "/x"})
    assert r.status_code == 302 and r.headers["cache-control"] == "no-store"
    q = {k: v[0] for k, v in parse_qs(urlsplit(r.headers["location"]).query).items()}
    with sso.store.read() as session:
        row = session.get(OidcLoginRow, q["state"])
        assert row is not None
        kms = keys_svc.kms_for(sso.store)

        def opened(column: str) -> str:
            aad = keys_svc.secret_aad("oidc_logins", q["state"], column)
            stored = getattr(row, column)
            assert stored.startswith("ppk1.secrets.")  # sealed at rest (issue 13)
            return keys_svc.open_secret(kms, session, stored, aad)

        assert (opened("nonce"), row.return_to) == (q["nonce"], "/x")
        verifier = opened("code_verifier")
        assert oidc.code_challenge(verifier) == q["code_challenge"]
        assert verifier not in r.headers["location"]


def test_a_disabled_user_cannot_sign_in(sso: Sso, client: TestClient) -> None:
    with browser() as b:
        assert sign_in(b, sso, "carol").status_code == 303
    assert client.patch(f"{API}/users/carol", json={"disabled": True}).status_code == 200
    with browser() as b:
        r = sign_in(b, sso, "carol")
        assert r.status_code == 401 and "set-cookie" not in r.headers
    assert failures(sso.store)[-1].details == {
        "method": "oidc",
        "reason": "disabled",
        "source_ip": "127.0.0.1",  # the browser's
    }


def test_sso_cannot_take_over_a_local_account(sso: Sso, client: TestClient) -> None:
    body = {"username": "bob", "password": "correct horse battery staple"}
    assert client.post(f"{API}/users", json=body).status_code == 201
    with browser() as b:
        r = sign_in(b, sso, "bob")
        assert r.status_code == 409, r.text
    assert failures(sso.store)[-1].details["reason"] == "conflict"
    with sso.store.read() as session:
        user = session.scalar(select(UserRow).where(UserRow.username == "bob"))
        assert user is not None and (user.source, user.external_subject) == ("local", None)


def test_a_bad_group_map_is_a_loud_configuration_error(sso: Sso, app_server: _Switch) -> None:
    reconfigure(sso, app_server, group_map={"pp-admins": {"roles": ["superuser"]}})
    with browser() as b:
        r = sign_in(b, sso, "alice")
        assert r.status_code == 500 and r.json()["error"]["code"] == "invalid_setting"
    assert failures(sso.store)[-1].details["reason"] == "invalid_setting"


# --- the SIEM sees where an SSO login came from (issue 21) -----------------------------------


def test_a_real_sso_login_and_logout_export_with_the_browsers_address(sso: Any) -> None:
    with browser() as b:
        done = sign_in(b, sso, "alice")
        assert done.status_code == 303, done.text
        csrf = b.cookies["proofplane_csrf"]
        out = b.post(f"{sso.base}{API}/auth/logout", headers={"x-csrf-token": csrf})
        assert out.status_code == 204
        replay = b.get(f"{sso.callback}?code=x&state=never-issued")
        assert replay.status_code == 400
    events = events_of(sso.store, "auth.login", "auth.logout")
    assert [(e.action, e.outcome) for e in events] == [
        ("auth.login", Outcome.SUCCESS),
        ("auth.logout", Outcome.SUCCESS),
        ("auth.login", Outcome.FAILURE),
    ]
    for event in events:
        assert event.details["source_ip"] == "127.0.0.1"  # uvicorn's client, on loopback
        out = valid_ocsf(event)
        assert out["src_endpoint"] == {"ip": "127.0.0.1"} and out["is_remote"] is False
        assert cef_source(event) == "127.0.0.1"
    login, _, failed = (valid_ocsf(e) for e in events)
    assert (login["auth_protocol_id"], login["auth_protocol"]) == (4, "OpenID")
    assert (failed["auth_protocol_id"], failed["status_detail"]) == (4, "invalid_state")
