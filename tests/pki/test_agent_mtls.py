"""End to end on loopback with real TLS (issue 13, part 5): a server with
``--tls-client-ca <agent CA> --tls-client-optional``; an attested node's agent asks for its
channel certificate with its bearer credential, then connects with the certificate alone and is
its node; people keep using tokens without certificates. Once the node holds a certificate its
bearer credential is refused (``agent_certificate_required``) except to enroll and to ask for a
certificate; a failed round under a policy that does not quarantine suspends the certificate
until a round passes. Quarantine revokes the certificate (refused, on the CRL) and the agent
falls back to its credential; the agent's rounds (``attest_round``) fall back and recover on
their own. An expired certificate and one from another CA are refused at the handshake by the
server's TLS policy (certificate expired / unknown CA), never reaching the application."""

from __future__ import annotations

import datetime as dt
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from live_server import serve
from proofplane.access import SYSTEM, Actor
from proofplane.agent import channel
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.cli.agent import attest_round, renew_certificate
from proofplane.cli.client import ApiClient, ApiError, CliError, ServerUnreachable
from proofplane.config import Settings
from proofplane.model import Gpu, Node, NodeState
from proofplane.pki import agent_ca
from proofplane.pki import tls as pki_tls
from proofplane.service import access, pki
from proofplane.service import attestation as att
from proofplane.service.context import Store
from proofplane.service.nodes import register_node, set_node_state
from proofplane.store import migrate

ADMIN = "ppt_mtls-admin-token-0123456789abcdef"
POLICY = {"id": "p", "node_class": "default", "require_eventlog": False,
          "require_secure_boot": False, "require_inventory": False}  # fmt: skip
NONCE = "/api/v1/nodes/gpu-01/attestation/nonce"


def _attest(store: Store, name: str) -> SimulatedAttester:
    register_node(
        store, SYSTEM, Node(name, "r1", "z1", gpus=(Gpu(0, f"GPU-{name}", "H100-80GB", 81920),))
    )
    att.set_policy(store, SYSTEM, POLICY, enforce=True)
    a = SimulatedAttester.create()
    actor = Actor(f"node:{name}")
    ch = att.enroll(store, actor, name, a.ek_public, a.ak_public, simulated=True,
                    allow_simulated=True)  # fmt: skip
    att.activate(store, actor, name, a.activate(ch.credential))
    a.boot(demo_boot_log(b"kernel"))
    nonce = att.issue_nonce(store, actor, name)
    evidence = a.evidence(nonce.nonce, list(nonce.pcrs))
    assert att.submit_evidence(store, actor, name, nonce.nonce, evidence,
                               allow_simulated=True).verdict["ok"]  # fmt: skip
    return a


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    store = Store(f"sqlite:///{tmp_path / 'mtls.db'}")
    migrate.upgrade(store.engine)
    pki.forget_cached_ca()
    access.bootstrap_admin(store, ADMIN)
    attester = _attest(store, "gpu-01")
    agent_token = access.issue_agent_credential(store, SYSTEM, "gpu-01").token
    agent_ca_file = tmp_path / "agent-ca.pem"
    agent_ca_file.write_text(pki.ca_certificate(store, "default"))
    ca, ca_key = pki_tls.make_ca(tmp_path / "server-ca", "test server CA")
    cert, key = pki_tls.make_server_cert(ca, ca_key, ["127.0.0.1"], tmp_path / "server")
    tls = pki_tls.ServerTls(cert, key, agent_ca_file, client_optional=True)
    with serve(store, Settings(cookie_secure=False), tls=tls) as url:
        yield {"store": store, "url": url, "ca": str(ca), "token": agent_token,
               "certs": tmp_path / "agent", "attester": attester, "tls": tls}  # fmt: skip
    store.dispose()


