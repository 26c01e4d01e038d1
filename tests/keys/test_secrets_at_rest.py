"""Secrets at rest (issue 13, part 2): every secret the database holds is KMS ciphertext bound to
its row. Written through the API (TOTP enrollment, a Splunk HEC sink, an OCSF HTTP sink, an OIDC
login in flight), then looked for in the raw database (the SQLite file and its write-ahead log,
a ``pg_dump`` of PostgreSQL) in every spelling: none may be there. They still work (a TOTP login,
a delivery with the token), and a ciphertext copied to another row, a tampered one or a KMS that
is down fails the operation with a clear error and writes nothing.

Recovery codes and API/session token secrets are kept as SHA-256 hashes (not secrets at rest to
seal); the OIDC client secret comes from the environment, never the database."""

from __future__ import annotations

import base64
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from proofplane.access import SYSTEM, totp
from proofplane.access import oidc as oidc_client
from proofplane.api.app import create_app
from proofplane.config import OidcSettings, Settings
from proofplane.keys import DecryptFailed, KmsUnavailable, envelope
from proofplane.service import sinks as sinks_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, OidcLoginRow, SinkRow, UserRow

API = "/api/v1"
ADMIN = "ppt_secrets-at-rest-admin-0123456789ab"
PASSWORD = "correct horse battery staple"
HEC_TOKEN = "0a1b2c3d-4e5f-4a6b-8c7d-secret-hec-0001"
BEARER = "ocsf-bearer-9f8e7d6c5b4a-secret-0002"
ISSUER = "https://idp.invalid"


# --- helpers ---------------------------------------------------------------------------------


