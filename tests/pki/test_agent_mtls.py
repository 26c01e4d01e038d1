"""End to end on loopback with real TLS (issue 13, part 5): a server with
``--tls-client-ca <agent CA> --tls-client-optional``; an attested node's agent asks for its
channel certificate with its bearer credential, then connects with the certificate alone and is
its node; people keep using tokens without certificates. Quarantine revokes the certificate
(refused, on the CRL) and the agent falls back to its credential; an expired certificate and
one from another CA are refused at the handshake."""

from __future__ import annotations

import datetime as dt
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
from proofplane.cli.agent import renew_certificate
from proofplane.cli.client import ApiClient, ApiError, CliError
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


def _attest(store: Store, name: str) -> None:
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


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    store = Store(f"sqlite:///{tmp_path / 'mtls.db'}")
    migrate.upgrade(store.engine)
    pki.forget_cached_ca()
    access.bootstrap_admin(store, ADMIN)
    _attest(store, "gpu-01")
    agent_token = access.issue_agent_credential(store, SYSTEM, "gpu-01").token
    agent_ca_file = tmp_path / "agent-ca.pem"
    agent_ca_file.write_text(pki.ca_certificate(store, "default"))
    ca, ca_key = pki_tls.make_ca(tmp_path / "server-ca", "test server CA")
    cert, key = pki_tls.make_server_cert(ca, ca_key, ["127.0.0.1"], tmp_path / "server")
    tls = pki_tls.ServerTls(cert, key, agent_ca_file, client_optional=True)
    with serve(store, Settings(cookie_secure=False), tls=tls) as url:
        yield {"store": store, "url": url, "ca": str(ca), "token": agent_token,
               "certs": tmp_path / "agent"}  # fmt: skip
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


def test_expired_and_foreign_certificates_are_refused_at_the_handshake(
    world: dict[str, Any], tmp_path: Path
) -> None:
    url, ca, certs = world["url"], world["ca"], world["certs"]
    csr = channel.make_csr(certs, "gpu-01")
    agent_actor, ttl = Actor("node:gpu-01"), dt.timedelta(seconds=1)
    short = pki.issue_agent_certificate(world["store"], agent_actor, "gpu-01", csr,
                                        cluster_id="default", ttl=ttl)  # fmt: skip
    channel.store_certificate(certs, short["certificate"], short["ca"])
    time.sleep(1.5)
    expired = (str(certs / channel.CERT_FILE), str(certs / channel.KEY_FILE))
    with ApiClient(url, ca_file=ca, client_cert=expired) as agent, pytest.raises(CliError) as e:
        agent.post(NONCE)
    assert "cannot reach" in e.value.message or "certificate" in e.value.message
    other_ca, other_key = agent_ca.new_ca("default", dt.datetime.now(dt.UTC))
    foreign = agent_ca.issue(ca_pem=other_ca, ca_key_der=other_key, csr_pem=csr, node="gpu-01",
                             cluster_id="default", now=dt.datetime.now(dt.UTC))  # fmt: skip
    (tmp_path / "foreign.crt").write_text(foreign.pem)
    bad = (str(tmp_path / "foreign.crt"), str(certs / channel.KEY_FILE))
    with ApiClient(url, ca_file=ca, client_cert=bad) as agent, pytest.raises(CliError):
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
