"""OpenID Connect single sign-on: the authorization code flow with PKCE (S256).

Two halves, kept apart so that every security decision can be tested without a network:

* **Pure** (no I/O, no clock of their own): reading the provider's metadata
  (``parse_metadata``), PKCE and the authorization URL (``code_challenge``,
  ``authorization_url``), choosing the client authentication (``token_auth_method``),
  validating an ID token given the provider's keys and a time (``validate_id_token``), and
  turning claims into an identity (``username_from_claims``, ``groups_from_claims``,
  ``map_groups``, ``identity_from_claims``).
* **HTTP** (httpx): discovery and the provider's JWKS (both cached per process), the token
  exchange, the userinfo request, and ``complete_login``, which strings them together.

An ID token is accepted only when its signature verifies against a key from the provider's
JWKS (asymmetric algorithms only: never ``none``, never a shared secret), ``iss`` is the
configured issuer, ``aud`` contains our client id (and ``azp``, when there are other audiences,
is our client id), ``exp``/``iat``/``nbf`` hold with ``LEEWAY`` seconds of clock skew, and
``nonce`` is the one stored with this login's ``state``. The user is keyed on ``iss`` + ``sub``;
the username and groups are read from the ID token, or from the userinfo endpoint when the ID
token does not carry them (many providers put profile claims only there).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import threading
import time
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import quote_plus, urlencode, urlsplit

import httpx
from joserfc import jws, jwt
from joserfc.errors import BadSignatureError, JoseError
from joserfc.jwk import KeySet

from proofplane.access.roles import Role
from proofplane.config import OidcSettings
from proofplane.errors import ProofplaneError

LEEWAY = 60  # seconds of clock skew tolerated on exp, iat and nbf
DISCOVERY_TTL = 3600.0  # seconds a discovery document is reused
HTTP_TIMEOUT = 10.0
MAX_RESPONSE = 1_000_000  # bytes: a provider's JSON answers are small
# Asymmetric signature algorithms only: an HMAC ("HS256") ID token would be verified with the
# client secret, and "none" is no signature at all.
ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
    "Ed25519",
)
_KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}
_USERNAME = re.compile(r"[a-z0-9][a-z0-9._@-]{0,62}")
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


class OidcFailed(ProofplaneError):
    """The SSO login failed at the token exchange, the ID token, userinfo or the claims.

    ``reason`` is a short machine word for the event log; the message names what failed and
    never contains a token.
    """

    code = "oidc_failed"

    def __init__(self, message: str, *, reason: str, details: Any = None) -> None:
        super().__init__(message, details=details)
        self.reason = reason


class UnknownSigningKey(OidcFailed):
    """No key in the JWKS we hold matches the ID token: the provider may have rotated keys."""


class OidcUnavailable(ProofplaneError):
    """The provider's discovery document or keys cannot be fetched, or make no sense."""

    code = "oidc_provider_unavailable"


class OidcMisconfigured(ProofplaneError):
    """Our own OIDC settings are wrong (an unknown role in the group map)."""

    code = "invalid_setting"


# --- pure: provider metadata -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProviderMetadata:
    """What we use from ``{issuer}/.well-known/openid-configuration``."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str | None = None
    token_endpoint_auth_methods: tuple[str, ...] = ("client_secret_basic",)
    id_token_algorithms: tuple[str, ...] = ("RS256",)
    code_challenge_methods: tuple[str, ...] | None = None


def same_issuer(a: str, b: str) -> bool:
    """Issuers compare exactly, except for a trailing slash (the configuration strips it)."""
    return a.rstrip("/") == b.rstrip("/")


def check_endpoint(url: str, what: str) -> str:
    """An endpoint must be https; plain http is accepted only on loopback (tests, dev)."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or not parts.hostname:
        raise OidcUnavailable(f"OIDC {what} is not a URL", details={what: url})
    if parts.scheme == "https" or (parts.scheme == "http" and parts.hostname in _LOOPBACK):
        return url
    raise OidcUnavailable(
        f"OIDC {what} must use https (http only on loopback)", details={what: url}
    )


