"""The audit API end to end (SQLite and PostgreSQL): checkpoints that verify, proofs that
verify against them, entries that recompute, and refusals of out-of-range requests."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest

from proofplane.audit import merkle, note
from proofplane.service import audit as audit_svc

API = "/api/v1/audit"


def _make_events(client, n: int = 6, prefix: str = "t") -> None:
    for i in range(n):
        r = client.post("/api/v1/tenants", json={"name": f"{prefix}{i}"})
        assert r.status_code == 201, r.text


def test_checkpoint_proofs_and_entries(client):
    assert client.get(f"{API}/checkpoint").json()["error"]["code"] == "no_checkpoint"
    _make_events(client)
    r = client.post(f"{API}/checkpoint")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    signed = r.text
    vkey = client.get(f"{API}/key").text.strip()
    cp = note.verify_checkpoint(signed, note.parse_verifier_key(vkey), origin="proofplane/default")
    assert client.get(f"{API}/checkpoint").text == signed
    n = cp.size
    assert n >= 6

    entries = client.get(f"{API}/entries", params={"start": 0, "end": n}).json()["entries"]
    assert [e["index"] for e in entries] == list(range(n))
    raw = [base64.b64decode(e["entry"]) for e in entries]
    for e, b in zip(entries, raw, strict=True):
        assert merkle.leaf_hash(b).hex() == e["leaf_hash"]
    assert merkle.root(raw) == cp.root_hash

    for i in range(n):
        p = client.get(f"{API}/proof/inclusion", params={"index": i, "tree_size": n}).json()
        assert p["index"] == i and p["tree_size"] == n
        proof = [bytes.fromhex(h) for h in p["proof"]]
        assert merkle.verify_inclusion(bytes.fromhex(p["leaf_hash"]), i, n, proof, cp.root_hash)

    _make_events(client, 3, prefix="u")
    cp2 = note.verify_checkpoint(
        client.post(f"{API}/checkpoint").text, note.parse_verifier_key(vkey)
    )
    c = client.get(f"{API}/proof/consistency", params={"old_size": n, "new_size": cp2.size})
    body = c.json()
    assert (body["old_size"], body["new_size"]) == (n, cp2.size)
    proof = [bytes.fromhex(h) for h in body["proof"]]
    assert merkle.verify_consistency(n, cp2.size, cp.root_hash, cp2.root_hash, proof)


@pytest.mark.parametrize(
    "path,params,status",
    [
        ("/proof/inclusion", {"index": 99, "tree_size": 3}, 400),
        ("/proof/inclusion", {"index": 0, "tree_size": 10_000}, 400),
        ("/proof/inclusion", {"index": -1, "tree_size": 3}, 422),
        ("/proof/inclusion", {"index": 0, "tree_size": 0}, 422),
        ("/proof/inclusion", {"index": "x", "tree_size": 3}, 422),
        ("/proof/consistency", {"old_size": 4, "new_size": 3}, 400),
        ("/proof/consistency", {"old_size": 1, "new_size": 10_000}, 400),
        ("/proof/consistency", {"old_size": -1, "new_size": 3}, 422),
        ("/entries", {"start": 2, "end": 1}, 400),
        ("/entries", {"start": 0, "end": 10_000}, 400),
        ("/entries", {"start": -5, "end": 1}, 422),
    ],
)
def test_bad_requests_are_4xx(client, path, params, status):
    _make_events(client, 3)
    r = client.get(API + path, params=params)
    assert r.status_code == status, r.text
    assert "error" in r.json()


def test_key_file_is_created_0600_and_reused(tmp_path: Path):
    path = tmp_path / "keys" / "k"
    a = audit_svc.load_or_create_signer(path, "proofplane/x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert audit_svc.load_or_create_signer(path, "proofplane/x").seed == a.seed
    path.chmod(0o644)
    with pytest.raises(Exception, match="readable by others"):
        audit_svc.load_or_create_signer(path, "proofplane/x")
