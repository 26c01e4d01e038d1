"""proofplane.audit.merkle against every published vector in ../shared/data/merkle-vectors
(including the tampered probes a verifier must reject), and against hypothesis."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ci import SHARED
from proofplane.audit import merkle
from proofplane.audit.merkle import (
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root,
    verify_consistency,
    verify_inclusion,
)

VECTORS = SHARED / "data" / "merkle-vectors"
RFC = json.loads((VECTORS / "rfc6962_vectors.json").read_text())
TILES = json.loads((VECTORS / "tlog_tiles_vectors.json").read_text())
H = bytes.fromhex


def _hx(value: str) -> bytes:
    return bytes.fromhex(value)


def test_public_surface_is_exactly_the_six_functions():
    assert sorted(merkle.__all__) == sorted(
        [
            "leaf_hash",
            "root",
            "inclusion_proof",
            "consistency_proof",
            "verify_inclusion",
            "verify_consistency",
        ]
    )


def test_hasher_vectors():
    hv = RFC["hasher_vectors"]
    assert root([]).hex() == hv["empty_tree_root"]["hash"]
    for v in hv["leaf"]:
        assert leaf_hash(H(v["input_hex"])).hex() == v["hash"]
    for v in hv["node"]:
        assert merkle.node_hash(H(v["left"]), H(v["right"])).hex() == v["hash"]


LEAVES = [H(x) for x in RFC["reference_tree"]["leaf_inputs"]]


@pytest.mark.parametrize("size", range(len(LEAVES) + 1))
def test_reference_roots(size):
    want = RFC["reference_tree"]["roots_by_tree_size"][str(size)]
    assert root(LEAVES[:size]).hex() == want


def test_reference_node_hashes_by_level():
    levels = RFC["reference_tree"]["node_hashes_by_level"]["levels"]
    for k, level in enumerate(levels):
        for i, want in enumerate(level):
            assert (
                merkle.root_of_hashes([leaf_hash(e) for e in LEAVES[i << k : (i + 1) << k]]).hex()
                == want
            )


@pytest.mark.parametrize(
    "v", RFC["inclusion_proofs"], ids=lambda v: f"{v['leaf_index']}@{v['tree_size']}"
)
def test_inclusion_vectors(v):
    leaves = LEAVES if v["tree_size"] <= len(LEAVES) else None
    assert leaves is not None
    proof = inclusion_proof(leaves, v["leaf_index"], v["tree_size"])
    assert [p.hex() for p in proof] == v["path"]
    assert leaf_hash(H(v["leaf_input"])).hex() == v["leaf_hash"]
    assert verify_inclusion(H(v["leaf_hash"]), v["leaf_index"], v["tree_size"], proof, H(v["root"]))


@pytest.mark.parametrize("v", RFC["consistency_proofs"], ids=lambda v: f"{v['size1']}-{v['size2']}")
def test_consistency_vectors(v):
    proof = consistency_proof(LEAVES, v["size1"], v["size2"])
    assert [p.hex() for p in proof] == v["proof"]
    assert verify_consistency(v["size1"], v["size2"], H(v["root1"]), H(v["root2"]), proof)


@pytest.mark.parametrize("p", RFC["probes"]["inclusion"], ids=lambda p: p["file"])
def test_inclusion_probes(p):
    ok = verify_inclusion(
        H(p["leafHash"]), p["leafIdx"], p["treeSize"], [H(x) for x in p["proof"]], H(p["root"])
    )
    assert ok is (not p["want_error"])


@pytest.mark.parametrize("p", RFC["probes"]["consistency"], ids=lambda p: p["file"])
def test_consistency_probes(p):
    ok = verify_consistency(
        p["size1"], p["size2"], H(p["root1"]), H(p["root2"]), [H(x) for x in p["proof"]]
    )
    assert ok is (not p["want_error"])


def test_happy_probes_are_reproduced_by_our_prover():
    """The probes' happy paths come from a 8-leaf tree over the reference leaves."""
    for p in RFC["probes"]["inclusion"]:
        if not p["want_error"] and p["treeSize"] <= len(LEAVES) and p["proof"]:
            got = inclusion_proof(LEAVES, p["leafIdx"], p["treeSize"])
            assert [x.hex() for x in got] == p["proof"]
    for p in RFC["probes"]["consistency"]:
        if not p["want_error"] and p["size2"] <= len(LEAVES) and p["proof"]:
            got = consistency_proof(LEAVES, p["size1"], p["size2"])
            assert [x.hex() for x in got] == p["proof"]


# --- draft-ietf-plants-merkle-tree-certs subtree vectors (130 leaves) ---------------------

ROLL = RFC["rolling_hash_vectors_130_leaves"]
D130 = [bytes([i]) for i in range(ROLL["leaf_count"])]


def _valid_subtree(start: int, end: int) -> bool:
    if start == 0 or start == end:
        return True
    width = 1 << (end - start - 1).bit_length()  # bit_ceil(end - start)
    return start % width == 0