def _strings(value: Any, default: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if value is None:
        return default
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise OidcUnavailable("OIDC discovery document has a malformed list")
    return tuple(value)


def parse_metadata(doc: Any, issuer: str) -> ProviderMetadata:
    """Check a discovery document against the configured issuer and pick out what we need."""
    if not isinstance(doc, dict):
        raise OidcUnavailable("OIDC discovery document is not a JSON object")
    if not isinstance(doc.get("issuer"), str) or not same_issuer(doc["issuer"], issuer):
        raise OidcUnavailable(
            "OIDC discovery document names another issuer",
            details={"configured": issuer, "discovered": doc.get("issuer")},
        )
    for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
        if not isinstance(doc.get(name), str):
            raise OidcUnavailable(f"OIDC discovery document has no {name}")
        check_endpoint(doc[name], name)
    userinfo = doc.get("userinfo_endpoint")
    if userinfo is not None:
        if not isinstance(userinfo, str):
            raise OidcUnavailable("OIDC discovery document has a malformed userinfo_endpoint")
        check_endpoint(userinfo, "userinfo_endpoint")
    challenge_methods = _strings(doc.get("code_challenge_methods_supported"), None)
    if challenge_methods is not None and "S256" not in challenge_methods:
        raise OidcUnavailable("the OIDC provider does not support PKCE with S256")
    return ProviderMetadata(
        issuer=issuer,
        authorization_endpoint=doc["authorization_endpoint"],
        token_endpoint=doc["token_endpoint"],
        jwks_uri=doc["jwks_uri"],
        userinfo_endpoint=userinfo,
        token_endpoint_auth_methods=_strings(  # type: ignore[arg-type]
            doc.get("token_endpoint_auth_methods_supported"), ("client_secret_basic",)
        ),
        id_token_algorithms=_strings(  # type: ignore[arg-type]
            doc.get("id_token_signing_alg_values_supported"), ("RS256",)
        ),
        code_challenge_methods=challenge_methods,
    )


def token_auth_method(settings: OidcSettings, metadata: ProviderMetadata) -> str:
    """How we authenticate at the token endpoint: ``client_secret_basic`` when the provider
    takes it, else ``client_secret_post``; ``none`` (PKCE only) without a client secret."""
    if settings.client_secret is None:
        return "none"
    for method in ("client_secret_basic", "client_secret_post"):
        if method in metadata.token_endpoint_auth_methods:
            return method
    raise OidcUnavailable(
        "the OIDC provider supports neither client_secret_basic nor client_secret_post",
        details={"supported": list(metadata.token_endpoint_auth_methods)},
    )


# --- pure: the authorization request -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuthorizationRequest:
    """One login in flight: what is stored under ``state``, and where the browser goes."""

    state: str
    nonce: str
    code_verifier: str
    url: str


def new_code_verifier() -> str:
    """RFC 7636 §4.1: 43 to 128 characters of [A-Za-z0-9-._~]; 86 here (64 random bytes)."""
    return secrets.token_urlsafe(64)


def code_challenge(verifier: str) -> str:
    """RFC 7636 §4.2, S256: BASE64URL(SHA256(ASCII(code_verifier))), without padding."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def authorization_url(
    metadata: ProviderMetadata,
    settings: OidcSettings,
    *,
    state: str,
    nonce: str,
    code_verifier: str,
) -> str:
    """The provider's authorization endpoint with our request in its query."""
    query = urlencode(
        {
            "response_type": "code",
            "client_id": settings.client_id,
            "redirect_uri": settings.redirect_uri,
            "scope": " ".join(settings.scopes),
            "state": state,
            "nonce": nonce,
            "code_challenge": code_challenge(code_verifier),
            "code_challenge_method": "S256",
        }
    )
    endpoint = metadata.authorization_endpoint
    return f"{endpoint}{'&' if urlsplit(endpoint).query else '?'}{query}"


def new_authorization_request(
    metadata: ProviderMetadata, settings: OidcSettings
) -> AuthorizationRequest:
    """Fresh random ``state``, ``nonce`` and PKCE verifier, and the URL that carries them."""
    state, nonce = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    verifier = new_code_verifier()
    url = authorization_url(metadata, settings, state=state, nonce=nonce, code_verifier=verifier)
    return AuthorizationRequest(state, nonce, verifier, url)


# --- pure: the ID token ------------------------------------------------------------------------


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _candidate_keys(keys: KeySet, header: Mapping[str, Any]) -> list[Any]:
    alg, kid = header.get("alg", ""), header.get("kid")
    kty = _KEY_TYPES.get(alg[:2], "")
    out = []
    for key in keys.keys:
        if key.key_type != kty or key.get("use") not in (None, "sig"):
            continue
        if key.get("alg") not in (None, alg):
            continue
        if kid is not None and key.kid != kid:
            continue
        out.append(key)
    return out


def validate_id_token(
    id_token: str,
    keys: KeySet,
    *,
    issuer: str,
    client_id: str,
    nonce: str,
    now: float,
    leeway: int = LEEWAY,
    algorithms: Iterable[str] = ALGORITHMS,
) -> dict[str, Any]:
    """The ID token's claims, once its signature, issuer, audience, times and nonce hold.

    ``now`` is a UNIX time. Raises ``OidcFailed`` naming the first check that failed, or
    ``UnknownSigningKey`` when no key in ``keys`` can have signed it (refresh the JWKS once).
    """
    if not isinstance(id_token, str) or id_token.count(".") != 2:
        raise OidcFailed("the ID token is not a signed JWT (JWS compact form)", reason="id_token")
    try:
        header = jws.extract_compact(id_token.encode("ascii")).headers()
    except (JoseError, ValueError, UnicodeError) as exc:
        raise OidcFailed("the ID token is not a well-formed JWT", reason="id_token") from exc
    alg = header.get("alg")
    allowed = set(algorithms) & set(ALGORITHMS)
    if not isinstance(alg, str) or alg not in allowed:
        raise OidcFailed(
            f"the ID token's signature algorithm {alg!r} is not accepted",
            reason="id_token",
            details={"accepted": sorted(allowed)},
        )
    candidates = _candidate_keys(keys, header)
    if not candidates:
        raise UnknownSigningKey(
            "no key in the provider's JWKS matches the ID token's signature "
            f"(kid {header.get('kid')!r}, alg {alg})",
            reason="id_token",
        )
    claims: dict[str, Any] | None = None
    for key in candidates:
        try:
            claims = jwt.decode(id_token, key, algorithms=[alg]).claims
            break
        except BadSignatureError:
            continue
        except JoseError as exc:
            raise OidcFailed(
                f"the ID token cannot be verified: {exc.error}", reason="id_token"
            ) from exc
    if claims is None:
        raise OidcFailed(
            "the ID token's signature does not verify against the provider's keys",
            reason="id_token",
        )
    check_id_token_claims(
        claims, issuer=issuer, client_id=client_id, nonce=nonce, now=now, leeway=leeway
    )
    return claims


def check_id_token_claims(
    claims: Mapping[str, Any],
    *,
    issuer: str,
    client_id: str,
    nonce: str,
    now: float,
    leeway: int = LEEWAY,
) -> None:
    """OpenID Connect Core §3.1.3.7 on verified claims (the signature is checked before)."""

    def fail(what: str) -> OidcFailed:
        return OidcFailed(f"ID token rejected: {what}", reason="id_token")

    iss = claims.get("iss")
    if not isinstance(iss, str) or not same_issuer(iss, issuer):
        raise fail(f"issuer {iss!r} is not the configured issuer {issuer!r}")
    aud = claims.get("aud")
    audiences = [aud] if isinstance(aud, str) else aud
    if not isinstance(audiences, list) or client_id not in audiences:
        raise fail("its audience (aud) does not include this client")
    azp = claims.get("azp")
    if azp is not None and azp != client_id:
        raise fail("it was issued to another party (azp)")
    if len(audiences) > 1 and azp is None:
        raise fail("it has several audiences and no authorized party (azp)")
    exp, iat, nbf = claims.get("exp"), claims.get("iat"), claims.get("nbf")
    if not _number(exp):
        raise fail("it has no expiry (exp)")
    if now > exp + leeway:
        raise fail("it has expired (exp)")
    if not _number(iat):
        raise fail("it has no issue time (iat)")
    if iat > now + leeway:
        raise fail("it was issued in the future (iat)")
    if nbf is not None and (not _number(nbf) or nbf > now + leeway):
        raise fail("it is not valid yet (nbf)")
    sent = claims.get("nonce")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), nonce.encode()):
        raise fail("its nonce does not match this login")
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub or len(sub) > 255:
        raise fail("it has no usable subject (sub)")