def test_the_agent_gets_a_certificate_then_connects_with_it_alone(world: dict[str, Any]) -> None:
    url, ca, certs = world["url"], world["ca"], world["certs"]
    with ApiClient(url, token=world["token"], ca_file=ca) as api:
        issued = renew_certificate(api, "gpu-01", certs)
    assert issued["spiffe_id"] == "spiffe://default/node/gpu-01"
    assert oct((certs / channel.KEY_FILE).stat().st_mode & 0o777) == "0o600"
    cert = channel.current(certs)
    assert cert is not None
    with ApiClient(url, ca_file=ca, client_cert=cert) as agent:  # no bearer credential
        assert agent.post(NONCE)["node"] == "gpu-01"
        with pytest.raises(ApiError) as other:  # it acts for its own node only
            agent.post("/api/v1/nodes/gpu-02/attestation/nonce")
        assert other.value.status == 404
        with pytest.raises(ApiError) as people:  # and is not a person
            agent.get("/api/v1/nodes")
        assert people.value.status == 403
    with ApiClient(url, token=ADMIN, ca_file=ca) as admin:  # people: tokens, no certificate
        assert admin.get("/api/v1/pki/certificates")["items"][0]["node"] == "gpu-01"


def test_quarantine_revokes_and_the_agent_falls_back_to_its_credential(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ca, certs = world["url"], world["ca"], world["certs"]
    # the agent's rounds verify the server with the invocation's --ca-file
    monkeypatch.setattr("proofplane.cli.client.invocation_ca_file", lambda: ca)
    with ApiClient(url, token=world["token"], ca_file=ca) as api:
        issued = renew_certificate(api, "gpu-01", certs)
    set_node_state(world["store"], SYSTEM, "gpu-01", NodeState.QUARANTINED, "drift")
    cert = channel.current(certs)
    assert cert is not None
    from proofplane.cli.agent import _client

    with _client(url, world["token"], certs) as agent, pytest.raises(ApiError) as refused:
        agent.post(NONCE)
    assert refused.value.status == 401 and refused.value.code == "agent_certificate_revoked"
    assert channel.current(certs) is None  # set aside: the next round uses the credential
    with ApiClient(url, ca_file=ca) as anyone:
        raw = anyone._http.get("/api/v1/pki/crl")
    crl = x509.load_der_x509_crl(raw.content)
    assert int(issued["serial"], 16) in {r.serial_number for r in crl}
    with ApiClient(url, token=world["token"], ca_file=ca) as api, pytest.raises(ApiError) as no:
        renew_certificate(api, "gpu-01", certs)  # no renewal while quarantined
    assert no.value.code == "node_not_attested"


EVIDENCE = "/api/v1/nodes/gpu-01/attestation/evidence"


def _refused(call: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        call()
    return refused.value


def test_the_bearer_credential_only_enrolls_once_the_node_holds_a_certificate(
    world: dict[str, Any],
) -> None:
    url, ca, certs, store = world["url"], world["ca"], world["certs"], world["store"]
    with ApiClient(url, token=world["token"], ca_file=ca) as bearer:
        assert bearer.post(NONCE)["node"] == "gpu-01"  # no certificate yet: first enrollment
        issued = renew_certificate(bearer, "gpu-01", certs)
        for call in (lambda: bearer.post(NONCE), lambda: bearer.post(EVIDENCE, {}),
                     lambda: bearer.get("/api/v1/auth/me")):  # fmt: skip
            no = _refused(call)
            assert (no.status, no.code) == (401, "agent_certificate_required"), no.message
        assert "connect with it" in no.message
        # enrolling (a new AK) and asking for a certificate stay open to the credential: the
        # enroll/activate bodies below are refused by validation (422), past authentication
        for route in ("enroll", "activate"):
            bad = _refused(lambda r=route: bearer.post(f"/api/v1/nodes/gpu-01/attestation/{r}", {}))
            assert bad.status == 422, bad.message
        again = renew_certificate(bearer, "gpu-01", certs)  # an agent that lost its certificate
        assert again["serial"] != issued["serial"]
    with ApiClient(url, ca_file=ca, client_cert=channel.current(certs)) as agent:
        assert agent.post(NONCE)["node"] == "gpu-01"
    with ApiClient(url, token=ADMIN, ca_file=ca) as admin:  # people: tokens, as before
        assert admin.get("/api/v1/nodes")
    _attest(store, "gpu-02")  # a node without a certificate keeps using its credential
    other = access.issue_agent_credential(store, SYSTEM, "gpu-02").token
    with ApiClient(url, token=other, ca_file=ca) as bearer2:
        assert bearer2.post("/api/v1/nodes/gpu-02/attestation/nonce")["node"] == "gpu-02"
    # without a client CA (plain HTTP here, or TLS without --tls-client-ca) the credential
    # stays good: there is no certificate channel to insist on
    from fastapi.testclient import TestClient

    from proofplane.api.app import create_app

    plain = TestClient(create_app(store, Settings(cookie_secure=False)))
    ok = plain.post(NONCE, headers={"Authorization": f"Bearer {world['token']}"})
    assert ok.status_code == 201, ok.text
    # every certificate revoked: the credential is good again (the way back to a certificate)
    for cert in pki.list_certificates(store, SYSTEM, "gpu-01"):
        pki.revoke_certificate(store, SYSTEM, cert["serial"])
    with ApiClient(url, token=world["token"], ca_file=ca) as bearer:
        assert bearer.post(NONCE)["node"] == "gpu-01"


def test_the_bearer_exempt_routes_exist() -> None:
    from proofplane.api.app import create_app
    from proofplane.api.deps import BEARER_AGENT_ROUTES

    app = create_app(None)  # type: ignore[arg-type]
    try:  # how FastAPI flattens included routers (tests/api/test_route_matrix.py)
        from fastapi.routing import iter_route_contexts

        routes: list[Any] = list(iter_route_contexts(app.routes))
    except ImportError:
        routes = list(app.routes)
    assert {getattr(r, "path", None) for r in routes} >= BEARER_AGENT_ROUTES


def _failing_policy(store: Store) -> None:
    """A policy that does not quarantine, and fails a round without a GPU inventory."""
    att.set_policy(store, SYSTEM, {**POLICY, "require_inventory": True, "min_driver": "550.0"},
                   enforce=False)  # fmt: skip


def test_a_failed_round_under_a_non_enforcing_policy_suspends_the_certificate(
    world: dict[str, Any],
) -> None:
    url, ca, certs, store = world["url"], world["ca"], world["certs"], world["store"]
    with ApiClient(url, token=world["token"], ca_file=ca) as bearer:
        renew_certificate(bearer, "gpu-01", certs)
    cert = channel.current(certs)
    assert cert is not None
    _failing_policy(store)
    a, actor = world["attester"], Actor("node:gpu-01")
    nonce = att.issue_nonce(store, actor, "gpu-01")
    evidence = a.evidence(nonce.nonce, list(nonce.pcrs))
    out = att.submit_evidence(store, actor, "gpu-01", nonce.nonce, evidence, allow_simulated=True)
    assert not out.verdict["ok"] and out.state == "admitted"  # not enforced: still admitted
    with ApiClient(url, ca_file=ca, client_cert=cert) as agent:
        no = _refused(lambda: agent.post(NONCE))
    assert (no.status, no.code) == (401, "node_not_attested"), no.message
    assert not pki.holds_certificate(store, "gpu-01", dt.datetime.now(dt.UTC))
    with ApiClient(url, token=world["token"], ca_file=ca) as bearer:
        assert bearer.post(NONCE)["node"] == "gpu-01"  # the credential attests again
        renewal = _refused(lambda: renew_certificate(bearer, "gpu-01", certs))
        assert (renewal.status, renewal.code) == (409, "node_not_attested")
    att.set_policy(store, SYSTEM, POLICY, enforce=False)
    nonce = att.issue_nonce(store, actor, "gpu-01")
    assert att.submit_evidence(store, actor, "gpu-01", nonce.nonce,
                               a.evidence(nonce.nonce, list(nonce.pcrs)),
                               allow_simulated=True).verdict["ok"]  # fmt: skip
    with ApiClient(url, ca_file=ca, client_cert=cert) as agent:  # a passing round: accepted
        assert agent.post(NONCE)["node"] == "gpu-01"


def test_the_agents_rounds_fall_back_and_recover(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attest_round`` as the agent runs it; the round takes its nonce over the agent's
    channel and submits the simulated attester's evidence in process (the HTTP evidence route
    refuses a simulated attester outside the demo)."""
    url, ca, certs, store = world["url"], world["ca"], world["certs"], world["store"]
    monkeypatch.setattr("proofplane.cli.client.invocation_ca_file", lambda: ca)
    seen: list[tuple[str, str]] = []
    original = ApiClient.request

    def spy(self: ApiClient, method: str, path: str, **kw: Any) -> Any:
        channel_used = "cert" if type(self).__name__ == "_CertClient" else "bearer"
        seen.append((channel_used, path.rsplit("/", 1)[-1]))
        return original(self, method, path, **kw)

    monkeypatch.setattr(ApiClient, "request", spy)

    def run(api: ApiClient) -> dict[str, Any]:
        issued = api.post(NONCE)
        nonce = bytes.fromhex(issued["nonce"])
        evidence = world["attester"].evidence(nonce, list(issued["pcrs"]))
        out = att.submit_evidence(store, Actor("node:gpu-01"), "gpu-01", nonce, evidence,
                                  allow_simulated=True)  # fmt: skip
        return {"verdict": out.verdict, "state": out.state}

    def round_() -> list[tuple[str, str]]:
        seen.clear()
        attest_round(url, world["token"], "gpu-01", certs, run)
        return list(seen)

    first = [("bearer", "nonce"), ("bearer", "agent-certificate")]
    assert round_() == first  # first enrollment: the credential, then a certificate
    assert round_() == [("cert", "nonce"), ("cert", "agent-certificate")]
    (certs / channel.CERT_FILE).unlink()  # the agent lost its certificate
    assert round_() == [("bearer", "nonce"), ("bearer", "agent-certificate"),  # refused, asks
                        ("cert", "nonce"), ("cert", "agent-certificate")]  # fmt: skip
    _failing_policy(store)
    assert round_() == [("cert", "nonce")]  # it fails: no renewal
    att.set_policy(store, SYSTEM, POLICY, enforce=False)
    # the certificate is suspended: set aside, the round goes on the credential at once
    assert round_() == [("cert", "nonce"), *first]
    assert channel.current(certs) is not None
    set_node_state(store, SYSTEM, "gpu-01", NodeState.QUARANTINED, "drift")
    seen.clear()
    with pytest.raises(ApiError) as quarantined:  # revoked: set aside, the credential attests,
        attest_round(url, world["token"], "gpu-01", certs, run)  # but gets no certificate
    assert seen == [("cert", "nonce"), *first]
    assert (quarantined.value.status, quarantined.value.code) == (409, "node_not_attested")
    assert channel.current(certs) is None
    set_node_state(store, SYSTEM, "gpu-01", NodeState.ADMITTED, "released")
    assert round_() == first
    with pytest.raises(CliError) as no_dir:  # a node with a certificate needs --cert-dir
        attest_round(url, world["token"], "gpu-01", None, run)
    assert "--cert-dir" in no_dir.value.message


def _handshake(
    server: ssl.SSLContext, client: ssl.SSLContext
) -> tuple[ssl.SSLError | None, ssl.SSLError | None]:
    """A TLS handshake between the two contexts in memory, every byte delivered (alerts
    included, which a server closing its socket may not get out): (server's error, client's
    error), None where that end completed. The client reads once after its handshake: in TLS
    1.3 the server judges the client's certificate after the client thinks it is done."""
    to_server, from_server, to_client, from_client = (ssl.MemoryBIO() for _ in range(4))
    ends = {
        "server": server.wrap_bio(to_server, from_server, server_side=True),
        "client": client.wrap_bio(to_client, from_client, server_hostname="127.0.0.1"),
    }
    done: set[str] = set()
    failed: dict[str, ssl.SSLError] = {}
    for _ in range(10):
        for name in ("client", "server"):
            if name in failed:
                continue
            try:
                if name in done:
                    ends[name].read(1)
                else:
                    ends[name].do_handshake()
                    done.add(name)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                failed[name] = exc
            to_server.write(from_client.read())
            to_client.write(from_server.read())
    return failed.get("server"), failed.get("client")


def test_expired_and_foreign_certificates_are_refused_at_the_handshake(
    world: dict[str, Any], tmp_path: Path
) -> None:
    url, ca, certs = world["url"], world["ca"], world["certs"]
    server_ctx: ssl.SSLContext = world["tls"].context()  # the server's own TLS policy
    csr = channel.make_csr(certs, "gpu-01")
    agent_actor, ttl = Actor("node:gpu-01"), dt.timedelta(seconds=1)
    short = pki.issue_agent_certificate(world["store"], agent_actor, "gpu-01", csr,
                                        cluster_id="default", ttl=ttl)  # fmt: skip
    channel.store_certificate(certs, short["certificate"], short["ca"])
    key = str(certs / channel.KEY_FILE)
    fresh = tmp_path / "fresh.crt"  # the control: a valid certificate passes the same handshake
    fresh.write_text(pki.issue_agent_certificate(world["store"], agent_actor, "gpu-01", csr,
                                                 cluster_id="default")["certificate"])  # fmt: skip
    assert _handshake(server_ctx, pki_tls.client_context(ca, fresh, key)) == (None, None)
    time.sleep(1.5)
    expired = (str(certs / channel.CERT_FILE), key)
    server_err, client_err = _handshake(server_ctx, pki_tls.client_context(ca, *expired))
    assert isinstance(server_err, ssl.SSLCertVerificationError)
    assert server_err.verify_code == 10 and server_err.verify_message == "certificate has expired"
    assert client_err is not None and client_err.reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED"
    # over the loopback: the connection ends in the handshake, no HTTP answer at all (the
    # server's asyncio transport closes without flushing the alert: no alert to match there)
    with (
        ApiClient(url, ca_file=ca, client_cert=expired) as agent,
        pytest.raises(ServerUnreachable) as e,
    ):
        agent.post(NONCE)
    assert "cannot reach" in e.value.message
    other_ca, other_key = agent_ca.new_ca("default", dt.datetime.now(dt.UTC))
    foreign = agent_ca.issue(ca_pem=other_ca, ca_key_der=other_key, csr_pem=csr, node="gpu-01",
                             cluster_id="default", now=dt.datetime.now(dt.UTC))  # fmt: skip
    (tmp_path / "foreign.crt").write_text(foreign.pem)
    bad = (str(tmp_path / "foreign.crt"), key)
    server_err, client_err = _handshake(server_ctx, pki_tls.client_context(ca, *bad))
    assert isinstance(server_err, ssl.SSLCertVerificationError)
    assert server_err.verify_code == 20  # X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    assert "unable to get local issuer certificate" in server_err.verify_message
    assert client_err is not None and client_err.reason == "TLSV1_ALERT_UNKNOWN_CA"
    with ApiClient(url, ca_file=ca, client_cert=bad) as agent, pytest.raises(ServerUnreachable):
        agent.post(NONCE)


def test_pki_cli_lists_revokes_and_prints_the_ca(world: dict[str, Any]) -> None:
    import json

    from typer.testing import CliRunner

    from proofplane.cli.main import app

    url, ca, certs = world["url"], world["ca"], world["certs"]
    with ApiClient(url, token=world["token"], ca_file=ca) as api:
        issued = renew_certificate(api, "gpu-01", certs)
    runner = CliRunner()

    def cli(*args: str) -> Any:
        return runner.invoke(app, ["--server", url, "--token", ADMIN, "--ca-file", ca, *args])

    listed = cli("pki", "list", "--json")
    assert listed.exit_code == 0, listed.output
    assert [c["serial"] for c in json.loads(listed.stdout)["items"]] == [issued["serial"]]
    assert "gpu-01" in cli("pki", "list").stdout
    done = cli("pki", "revoke", issued["serial"])
    assert done.exit_code == 0 and "revoked" in done.stdout
    assert cli("pki", "list", "--node", "gpu-01", "--json").exit_code == 0
    for bad in ("not-hex!", "ffff"):
        refused = cli("pki", "revoke", bad)
        assert refused.exit_code != 0 and "Traceback" not in refused.output
    shown = cli("pki", "ca")
    assert shown.exit_code == 0 and shown.stdout == pki.ca_certificate(world["store"], "default")
