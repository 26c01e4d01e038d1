"""proofplane.audit.merkle.CompactRange, the one right edge of the log: its root is
``merkle.root`` at every size, its edge is the tree hash of every ``range_nodes(0, size)``
subtree, the hashes ``extend`` hands back are exactly what the database stores at the ids
``store.audit_log.node_id`` names, and a hash that is not 32 bytes is refused."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ci import SHARED
from proofplane.audit import merkle
from proofplane.audit.merkle import CompactRange, leaf_hash, node_hash, root, root_of_hashes
from proofplane.store import audit_log

VECTORS = SHARED / "data" / "merkle-vectors"

ENTRIES = [b"entry %d" % i for i in range(301)]
LEAVES = [leaf_hash(e) for e in ENTRIES]


def _subtree(leaves: list[bytes], level: int, index: int) -> bytes:
    return root_of_hashes(leaves[index << level : (index + 1) << level])


# --- vectors ------------------------------------------------------------------------------


def test_node_hash_is_the_rfc_interior_node():
    a, b = LEAVES[0], LEAVES[1]
    assert node_hash(a, b) == hashlib.sha256(b"\x01" + a + b).digest()
    assert root(ENTRIES[:2]) == node_hash(a, b)


def test_rfc6962_reference_tree_roots():
    rfc = json.loads((VECTORS / "rfc6962_vectors.json").read_text())
    leaves = [leaf_hash(bytes.fromhex(x)) for x in rfc["reference_tree"]["leaf_inputs"]]
    want = rfc["reference_tree"]["roots_by_tree_size"]
    tree = CompactRange()
    assert tree.root().hex() == want["0"]
    for n, leaf in enumerate(leaves, 1):
        tree.append(leaf)
        assert tree.root().hex() == want[str(n)]


def test_the_empty_range():
    tree = CompactRange()
    assert tree.size == 0 and tree.hashes == [] and tree.root() == merkle.EMPTY_ROOT
    assert tree.extend([]) == [] and tree == CompactRange(0, [])


# --- every size up to 300 -------------------------------------------------------------------


def test_root_and_edge_at_every_size_up_to_300():
    tree = CompactRange()
    for n in range(301):
        assert tree.size == n
        assert tree.root() == root(ENTRIES[:n]) == root_of_hashes(LEAVES[:n])
        nodes = merkle.range_nodes(0, n)
        assert tree.hashes == [_subtree(LEAVES, lv, ix) for lv, ix in nodes]
        assert len(tree.hashes) == n.bit_count()
        # the edge read back from storage resumes the same range
        assert CompactRange(n, tree.hashes) == tree
        if n < 300:
            tree.append(LEAVES[n])


def test_extend_returns_what_the_log_stores_at_every_size_up_to_300():
    tree = CompactRange()
    stored = tree.extend(LEAVES[:300])
    assert len(stored) == audit_log.stored_before(300)
    for n in range(1, 301):
        for level in range(n.bit_length()):
            if (n >> level) << level != n:  # leaf n-1 completes the subtrees it ends
                break
            index = (n >> level) - 1
            assert stored[audit_log.node_id(level, index)] == _subtree(LEAVES, level, index)
    # batch by batch, from every size: the same hashes, in the same order
    for split in range(301):
        first = CompactRange()
        head = first.extend(LEAVES[:split])
        resumed = CompactRange(first.size, first.hashes)
        tail = resumed.extend(LEAVES[split:300])
        assert head + tail == stored
        assert len(head) == audit_log.stored_before(split)
        assert resumed == tree


def test_append_equals_extend():
    one, bulk = CompactRange(), CompactRange()
    for leaf in LEAVES[:129]:
        one.append(leaf)
    bulk.extend(iter(LEAVES[:129]))  # any iterable
    assert one == bulk and one.root() == bulk.root()


def test_the_appender_stores_the_compact_range_hashes():
    appender = audit_log.Appender()
    appender.append_leaves(LEAVES[:37])
    for leaf in LEAVES[37:100]:
        appender.append_leaf(leaf)
    assert appender.size == 100
    assert appender.pending == CompactRange().extend(LEAVES[:100])
    assert appender.root() == root(ENTRIES[:100])


def test_append_subtree_equals_its_leaves():
    for n in range(0, 65):
        for level in range(7):
            if n % (1 << level):
                continue
            leaves = LEAVES[n : n + (1 << level)]
            by_leaf = CompactRange()
            by_leaf.extend(LEAVES[:n] + leaves)
            by_node = CompactRange()
            by_node.extend(LEAVES[:n])
            by_node.append_subtree(level, root_of_hashes(leaves))
            assert by_node == by_leaf


def test_copy_is_independent():
    tree = CompactRange()
    tree.extend(LEAVES[:5])
    other = tree.copy()
    other.append(LEAVES[5])
    assert tree.size == 5 and other.size == 6 and tree != other
    assert tree.root() == root(ENTRIES[:5])


# --- hypothesis -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=12))
def test_any_batching_gives_one_tree(batches):
    total = sum(batches)
    entries = [b"h%d" % i for i in range(total)]
    leaves = [leaf_hash(e) for e in entries]
    tree, stored, pos = CompactRange(), [], 0
    for k in batches:
        tree = CompactRange(tree.size, tree.hashes)  # as if reloaded between transactions
        stored += tree.extend(leaves[pos : pos + k])
        pos += k
        assert tree.root() == root(entries[:pos])
    assert stored == CompactRange().extend(leaves)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 70))
def test_large_random_sizes(start, more):
    leaves = [hashlib.sha256(b"%d" % i).digest() for i in range(start + more)]
    tree = CompactRange()
    tree.extend(leaves[:start])
    assert tree.hashes == [_subtree(leaves, lv, ix) for lv, ix in merkle.range_nodes(0, start)]
    stored = tree.extend(leaves[start:])
    assert len(stored) == audit_log.stored_before(start + more) - audit_log.stored_before(start)
    assert tree.root() == root_of_hashes(leaves)


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error"),
    [(b"\x00" * 31, ValueError), (b"\x00" * 33, ValueError), (b"", ValueError),
     ("0" * 32, TypeError), (bytearray(32), TypeError), (None, TypeError)],
)  # fmt: skip
def test_a_hash_that_is_not_32_bytes_is_refused(bad, error):
    tree = CompactRange()
    tree.extend(LEAVES[:3])
    before = tree.copy()
    with pytest.raises(error, match="32 bytes"):
        tree.append(bad)
    with pytest.raises(error, match="32 bytes"):
        tree.extend([LEAVES[3], bad])  # nothing of the batch is taken
    with pytest.raises(error, match="32 bytes"):
        tree.append_subtree(0, bad)
    with pytest.raises(error, match="32 bytes"):
        CompactRange(1, [bad])
    assert tree == before


def test_an_edge_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="3 edge hashes, not 2"):
        CompactRange(7, LEAVES[:2])
    with pytest.raises(ValueError, match="not negative"):
        CompactRange(-1)


def test_a_subtree_that_is_not_aligned_is_refused():
    tree = CompactRange()
    tree.extend(LEAVES[:6])
    with pytest.raises(ValueError, match="not aligned"):
        tree.append_subtree(2, LEAVES[0])  # 6 is no multiple of 4
    with pytest.raises(ValueError, match="not aligned"):
        tree.append_subtree(-1, LEAVES[0])
    tree.append_subtree(1, node_hash(LEAVES[6], LEAVES[7]))
    assert tree.root() == root(ENTRIES[:8])


def test_a_compact_range_is_not_hashable():
    with pytest.raises(TypeError):
        hash(CompactRange())