# --- pure: claims → identity -------------------------------------------------------------------


def normalize_username(value: Any) -> str | None:
    """A claim value as a proofplane username (``[a-z0-9][a-z0-9._@-]{0,62}``), or None.

    Lowercased, accents dropped (NFKD), every other character outside the alphabet becomes
    ``-``, leading punctuation goes, and the result is cut to 63 characters.
    """
    if not isinstance(value, str):
        return None
    text = unicodedata.normalize("NFKD", value.strip().lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = re.sub(r"[^a-z0-9._@-]+", "-", text)
    text = re.sub(r"^[^a-z0-9]+", "", text)[:63]
    return text if _USERNAME.fullmatch(text) else None


def username_from_claims(claims: Mapping[str, Any], username_claim: str) -> str:
    """The username claim, else the local part of ``email``, else ``sub``; normalized."""
    email = claims.get("email")
    local = email.rsplit("@", 1)[0] if isinstance(email, str) and "@" in email else None
    for candidate in (claims.get(username_claim), local, claims.get("sub")):
        name = normalize_username(candidate)
        if name is not None:
            return name
    raise OidcFailed(
        f"the provider sent no usable username ({username_claim}, email or sub)",
        reason="claims",
    )


def groups_from_claims(claims: Mapping[str, Any], groups_claim: str) -> list[str] | None:
    """The groups claim as a list of strings (one string counts as one group); None when the
    claim is absent. Entries that are not strings are ignored."""
    value = claims.get(groups_claim)
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [g for g in value if isinstance(g, str)]
    return []


def map_groups(
    groups: Iterable[str], group_map: Mapping[str, Mapping[str, list[str]]]
) -> tuple[list[str], list[str]]:
    """(roles, tenants): the union over the user's groups that ``group_map`` knows; groups it
    does not know are ignored. An unknown role in the map is a configuration error."""
    roles: set[str] = set()
    tenants: set[str] = set()
    known = {r.value for r in Role}
    for group in set(groups):
        entry = group_map.get(group)
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise OidcMisconfigured(
                f"PROOFPLANE_OIDC_GROUP_MAP[{group!r}] must be an object",
                details={"group": group},
            )
        for role in entry.get("roles", []):
            if role not in known:
                raise OidcMisconfigured(
                    f"PROOFPLANE_OIDC_GROUP_MAP[{group!r}] names the unknown role {role!r}",
                    details={"group": group, "role": role, "known": sorted(known)},
                )
            roles.add(role)
        tenants.update(t for t in entry.get("tenants", []) if isinstance(t, str))
    return sorted(roles), sorted(tenants)


@dataclass(frozen=True, slots=True)
class FederatedIdentity:
    """Who the provider vouched for, and what our group map makes of them."""

    subject: str
    username: str
    groups: tuple[str, ...]
    roles: tuple[str, ...]
    tenants: tuple[str, ...]


def identity_from_claims(claims: Mapping[str, Any], settings: OidcSettings) -> FederatedIdentity:
    groups = groups_from_claims(claims, settings.groups_claim) or []
    roles, tenants = map_groups(groups, settings.group_map)
    return FederatedIdentity(
        subject=claims["sub"],
        username=username_from_claims(claims, settings.username_claim),
        groups=tuple(sorted(set(groups))),
        roles=tuple(roles),
        tenants=tuple(tenants),
    )


# --- HTTP --------------------------------------------------------------------------------------

_lock = threading.Lock()
_discovered: dict[str, tuple[float, ProviderMetadata]] = {}
_keysets: dict[str, KeySet] = {}


def clear_caches() -> None:
    """Forget discovered metadata and keys (tests; a changed configuration)."""
    with _lock:
        _discovered.clear()
        _keysets.clear()


def _client(http: httpx.Client | None) -> httpx.Client:
    return http or httpx.Client(timeout=HTTP_TIMEOUT, follow_redirects=False)


def _json(response: httpx.Response) -> Any:
    if len(response.content) > MAX_RESPONSE:
        raise ValueError("response too large")
    return response.json()


def _get_json(url: str, what: str, http: httpx.Client | None) -> Any:
    client = _client(http)
    try:
        response = client.get(url, headers={"Accept": "application/json"})
        response.raise_for_status()
        return _json(response)
    except httpx.HTTPError as exc:
        raise OidcUnavailable(
            f"cannot fetch the OIDC {what}: {type(exc).__name__}", details={"url": url}
        ) from exc
    except ValueError as exc:
        raise OidcUnavailable(f"the OIDC {what} is not JSON", details={"url": url}) from exc
    finally:
        if http is None:
            client.close()


def discover(
    issuer: str, *, http: httpx.Client | None = None, refresh: bool = False
) -> ProviderMetadata:
    """The provider's metadata from ``{issuer}/.well-known/openid-configuration``, reused for
    ``DISCOVERY_TTL`` seconds."""
    check_endpoint(issuer, "issuer")
    with _lock:
        cached = _discovered.get(issuer)
    if cached is not None and not refresh and time.monotonic() - cached[0] < DISCOVERY_TTL:
        return cached[1]
    url = f"{issuer.rstrip('/')}/.well-known/openid-configuration"
    metadata = parse_metadata(_get_json(url, "discovery document", http), issuer)
    with _lock:
        _discovered[issuer] = (time.monotonic(), metadata)
    return metadata


def signing_keys(
    metadata: ProviderMetadata, *, http: httpx.Client | None = None, refresh: bool = False
) -> KeySet:
    """The provider's public keys (its JWKS), cached until a token names a key we lack."""
    with _lock:
        cached = _keysets.get(metadata.jwks_uri)
    if cached is not None and not refresh:
        return cached
    doc = _get_json(metadata.jwks_uri, "JWKS", http)
    try:
        keys = KeySet.import_key_set(
            {"keys": [k for k in doc["keys"] if isinstance(k, dict) and "d" not in k]}
        )
    except (JoseError, KeyError, TypeError, ValueError) as exc:
        raise OidcUnavailable(
            "the OIDC provider's JWKS is malformed", details={"url": metadata.jwks_uri}
        ) from exc
    with _lock:
        _keysets[metadata.jwks_uri] = keys
    return keys


def _provider_error(response: httpx.Response) -> str:
    try:
        body = _json(response)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        desc = body.get("error_description")
        text = body["error"] + (f": {desc}" if isinstance(desc, str) else "")
        return text[:300]
    return f"HTTP {response.status_code}"


def exchange_code(
    settings: OidcSettings,
    metadata: ProviderMetadata,
    *,
    code: str,
    code_verifier: str,
    http: httpx.Client | None = None,
) -> dict[str, Any]:
    """Trade the authorization code (and the PKCE verifier) for tokens at the token endpoint."""
    method = token_auth_method(settings, metadata)
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": settings.redirect_uri,
        "code_verifier": code_verifier,
    }
    headers = {"Accept": "application/json"}
    if method == "client_secret_basic":
        assert settings.client_secret is not None
        # RFC 6749 §2.3.1: both parts form-urlencoded before they are joined and encoded.
        pair = f"{quote_plus(settings.client_id)}:{quote_plus(settings.client_secret)}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    else:
        form["client_id"] = settings.client_id
        if method == "client_secret_post":
            assert settings.client_secret is not None
            form["client_secret"] = settings.client_secret
    client = _client(http)
    try:
        response = client.post(metadata.token_endpoint, data=form, headers=headers)
    except httpx.HTTPError as exc:
        raise OidcFailed(
            f"token exchange failed: the token endpoint is unreachable ({type(exc).__name__})",
            reason="token_exchange",
        ) from exc
    finally:
        if http is None:
            client.close()
    if response.status_code != 200:
        raise OidcFailed(
            f"token exchange failed: {_provider_error(response)}", reason="token_exchange"
        )
    try:
        tokens = _json(response)
    except ValueError as exc:
        raise OidcFailed(
            "token exchange failed: the token response is not JSON", reason="token_exchange"
        ) from exc
    if not isinstance(tokens, dict) or not isinstance(tokens.get("id_token"), str):
        raise OidcFailed(
            "token exchange failed: the token response has no id_token", reason="token_exchange"
        )
    return tokens