class Receiver:
    """A loopback HTTP receiver that acknowledges every POST and keeps its Authorization."""

    def __init__(self) -> None:
        self.auth: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.auth.append(self.headers.get("Authorization"))
                body = b'{"text":"Success","code":0}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(
            target=lambda: self.server.serve_forever(poll_interval=0.05), daemon=True
        ).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def api(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The API (admin token), with OIDC configured for a provider that is never contacted and
    sinks allowed to reach plain HTTP on loopback."""
    monkeypatch.setenv("PROOFPLANE_SINK_ALLOW_INSECURE", "1")
    monkeypatch.setenv("PROOFPLANE_SINK_ALLOW_HOSTS", "127.0.0.1")
    settings = Settings(
        oidc=OidcSettings(
            issuer=ISSUER,
            client_id="proofplane",
            client_secret="client-secret-from-the-environment",
            redirect_uri="http://127.0.0.1:9/api/v1/auth/oidc/callback",
        )
    )
    bootstrap_admin(store, ADMIN)
    with TestClient(
        create_app(store, settings),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN}"},
    ) as client:
        yield client


def anon(client: TestClient, token: str | None = None) -> TestClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return TestClient(client.app, raise_server_exceptions=False, headers=headers)


def login(client: TestClient, name: str, code: str | None = None) -> Any:
    body: dict[str, Any] = {"username": name, "password": PASSWORD}
    if code is not None:
        body["totp"] = code
    return anon(client).post(f"{API}/auth/login", json=body)


def enroll(client: TestClient, name: str) -> tuple[str, int]:
    """A new operator who enrolls TOTP through the API: (the seed, the step confirmed at)."""
    made = client.post(
        f"{API}/users", json={"username": name, "password": PASSWORD, "roles": ["operator"]}
    )
    assert made.status_code == 201, made.text
    first = login(client, name)
    assert first.status_code == 200 and first.json()["mfa_enrollment_required"] is True
    session = anon(client, first.json()["token"])
    started = session.post(f"{API}/auth/mfa/enroll")
    assert started.status_code == 200, started.text
    seed = started.json()["secret"]
    step = totp.step_at(time.time())
    confirmed = session.post(
        f"{API}/auth/mfa/confirm", json={"totp": totp.code_at_step(seed, step)}
    )
    assert confirmed.status_code == 200, confirmed.text
    return seed, step


def spellings(secret: str) -> list[bytes]:
    """A secret as it could sit in the database: its text, its bytes behind base32 (a TOTP
    seed), and those in base64, base64url and hex."""
    forms = [secret.encode()]
    try:
        raw = base64.b32decode(secret + "=" * (-len(secret) % 8))
    except ValueError:
        raw = secret.encode()
    if raw != secret.encode():
        forms.append(raw)
    for data in (raw, secret.encode()):
        forms += [
            base64.b64encode(data).rstrip(b"="),
            base64.urlsafe_b64encode(data).rstrip(b"="),
            data.hex().encode(),
        ]
    return forms


def database_bytes(store: Store) -> bytes:
    """Everything the database holds, as stored: the SQLite file and its WAL, or pg_dump."""
    if store.engine.dialect.name == "sqlite":
        path = Path(store.engine.url.database or "")
        wal = path.with_name(path.name + "-wal")
        return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")
    url = store.url.replace("postgresql+psycopg://", "postgresql://", 1)
    dump = subprocess.run(
        ["pg_dump", "--no-owner", "--dbname", url], capture_output=True, timeout=120, check=True
    )
    assert b"CREATE TABLE public.users" in dump.stdout  # the dump is the whole database
    return dump.stdout


def event_count(store: Store) -> int:
    with store.read() as s:
        return int(s.scalar(select(func.count()).select_from(EventRow)) or 0)


def user_row(store: Store, name: str) -> tuple[Any, ...]:
    with store.read() as s:
        row = s.scalar(select(UserRow).where(UserRow.username == name))
        assert row is not None
        return (row.totp_secret, row.totp_last_step, row.failed_logins, row.recovery_codes,
                row.updated_at)  # fmt: skip


def set_totp_secret(store: Store, name: str, value: str) -> None:
    with store.write(SYSTEM) as tx:
        tx.session.execute(
            update(UserRow).where(UserRow.username == name).values(totp_secret=value)
        )


def begin_oidc(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An OIDC login in flight, started through the API (the provider's discovery document is
    served from memory): the nonce and verifier it holds."""
    metadata = oidc_client.parse_metadata(
        {
            "issuer": ISSUER,
            "authorization_endpoint": f"{ISSUER}/auth",
            "token_endpoint": f"{ISSUER}/token",
            "jwks_uri": f"{ISSUER}/jwks",
            "code_challenge_methods_supported": ["S256"],
        },
        ISSUER,
    )
    made: list[oidc_client.AuthorizationRequest] = []
    real = oidc_client.new_authorization_request

    def remember(meta: Any, settings: Any) -> oidc_client.AuthorizationRequest:
        made.append(real(meta, settings))
        return made[-1]

    monkeypatch.setattr(oidc_client, "discover", lambda issuer: metadata)
    monkeypatch.setattr(oidc_client, "new_authorization_request", remember)
    r = anon(api).get(f"{API}/auth/oidc/login", follow_redirects=False)
    assert r.status_code in (302, 303, 307), r.text
    query = parse_qs(urlsplit(r.headers["location"]).query)
    assert query["nonce"] == [made[0].nonce] and query["state"] == [made[0].state]
    return {"state": made[0].state, "nonce": made[0].nonce, "verifier": made[0].code_verifier}


# --- the tests -------------------------------------------------------------------------------


def test_no_secret_is_in_the_database_in_the_clear_and_each_still_works(
    store: Store, api: TestClient, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed, step = enroll(api, "ops")
    hec = api.post(
        f"{API}/sinks",
        json={"name": "splunk", "type": "splunk-hec",
              "config": {"url": receiver.url, "token": HEC_TOKEN, "batch_size": 50}},
    )  # fmt: skip
    assert hec.status_code == 201, hec.text
    assert hec.json()["config"]["token"] == "<redacted>" and HEC_TOKEN not in hec.text
    lake = api.post(
        f"{API}/sinks",
        json={"name": "lake", "type": "ocsf-http",
              "config": {"url": f"{receiver.url}/ingest", "bearer_token": BEARER}},
    )  # fmt: skip
    assert lake.status_code == 201, lake.text
    assert lake.json()["config"]["bearer_token"] == "<redacted>" and BEARER not in lake.text
    pending = begin_oidc(api, monkeypatch)

    # at rest: ciphertext of the key "secrets", in every row that holds a secret
    with store.read() as s:
        user = s.scalar(select(UserRow).where(UserRow.username == "ops"))
        assert user is not None and user.totp_secret is not None
        assert envelope.is_ciphertext(user.totp_secret)
        assert envelope.parse(user.totp_secret).key == "secrets"
        configs = {r.name: r.config for r in s.scalars(select(SinkRow))}
        assert envelope.is_ciphertext(configs["splunk"]["token"])
        assert envelope.is_ciphertext(configs["lake"]["bearer_token"])
        assert configs["splunk"]["url"] == receiver.url  # only the secrets are sealed
        flight = s.get(OidcLoginRow, pending["state"])
        assert flight is not None
        assert envelope.is_ciphertext(flight.nonce)
        assert envelope.is_ciphertext(flight.code_verifier)
        key_events = s.scalars(select(EventRow).where(EventRow.action == "key.create")).all()
        assert [e.target_id for e in key_events] == ["secrets"]  # made once, on first use

    # ...and nowhere in the database's bytes, in any spelling
    raw = database_bytes(store)
    for name, secret in (("TOTP seed", seed), ("HEC token", HEC_TOKEN), ("bearer", BEARER),
                         ("OIDC verifier", pending["verifier"]),
                         ("OIDC nonce", pending["nonce"])):  # fmt: skip
        for form in spellings(secret):
            assert form not in raw, f"the {name} is in the database as {form!r}"

    # they still work: a TOTP login with the next code (the confirmed one is used up)
    ok = login(api, "ops", totp.code_at_step(seed, step + 1))
    assert ok.status_code == 200, ok.text
    replay = login(api, "ops", totp.code_at_step(seed, step + 1))
    assert replay.status_code == 401 and replay.json()["error"]["code"] == "invalid_totp"
    # the sinks deliver with the tokens in the clear, on the wire only
    flushed = api.post(f"{API}/sinks/flush")
    assert flushed.status_code == 200, flushed.text
    assert f"Splunk {HEC_TOKEN}" in receiver.auth and f"Bearer {BEARER}" in receiver.auth
    tested = api.post(f"{API}/sinks/splunk/test")
    assert tested.status_code == 200, tested.text
    # the OIDC login in flight opens with the verifier and nonce it was started with
    seen: dict[str, str] = {}

    def complete(config: Any, *, code: str, code_verifier: str, nonce: str) -> Any:
        seen.update(verifier=code_verifier, nonce=nonce)
        raise oidc_client.OidcFailed("stop here", reason="test")

    monkeypatch.setattr(oidc_client, "complete_login", complete)
    r = anon(api).get(f"{API}/auth/oidc/callback", params={"code": "c", "state": pending["state"]})
    assert r.status_code < 500, r.text
    assert seen == {"verifier": pending["verifier"], "nonce": pending["nonce"]}


def test_a_seed_copied_to_another_row_or_tampered_does_not_open(
    store: Store, api: TestClient
) -> None:
    alice_seed, alice_step = enroll(api, "alice")
    bob_seed, bob_step = enroll(api, "bob")
    with store.read() as s:
        alice = s.scalar(select(UserRow.totp_secret).where(UserRow.username == "alice"))
        bob = s.scalar(select(UserRow.totp_secret).where(UserRow.username == "bob"))
    assert alice and bob and alice != bob

    copied = alice  # alice's sealed seed in bob's row
    parts = bob.split(".")
    sealed = bytearray(base64.urlsafe_b64decode(parts[4] + "=" * (-len(parts[4]) % 4)))
    sealed[-1] ^= 1
    tampered = ".".join([*parts[:4], base64.urlsafe_b64encode(bytes(sealed)).decode().rstrip("=")])
    for stored in (copied, tampered, "JBSWY3DPEHPK3PXP"):  # the last: a seed in the clear
        set_totp_secret(store, "bob", stored)
        before_events, before_row = event_count(store), user_row(store, "bob")
        for code in (totp.code_at_step(bob_seed, bob_step + 1),
                     totp.code_at_step(alice_seed, alice_step + 1)):  # fmt: skip
            r = login(api, "bob", code)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "decrypt_failed"
            assert alice_seed not in r.text and bob_seed not in r.text
        # nothing written: no event, no counter, no step, no session
        assert event_count(store) == before_events
        assert user_row(store, "bob") == before_row
    set_totp_secret(store, "bob", bob)
    assert login(api, "bob", totp.code_at_step(bob_seed, bob_step + 1)).status_code == 200


def test_a_sink_secret_copied_to_another_sink_does_not_open(
    store: Store, api: TestClient, receiver: Receiver
) -> None:
    for name, token in (("one", HEC_TOKEN), ("two", "another-hec-token-0003")):
        r = api.post(
            f"{API}/sinks",
            json={"name": name, "type": "splunk-hec",
                  "config": {"url": receiver.url, "token": token}},
        )  # fmt: skip
        assert r.status_code == 201, r.text
    with store.write(SYSTEM) as tx:
        one = tx.session.scalar(select(SinkRow).where(SinkRow.name == "one"))
        two = tx.session.scalar(select(SinkRow).where(SinkRow.name == "two"))
        assert one is not None and two is not None
        two.config = {**two.config, "token": one.config["token"]}
    r = api.post(f"{API}/sinks/two/test")
    assert r.status_code == 422 and r.json()["error"]["code"] == "decrypt_failed", r.text
    results = sinks_svc.export_once(store, retry=sinks_svc.RetryPolicy(attempts=1))
    by_name = {p.name: p for p in results}
    assert by_name["one"].error is None and by_name["one"].delivered > 0
    assert by_name["two"].error is not None and by_name["two"].delivered == 0
    assert receiver.auth and set(receiver.auth) == {f"Splunk {HEC_TOKEN}"}
    with store.read() as s:
        assert s.scalar(select(SinkRow.cursor).where(SinkRow.name == "two")) == 0


class _Down:
    """A KMS backend that cannot be reached: every operation fails as OpenBao or an HSM that
    is down does."""

    kind = "local"

    def __getattr__(self, name: str) -> Any:
        def fail(*_a: Any, **_k: Any) -> Any:
            raise KmsUnavailable("the KMS cannot be reached")

        return fail


def test_a_kms_outage_fails_the_operation_and_writes_nothing(
    store: Store, api: TestClient, receiver: Receiver
) -> None:
    seed, step = enroll(api, "ops")
    made = api.post(
        f"{API}/sinks",
        json={"name": "splunk", "type": "splunk-hec",
              "config": {"url": receiver.url, "token": HEC_TOKEN}},
    )  # fmt: skip
    assert made.status_code == 201, made.text
    kms = store.kms
    working = kms.backend
    kms.backend = _Down()
    try:
        before_events, before_row = event_count(store), user_row(store, "ops")
        r = login(api, "ops", totp.code_at_step(seed, step + 1))
        assert r.status_code == 503 and r.json()["error"]["code"] == "kms_unavailable", r.text
        assert event_count(store) == before_events and user_row(store, "ops") == before_row
        t = api.post(f"{API}/sinks/splunk/test")
        assert t.status_code == 503 and t.json()["error"]["code"] == "kms_unavailable", t.text
        (result,) = sinks_svc.export_once(store)
        assert result.error and result.delivered == 0 and receiver.auth == []
        # a new secret is not stored in the clear either: the sink is not created
        r = api.post(
            f"{API}/sinks",
            json={"name": "other", "type": "splunk-hec",
                  "config": {"url": receiver.url, "token": "t-0004"}},
        )  # fmt: skip
        assert r.status_code == 503, r.text
        assert api.get(f"{API}/sinks/other").status_code == 404
    finally:
        kms.backend = working
    assert login(api, "ops", totp.code_at_step(seed, step + 1)).status_code == 200


def test_open_config_refuses_a_plaintext_secret(store: Store) -> None:
    with store.read() as s, pytest.raises(DecryptFailed):
        sinks_svc.open_config(store, s, 1, {"url": "https://x", "token": "clear"})