def test_subtree_hash_rolling_vector():
    """Every valid subtree [start, end) of the 130-leaf tree hashes as our root() says."""
    digest = hashlib.sha256()
    for end in range(len(D130) + 1):
        for start in range(end + 1):
            if _valid_subtree(start, end):
                digest.update(f"[{start}, {end}) {root(D130[start:end]).hex()}\n".encode())
    assert digest.hexdigest() == ROLL["subtree_hash_sha256_of_lines"]


def test_subtree_inclusion_rolling_vector():
    """A leaf's inclusion proof in a subtree is its RFC 9162 path in that subtree's leaves."""
    digest = hashlib.sha256()
    for end in range(len(D130) + 1):
        for start in range(end):
            if not _valid_subtree(start, end):
                continue
            for index in range(start, end):
                proof = inclusion_proof(D130[start:end], index - start, end - start)
                line = f"{index} [{start}, {end})" + "".join(" " + h.hex() for h in proof)
                digest.update((line + "\n").encode())
    assert digest.hexdigest() == ROLL["subtree_inclusion_sha256_of_lines"]


# --- tlog-tiles: a log written by Tessera -------------------------------------------------


def test_tessera_log_roots_and_level0_tiles():
    entries = [e.encode() for e in TILES["entries_ascii"]]
    for size_text, note in TILES["checkpoints"].items():
        size = int(size_text)
        body = note.split("\n\n")[0].split("\n")
        assert body[0] == TILES["origin"] and int(body[1]) == size
        import base64

        assert root(entries[:size]) == base64.b64decode(body[2])
    for name, tile_hex in TILES["tile_level0_partial_hex"].items():
        width = int(name.rsplit("/", 1)[1])
        assert b"".join(leaf_hash(e) for e in entries[:width]).hex() == tile_hex


# --- hypothesis ---------------------------------------------------------------------------

entries_st = st.lists(st.binary(max_size=8), min_size=1, max_size=70)


def _naive_root(entries):
    """RFC 6962 §2.1 MTH, literally recursive: the oracle for our iterative root."""
    if not entries:
        return hashlib.sha256(b"").digest()
    if len(entries) == 1:
        return leaf_hash(entries[0])
    k = 1 << ((len(entries) - 1).bit_length() - 1)
    return merkle.node_hash(_naive_root(entries[:k]), _naive_root(entries[k:]))


@settings(max_examples=150, deadline=None)
@given(entries_st, st.data())
def test_inclusion_roundtrip_and_tamper(entries, data):
    n = data.draw(st.integers(1, len(entries)))
    i = data.draw(st.integers(0, n - 1))
    r = root(entries[:n])
    assert r == _naive_root(entries[:n])
    proof = inclusion_proof(entries, i, n)
    lh = leaf_hash(entries[i])
    assert verify_inclusion(lh, i, n, proof, r)
    if n > 1:
        assert (
            not verify_inclusion(lh, (i + 1) % n, n, proof, r) or entries[(i + 1) % n] == entries[i]
        )
    assert not verify_inclusion(lh, i, n, [*proof, r], r)
    if proof:
        j = data.draw(st.integers(0, len(proof) - 1))
        bad = list(proof)
        bad[j] = bytes([bad[j][0] ^ 1]) + bad[j][1:]
        assert not verify_inclusion(lh, i, n, bad, r)


@settings(max_examples=150, deadline=None)
@given(entries_st, st.data())
def test_consistency_roundtrip_and_tamper(entries, data):
    new = data.draw(st.integers(1, len(entries)))
    old = data.draw(st.integers(1, new))
    proof = consistency_proof(entries, old, new)
    r1, r2 = root(entries[:old]), root(entries[:new])
    assert verify_consistency(old, new, r1, r2, proof)
    if old < new:
        assert not verify_consistency(old, new, r2, r1, proof) or r1 == r2
        other = list(entries[:new])
        k = data.draw(st.integers(0, old - 1))
        other[k] = other[k] + b"!"
        assert not verify_consistency(old, new, root(other[:old]), r2, proof)
    if proof:
        assert not verify_consistency(old, new, r1, r2, proof[:-1])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5000), st.data())
def test_proof_ranges_decompose_into_complete_subtrees(n, data):
    """range_nodes + fold_range rebuild a range hash from complete subtrees only (what the
    database stores)."""
    i = data.draw(st.integers(0, n - 1))
    ranges = merkle.inclusion_ranges(i, n)
    assert len(ranges) <= max(1, n.bit_length())
    for a, b in ranges + merkle.consistency_ranges(data.draw(st.integers(1, n)), n):
        nodes = merkle.range_nodes(a, b)
        assert len(nodes) <= (b - a).bit_length()
        covered = []
        for level, idx in nodes:
            covered.extend(range(idx << level, (idx + 1) << level))
        assert covered == list(range(a, b))


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        inclusion_proof([b"a"], 1, 1)
    with pytest.raises(ValueError):
        inclusion_proof([b"a"], -1, 1)
    with pytest.raises(ValueError):
        inclusion_proof([b"a"], 0, 2)
    with pytest.raises(ValueError):
        consistency_proof([b"a", b"b"], 2, 1)
    assert not verify_inclusion(b"short", 0, 1, [], b"x" * 32)
    assert not verify_inclusion(b"x" * 32, -1, 1, [], b"x" * 32)
