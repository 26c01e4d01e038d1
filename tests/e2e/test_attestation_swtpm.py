"""Admission by attestation against a real TPM 2.0 (swtpm + tpm2-tools), through the API and
the node agent's own round (``proofplane.cli.agent.attest_once``).

One scenario on SQLite: a node enrolls (MakeCredential / ActivateCredential), attests and is
admitted; a replayed nonce, a quote by another key and an unknown nonce are rejected with their
codes and quarantine it; an operator cannot release that quarantine, a fresh passing round
does; an agent cannot act for another node; a cloned TPM (duplicate EK) is refused; a PCR
extended after enrollment quarantines the node and its workload moves to the compliant node
only. Without swtpm/tpm2-tools: skipped locally, failed in CI (CI=true).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from ci import unavailable
from proofplane.access import SYSTEM
from proofplane.agent.tpm.tpm2tools import Tpm
from proofplane.attest import Evidence, load_record, replay_record
from proofplane.cli.agent import attest_once
from proofplane.cli.client import ApiClient, ApiError
from proofplane.service import attestation as svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import EventRow
from swtpm import (
    AK_HANDLES,
    INVENTORY,
    SwtpmNode,
    boot_log,
    golden_policy,
    manufacture,
    measure,
    missing_tools,
    node_body,
)

ADMIN = "ppt_attestation-admin-token-0123456789"
API = "/api/v1"


@pytest.fixture(scope="module")
def tpm_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = missing_tools()
    if missing:
        msg = f"swtpm/tpm2-tools missing: {', '.join(missing)} (scripts/test-deps.sh installs them)"
        unavailable(msg)
    return manufacture(tmp_path_factory.mktemp("tpm-template"))


@pytest.fixture
def tpm(tpm_template: Path, tmp_path: Path) -> Iterator[SwtpmNode]:
    node = SwtpmNode.start(tpm_template, tmp_path / "tpm")
    try:
        yield node
    finally:
        node.stop()


def ok(resp: Any, status: int = 200) -> Any:
    assert resp.status_code == status, resp.text
    return resp.json()


def agent_client(tc: TestClient, token: str) -> ApiClient:
    return ApiClient("http://testserver", token=token, transport=tc._transport)


def placed_on(admin: TestClient, workload: str) -> str | None:
    w = ok(admin.get(f"{API}/workloads/{workload}", params={"tenant": "acme"}))
    return None if w["placement"] is None else w["placement"]["node"]


def test_admission_quarantine_and_release(tpm: SwtpmNode, tmp_path: Path) -> None:
    log = boot_log()
    measure(tpm, log)
    store = Store(f"sqlite:///{tmp_path / 'pp.db'}")
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN)
    from proofplane.api.app import create_app

    with TestClient(
        create_app(store), raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN}"},
    ) as admin:  # fmt: skip
        ok(admin.post(f"{API}/tenants", json={"name": "acme"}), 201)
        for name in ("gpu-a", "gpu-b", "gpu-c", "gpu-x"):
            ok(admin.post(f"{API}/nodes", json=node_body(name)), 201)
        for name in ("gpu-b", "gpu-c"):  # admitted before any policy exists
            ok(admin.post(f"{API}/nodes/{name}/state", json={"state": "admitted"}))
        ok(admin.put(f"{API}/attestation/policy", json={"policy": golden_policy(log)}))

        # under an enforcing policy a registered node is admitted only by attesting
        r = admin.post(f"{API}/nodes/gpu-a/state", json={"state": "admitted"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "attestation_required"

        token_a = ok(admin.post(f"{API}/nodes/gpu-a/agent-credentials", json={}), 201)["token"]
        hw = Tpm(tpm.tcti, tpm.workdir)
        api = agent_client(admin, token_a)

        def round_(**kw: Any) -> dict[str, Any]:
            return attest_once(api, "gpu-a", hw, ak=AK_HANDLES["ecc"], eventlog=log,
                               inventory=INVENTORY, **kw)  # fmt: skip

        # 1. a good node enrolls (MakeCredential/ActivateCredential), attests, is admitted
        first = round_()
        assert first["verdict"]["ok"], first["verdict"]
        assert first["state"] == "admitted"
        st = ok(admin.get(f"{API}/nodes/gpu-a/attestation"))
        assert st["bound"] and st["latest"]["ok"] and st["last_clock"] is not None

        # 2. a replayed nonce is rejected with its code, and quarantines the node
        base = f"{API}/nodes/gpu-a/attestation"
        nonce = bytes.fromhex(api.post(f"{base}/nonce")["nonce"])
        pcrs = list(range(10))
        quote = hw.quote(nonce, "sha256", pcrs, AK_HANDLES["ecc"])
        body = {"nonce": nonce.hex(), "evidence": Evidence(*quote, log, INVENTORY).to_json()}
        assert api.post(f"{base}/evidence", body)["verdict"]["ok"]
        again = api.post(f"{base}/evidence", body)
        assert again["verdict"]["reasons"] == ["nonce_replayed"]
        assert again["state"] == "quarantined"

        # 3. an operator cannot release an attestation quarantine by hand
        r = admin.post(f"{API}/nodes/gpu-a/state", json={"state": "admitted"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "attestation_required"

        # 4. a genuine quote by a key that is not the bound AK
        nonce = bytes.fromhex(api.post(f"{base}/nonce")["nonce"])
        rogue = hw.quote(nonce, "sha256", pcrs, AK_HANDLES["rogue"])
        body = {"nonce": nonce.hex(), "evidence": Evidence(*rogue, log, INVENTORY).to_json()}
        out = api.post(f"{base}/evidence", body)
        assert out["verdict"]["reasons"] == ["quote_signature_invalid"]
        assert out["state"] == "quarantined" and "quote_signature_invalid" in out["state_reason"]

        # 5. a nonce the server never issued
        body["nonce"] = os.urandom(32).hex()
        assert api.post(f"{base}/evidence", body)["verdict"]["reasons"] == ["nonce_unknown"]

        # 6. a fresh passing attestation releases the quarantine
        released = round_()
        assert released["verdict"]["ok"] and released["state"] == "admitted"

        # 7. node A's agent cannot act for node B (B does not exist for it)
        for path in ("nonce", "evidence"):
            r = admin.post(f"{API}/nodes/gpu-b/attestation/{path}",
                           headers={"Authorization": f"Bearer {token_a}"},
                           json={"nonce": "00" * 32, "evidence": body["evidence"]})  # fmt: skip
            assert r.status_code == 404, r.text
        # ... and an agent is no user: it cannot read or change nodes
        r = admin.get(f"{API}/nodes/gpu-a", headers={"Authorization": f"Bearer {token_a}"})
        assert r.status_code == 403

        # 8. a cloned TPM (the same EK) cannot enroll for another node
        token_x = ok(admin.post(f"{API}/nodes/gpu-x/agent-credentials", json={}), 201)["token"]
        with pytest.raises(ApiError) as err:
            attest_once(agent_client(admin, token_x), "gpu-x", hw, ak=AK_HANDLES["ecc"],
                        eventlog=log, inventory=INVENTORY)  # fmt: skip
        assert err.value.code == "duplicate_ek"

        # 9. work on the node: only gpu-a and later gpu-b are certified for tier=gold
        ok(admin.post(f"{API}/nodes/gpu-a/certifications", json={"key": "tier", "value": "gold"}))
        wl = {"name": "w1", "tenant": "acme", "gpus": {"count": 1}, "tags": {"tier": "gold"}}
        assert ok(admin.post(f"{API}/workloads", json=wl), 201)["status"] == "placed"
        assert placed_on(admin, "w1") == "gpu-a"
        ok(admin.post(f"{API}/nodes/gpu-b/certifications", json={"key": "tier", "value": "gold"}))

        # 10. a PCR extended after enrollment: the next round quarantines the node, and its
        # workload moves to the compliant node (gpu-b), never to the uncertified gpu-c
        tpm.extend([(9, {"sha1": hashlib.sha1(b"x").digest(),
                         "sha256": hashlib.sha256(b"x").digest()})])  # fmt: skip
        drift = round_()
        reasons = set(drift["verdict"]["reasons"])
        assert {"pcr_policy_violation", "eventlog_replay_mismatch"} <= reasons
        assert drift["state"] == "quarantined"
        assert "pcr_policy_violation" in drift["state_reason"]
        assert placed_on(admin, "w1") == "gpu-b"

        # 11. every attempt is stored; the record replays offline to the same verdict, and the
        # audit event carries the evidence hash
        items = ok(admin.get(f"{API}/nodes/gpu-a/evidence", params={"limit": 50}))["items"]
        assert [i["ok"] for i in items] == [False, True, False, False, False, True, True]
        newest = items[0]
        record = load_record(json.dumps(newest["record"]))
        replayed = replay_record(record)
        assert not replayed.ok and list(replayed.reasons) == newest["reasons"]
        assert replayed.evidence_hash == newest["evidence_hash"]
        with store.read() as session:
            events = list(session.scalars(select(EventRow).where(EventRow.action == "node.attest")))
        assert [e.details["evidence_hash"] for e in events][-1] == newest["evidence_hash"]
        assert len(events) == 7

    # 12. staleness: nodes in service that have not passed within the grace period
    later = datetime.now(UTC) + timedelta(hours=1)
    stale = svc.check_stale(store, SYSTEM, timedelta(minutes=10), now=later)
    assert stale == ["gpu-b", "gpu-c"]  # gpu-a is already quarantined
    store.dispose()


def test_ecc_ek_enrollment_with_the_nvml_inventory(tpm: SwtpmNode, tmp_path: Path) -> None:
    """A node whose AK lives under its ECC EK (swtpm's high-range P-384 EK) enrolls through the
    ECDH MakeCredential; the agent reads its GPUs through NVML (an NVML-shaped fake here) and
    the server's VBIOS/driver allow-list judges them; without NVML the round fails closed."""
    import pynvml

    from fake_nvml import FakeNvml, h100_node
    from proofplane.cli.agent import gpu_inventory

    ecc_ek, ecc_ak = "0x81010016", "0x81010012"
    ctx = str(tmp_path / "ak.ctx")
    tpm.tool("tpm2_createak", "-C", ecc_ek, "-c", ctx, "-G", "ecc", "-g", "sha256", "-s", "ecdsa")
    tpm.tool("tpm2_evictcontrol", "-C", "o", "-c", ctx, ecc_ak)
    log = boot_log()
    measure(tpm, log)
    store = Store(f"sqlite:///{tmp_path / 'pp.db'}")
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN)
    from proofplane.api.app import create_app

    gpus = FakeNvml(h100_node())
    with TestClient(
        create_app(store), raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN}"},
    ) as admin:  # fmt: skip
        ok(admin.post(f"{API}/nodes", json=node_body("gpu-e")), 201)
        ok(admin.put(f"{API}/attestation/policy", json={"policy": golden_policy(log)}))
        token = ok(admin.post(f"{API}/nodes/gpu-e/agent-credentials", json={}), 201)["token"]
        hw = Tpm(tpm.tcti, tpm.workdir)
        api = agent_client(admin, token)

        def round_(nvml_module: Any) -> dict[str, Any]:
            return attest_once(api, "gpu-e", hw, ak=ecc_ak, ek=ecc_ek, eventlog=log,
                               inventory=gpu_inventory(None, nvml_module))  # fmt: skip

        first = round_(gpus)
        assert first["verdict"]["ok"], first["verdict"]
        assert first["state"] == "admitted"
        # a GPU reflashed with a VBIOS off the allow-list quarantines the node
        gpus.gpus[3].vbios = "96.00.30.00.01"
        second = round_(gpus)
        assert second["verdict"]["reasons"] == ["vbios_not_allowed"]
        assert second["state"] == "quarantined"
        # no NVML on the node: no inventory is sent, and the policy needs one
        gone = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        assert round_(gone)["verdict"]["reasons"] == ["inventory_missing"]
    store.dispose()
