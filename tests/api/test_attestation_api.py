"""The attestation API on SQLite and PostgreSQL, with keys held in software: enrollment
(MakeCredential answered by a software ActivateCredential), duplicate EK, a passing round that
admits, replayed nonce, staleness, policies, and bad input (4xx with a code, never 500).

The real-TPM scenario is ``test_attestation_swtpm.py``; here the "TPM" is a software one so
that the same flow runs cheaply on both stores.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from fastapi.testclient import TestClient

from proofplane.access import SYSTEM
from proofplane.attest import Evidence, tpm
from proofplane.attest.credential import CFB, TOOLS_MAGIC, kdfa
from proofplane.attest.simulate import SoftTpm
from proofplane.service import attestation as svc
from proofplane.service.context import Store

API = "/api/v1"
EK_ATTRS = (
    tpm.FIXED_TPM | tpm.FIXED_PARENT | tpm.SENSITIVE_DATA_ORIGIN | tpm.RESTRICTED | tpm.DECRYPT
)
POLICY = {"id": "soft", "node_class": "default", "require_eventlog": False,
          "require_secure_boot": False, "require_inventory": False}  # fmt: skip


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _tpm2b(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


@dataclass
class SoftNode:
    """An RSA EK and an ECC AK in software, with the TPM's side of ActivateCredential."""

    ek: rsa.RSAPrivateKey
    soft: SoftTpm

    @classmethod
    def make(cls) -> SoftNode:
        return cls(
            rsa.generate_private_key(65537, 2048), SoftTpm(ec.generate_private_key(ec.SECP256R1()))
        )

    @property
    def ek_public(self) -> bytes:
        n = self.ek.public_key().public_numbers().n.to_bytes(256, "big")
        head = struct.pack(">HHI", tpm.TPM_ALG_RSA, tpm.TPM_ALG_SHA256, EK_ATTRS) + _tpm2b(b"")
        params = struct.pack(
            ">HHHHHI", tpm.TPM_ALG_AES, 128, tpm.TPM_ALG_CFB, tpm.TPM_ALG_NULL, 2048, 0
        )
        return head + params + _tpm2b(n)

    @property
    def ak_public(self) -> bytes:
        return self.soft.ak_public

    def activate(self, credential_file: bytes) -> bytes:
        magic, _version = struct.unpack(">II", credential_file[:8])
        assert magic == TOOLS_MAGIC
        rest = credential_file[8:]
        size = int.from_bytes(rest[:2], "big")
        id_object, rest = rest[2 : 2 + size], rest[2 + size :]
        enc_seed = rest[2 : 2 + int.from_bytes(rest[:2], "big")]
        hmac_size = int.from_bytes(id_object[:2], "big")
        enc_identity = id_object[2 + hmac_size :]
        h = hashes.SHA256()
        seed = self.ek.decrypt(
            enc_seed, padding.OAEP(mgf=padding.MGF1(h), algorithm=h, label=b"IDENTITY\0")
        )
        ak_name = tpm.parse_public(self.ak_public).name
        key = kdfa(tpm.TPM_ALG_SHA256, seed, b"STORAGE", ak_name, b"", 128)
        dec = Cipher(algorithms.AES(key), CFB(bytes(16))).decryptor()
        plain = dec.update(enc_identity) + dec.finalize()
        return plain[2 : 2 + int.from_bytes(plain[:2], "big")]

    def quote(self, nonce: bytes, pcrs: list[int]) -> Evidence:
        qn = tpm.ak_qualified_name(
            tpm.parse_public(self.ek_public), tpm.parse_public(self.ak_public)
        )
        self.soft._name = lambda: qn  # type: ignore[method-assign]  # a TPM reports the QN
        return Evidence(*self.soft.quote(nonce, pcrs))


def node_body(name: str) -> dict[str, Any]:
    return {"name": name, "region": "r1", "zone": "z1",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "model": "H100-80GB"}]}  # fmt: skip