def fetch_userinfo(
    metadata: ProviderMetadata, access_token: str, *, http: httpx.Client | None = None
) -> dict[str, Any]:
    """The userinfo endpoint's claims (JSON answers only)."""
    assert metadata.userinfo_endpoint is not None
    client = _client(http)
    try:
        response = client.get(
            metadata.userinfo_endpoint,
            headers={"Authorization": f"Bearer {access_token}", "Accept": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise OidcFailed(
            f"userinfo request failed: the endpoint is unreachable ({type(exc).__name__})",
            reason="userinfo",
        ) from exc
    finally:
        if http is None:
            client.close()
    if response.status_code != 200:
        raise OidcFailed(f"userinfo request failed: {_provider_error(response)}", reason="userinfo")
    try:
        info = _json(response)
    except ValueError as exc:
        raise OidcFailed("userinfo response is not JSON", reason="userinfo") from exc
    if not isinstance(info, dict):
        raise OidcFailed("userinfo response is not a JSON object", reason="userinfo")
    return info


def complete_login(
    settings: OidcSettings,
    *,
    code: str,
    code_verifier: str,
    nonce: str,
    now: float | None = None,
    http: httpx.Client | None = None,
) -> FederatedIdentity:
    """The callback's work: exchange the code, validate the ID token, fill in missing claims
    from userinfo, and map the user's groups."""
    metadata = discover(settings.issuer, http=http)
    tokens = exchange_code(settings, metadata, code=code, code_verifier=code_verifier, http=http)
    when = time.time() if now is None else now

    def validate(keys: KeySet) -> dict[str, Any]:
        return validate_id_token(
            tokens["id_token"],
            keys,
            issuer=settings.issuer,
            client_id=settings.client_id,
            nonce=nonce,
            now=when,
            algorithms=metadata.id_token_algorithms,
        )

    try:
        claims = validate(signing_keys(metadata, http=http))
    except UnknownSigningKey:
        claims = validate(signing_keys(metadata, http=http, refresh=True))
    missing = settings.groups_claim not in claims or settings.username_claim not in claims
    access_token = tokens.get("access_token")
    if missing and metadata.userinfo_endpoint and isinstance(access_token, str):
        info = fetch_userinfo(metadata, access_token, http=http)
        if info.get("sub") != claims["sub"]:
            raise OidcFailed(
                "userinfo describes another subject than the ID token", reason="userinfo"
            )
        claims = {**info, **claims}  # the signed ID token wins where both say something
    return identity_from_claims(claims, settings)