def err(resp: Any, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code, resp.text


def enroll(client: TestClient, name: str, node: SoftNode) -> dict[str, Any]:
    r = client.post(
        f"{API}/nodes/{name}/attestation/enroll",
        json={"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ak_public)},
    )
    assert r.status_code == 200, r.text
    secret = node.activate(base64.b64decode(r.json()["credential"]))
    r = client.post(f"{API}/nodes/{name}/attestation/activate", json={"secret": _b64(secret)})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def round_(
    client: TestClient, name: str, node: SoftNode, inventory: dict[str, Any] | None = None
) -> dict[str, Any]:
    issued = client.post(f"{API}/nodes/{name}/attestation/nonce").json()
    ev = node.quote(bytes.fromhex(issued["nonce"]), issued["pcrs"])
    if inventory is not None:
        ev = replace(ev, inventory=inventory)
    r = client.post(f"{API}/nodes/{name}/attestation/evidence",
                    json={"nonce": issued["nonce"], "evidence": ev.to_json()})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_enroll_attest_admit_replay_and_stale(client: TestClient, store: Store) -> None:
    client.post(f"{API}/nodes", json=node_body("n1")).raise_for_status()
    client.post(f"{API}/nodes", json=node_body("n2")).raise_for_status()
    r = client.put(f"{API}/attestation/policy", json={"policy": POLICY})
    assert r.status_code == 200 and r.json()["enforce"] is True
    node = SoftNode.make()
    err(client.post(f"{API}/nodes/n1/attestation/nonce"), 409, "not_enrolled")

    # a wrong answer to the challenge does not bind the AK
    r = client.post(
        f"{API}/nodes/n1/attestation/enroll",
        json={"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ak_public)},
    )
    assert r.status_code == 200
    err(client.post(f"{API}/nodes/n1/attestation/activate", json={"secret": _b64(b"x" * 32)}),
        422, "activation_failed")  # fmt: skip
    status = enroll(client, "n1", node)
    assert status["bound"] and status["state"] == "registered"
    err(
        client.post(f"{API}/nodes/n1/attestation/enroll",
                    json={"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ak_public)}),
        409, "already_enrolled",
    )  # fmt: skip
    # the same EK for another node: refused
    err(
        client.post(f"{API}/nodes/n2/attestation/enroll",
                    json={"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ak_public)}),
        409, "duplicate_ek",
    )  # fmt: skip

    first = round_(client, "n1", node)
    assert first["verdict"]["ok"], first["verdict"]
    assert first["state"] == "admitted"

    # replay the same nonce and evidence
    issued = client.post(f"{API}/nodes/n1/attestation/nonce").json()
    ev = node.quote(bytes.fromhex(issued["nonce"]), issued["pcrs"]).to_json()
    body = {"nonce": issued["nonce"], "evidence": ev}
    assert client.post(f"{API}/nodes/n1/attestation/evidence", json=body).json()["verdict"]["ok"]
    again = client.post(f"{API}/nodes/n1/attestation/evidence", json=body).json()
    assert again["verdict"]["reasons"] == ["nonce_replayed"] and again["state"] == "quarantined"
    err(client.post(f"{API}/nodes/n1/state", json={"state": "admitted"}), 409,
        "attestation_required")  # fmt: skip
    assert round_(client, "n1", node)["state"] == "admitted"

    st = client.get(f"{API}/nodes/n1/attestation").json()
    assert st["latest"]["ok"] and st["last_clock"]["clock"] > 0
    items = client.get(f"{API}/nodes/n1/evidence", params={"records": "false"}).json()["items"]
    assert [i["ok"] for i in items] == [True, False, True, True]
    assert "record" not in items[0]

    later = datetime.now(UTC) + timedelta(hours=2)
    assert svc.check_stale(store, SYSTEM, timedelta(minutes=5), now=later) == ["n1"]
    assert client.get(f"{API}/nodes/n1").json()["state"] == "quarantined"


def test_agent_credential_acts_only_for_its_node(client: TestClient) -> None:
    for name in ("n1", "n2"):
        client.post(f"{API}/nodes", json=node_body(name)).raise_for_status()
    client.put(f"{API}/attestation/policy", json={"policy": POLICY}).raise_for_status()
    token = client.post(f"{API}/nodes/n1/agent-credentials", json={}).json()["token"]
    agent = {"Authorization": f"Bearer {token}"}
    node = SoftNode.make()
    body = {"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ak_public)}
    err(client.post(f"{API}/nodes/n2/attestation/enroll", json=body, headers=agent),
        404, "not_found")  # fmt: skip
    err(client.post(f"{API}/nodes/n2/attestation/nonce", headers=agent), 404, "not_found")
    assert client.post(f"{API}/nodes/n1/attestation/enroll", json=body,
                       headers=agent).status_code == 200  # fmt: skip
    # the agent reads nothing and sets no policy
    err(client.get(f"{API}/nodes/n1/evidence", headers=agent), 403, "forbidden")
    err(client.put(f"{API}/attestation/policy", json={"policy": POLICY}, headers=agent),
        403, "forbidden")  # fmt: skip


BAD_INPUT: list[tuple[str, Any, int, str]] = [
    ("enroll", {"ek_public": "not base64!", "ak_public": "AAAA"}, 422, "invalid_base64"),
    ("enroll", {"ek_public": "AAAA", "ak_public": "AAAA"}, 422, "ek_invalid"),
    ("enroll", {"ek_public": "AAAA"}, 422, "validation_failed"),
    ("enroll", [], 422, "validation_failed"),
    ("activate", {"secret": "%%%"}, 422, "invalid_base64"),
    ("evidence", {"nonce": "abc", "evidence": {}}, 422, "validation_failed"),
    ("evidence", {"nonce": "00" * 32, "evidence": {}}, 422, "evidence_malformed"),
    (
        "evidence",
        {"nonce": "00" * 32, "evidence": {"pcrs": {"sha256": {"x": "00"}}}},
        422,
        "evidence_malformed",
    ),  # fmt: skip
    (
        "evidence",
        {"nonce": "00" * 32, "evidence": {"pcrs": {}, "quote": 5}},
        422,
        "evidence_malformed",
    ),  # fmt: skip
]


def test_bad_input_is_a_4xx_with_a_code(client: TestClient) -> None:
    client.post(f"{API}/nodes", json=node_body("n1")).raise_for_status()
    for path, body, status, code in BAD_INPUT:
        err(client.post(f"{API}/nodes/n1/attestation/{path}", json=body), status, code)


def test_enroll_checks_keys_and_unknown_nodes(client: TestClient) -> None:
    client.post(f"{API}/nodes", json=node_body("n1")).raise_for_status()
    node = SoftNode.make()
    # the EK as AK: a decryption key, not a signing attestation key
    body = {"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ek_public)}
    err(client.post(f"{API}/nodes/n1/attestation/enroll", json=body), 422,
        "ak_attributes_invalid")  # fmt: skip
    # an ECC key as EK: not supported for MakeCredential
    body = {"ek_public": _b64(node.ak_public), "ak_public": _b64(node.ak_public)}
    err(client.post(f"{API}/nodes/n1/attestation/enroll", json=body), 422, "ek_unsupported")
    body = {"ek_public": _b64(node.ek_public), "ak_public": _b64(node.ak_public)}
    err(client.post(f"{API}/nodes/ghost/attestation/enroll", json=body), 404, "not_found")
    err(client.get(f"{API}/nodes/ghost/evidence"), 404, "not_found")
    err(client.post(f"{API}/nodes/n1/attestation/activate", json={"secret": "AAAA"}), 409,
        "no_challenge")  # fmt: skip


def test_policies(client: TestClient) -> None:
    assert client.get(f"{API}/attestation/policy").json() == {"items": []}
    err(client.put(f"{API}/attestation/policy", json={"policy": {"golden": {}}}), 422,
        "policy_invalid")  # fmt: skip
    err(client.put(f"{API}/attestation/policy", json={"policy": {"min_driver": "x.y"}}), 422,
        "version_invalid")  # fmt: skip
    err(client.put(f"{API}/attestation/policy", json={"policy": "x"}), 422, "validation_failed")
    r = client.put(f"{API}/attestation/policy",
                   json={"policy": {**POLICY, "node_class": "h100"}, "enforce": False})  # fmt: skip
    assert r.status_code == 200 and r.json()["enforce"] is False
    items = client.get(f"{API}/attestation/policy").json()["items"]
    assert [p["node_class"] for p in items] == ["h100"] and len(items[0]["policy_hash"]) == 64
    # a node without policy cannot be attested: fail closed
    client.post(f"{API}/nodes", json=node_body("n1")).raise_for_status()
    enroll(client, "n1", SoftNode.make())
    err(client.post(f"{API}/nodes/n1/attestation/nonce"), 409, "attestation_policy_missing")


def test_a_passing_round_takes_the_nvlink_domain_its_inventory_names(client: TestClient) -> None:
    """Issue 17 §4: the NVML collector names the node's NVLink domain from the GPUs' fabric; a
    passing round's inventory sets it on the node (a node.update event says so); a failing
    round's, or a name that is not a domain, changes nothing."""
    client.post(f"{API}/nodes", json=node_body("n1")).raise_for_status()
    client.put(f"{API}/attestation/policy", json={"policy": POLICY}).raise_for_status()
    node = SoftNode.make()
    enroll(client, "n1", node)
    domain = "nvl-0123456789abcdef0123456789abcdef-7"
    inventory = {"gpus": [], "topology": {"nvlink_domain": domain}}
    assert round_(client, "n1", node, inventory)["verdict"]["ok"] is True
    assert client.get(f"{API}/nodes/n1").json()["topology"] == {"nvlink_domain": domain}
    updates = client.get(f"{API}/events", params={"action": "node.update"}).json()["items"]
    assert updates[-1]["details"]["source"] == "attested inventory"
    assert updates[-1]["details"]["topology"]["after"] == {"nvlink_domain": domain}
    round_(client, "n1", node, {"gpus": [], "topology": {"nvlink_domain": "Not A Name"}})
    round_(client, "n1", node, inventory)  # the same again: no new event
    assert client.get(f"{API}/nodes/n1").json()["topology"] == {"nvlink_domain": domain}
    again = client.get(f"{API}/events", params={"action": "node.update"}).json()["items"]
    assert len(again) == len(updates)
