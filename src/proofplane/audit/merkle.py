"""RFC 9162 (RFC 6962) Merkle tree hashing, proofs and proof verification. Pure.

leaf = SHA-256(0x00 ‖ entry), node = SHA-256(0x01 ‖ left ‖ right), the empty tree hashes to
SHA-256(""). The six functions of ``__all__`` are what auditors and our own tools call; they
take values and return values (entries are the raw entry bytes, proofs are lists of 32-byte
hashes). The other public names below are the building blocks our log storage and verifiers
share (no caller reaches for a private one).

The proof functions are also written over *ranges*: every hash in an RFC 6962 proof is the
Merkle tree hash of a contiguous range of leaves ``[start, end)`` whose ``start`` is aligned
to the largest power of two not above its length. ``inclusion_ranges`` and
``consistency_ranges`` return those ranges, and ``range_nodes`` splits a range into complete,
aligned subtrees, so the database-backed log (``proofplane.store.audit_log``) answers a proof by
reading O(log n) stored subtree hashes, with no scan.

``CompactRange`` is the one right edge of a growing tree (the idea of transparency-dev/merkle's
``compact.Range``, for ranges that start at leaf 0): the log's appender, the verifiers and the
benchmarks push leaves through it and read its root; ``extend`` also returns the hashes the
database keeps for the new leaves. ``node_hash`` and ``root_of_hashes`` are the interior-node
hash and the tree hash over leaf hashes, for callers that already hold hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

__all__ = [
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "root",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()

_sha256 = hashlib.sha256


def leaf_hash(entry: bytes) -> bytes:
    """RFC 9162 leaf hash: SHA-256(0x00 ‖ entry)."""
    return _sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 interior node hash: SHA-256(0x01 ‖ left ‖ right)."""
    return _sha256(b"\x01" + left + right).digest()


def root(entries: Sequence[bytes]) -> bytes:
    """The Merkle tree hash MTH(D[n]) of the entries (SHA-256("") for none)."""
    return root_of_hashes([leaf_hash(e) for e in entries])


def inclusion_proof(entries: Sequence[bytes], index: int, tree_size: int) -> list[bytes]:
    """PATH(index, D[tree_size]), ordered leaf to root. Raises ValueError when index is not
    in the tree or tree_size exceeds the entries given."""
    _check_tree_size(tree_size, len(entries))
    if not 0 <= index < tree_size:
        raise ValueError(f"index {index} is outside a tree of size {tree_size}")
    leaves = [leaf_hash(e) for e in entries[:tree_size]]
    return [root_of_hashes(leaves[a:b]) for a, b in inclusion_ranges(index, tree_size)]


def consistency_proof(entries: Sequence[bytes], old_size: int, new_size: int) -> list[bytes]:
    """PROOF(old_size, D[new_size]) (RFC 6962 §2.1.2). Empty when the sizes are equal or the
    old tree is empty. Raises ValueError for sizes out of order or beyond the entries."""
    _check_tree_size(new_size, len(entries))
    if not 0 <= old_size <= new_size:
        raise ValueError(f"old size {old_size} must be between 0 and the new size {new_size}")
    leaves = [leaf_hash(e) for e in entries[:new_size]]
    return [root_of_hashes(leaves[a:b]) for a, b in consistency_ranges(old_size, new_size)]


def verify_inclusion(
    leaf_hash: bytes, index: int, tree_size: int, proof: Sequence[bytes], root: bytes
) -> bool:
    """RFC 9162 §2.1.3.2: does ``proof`` show the leaf at ``index`` in the tree of ``root``?"""
    if not (_is_hash(leaf_hash) and _is_hash(root) and all(_is_hash(p) for p in proof)):
        return False
    if not 0 <= index < tree_size:
        return False
    fn, sn, r = index, tree_size - 1, leaf_hash
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """RFC 9162 §2.1.4.2: is the tree of ``new_root`` an append-only extension of the tree
    of ``old_root``? A proof from the empty tree proves nothing and is refused."""
    if old_size <= 0 or new_size < old_size:
        return False
    if old_size == new_size:  # nothing to prove but that the two roots are the same
        return not proof and bytes(old_root) == bytes(new_root)
    if not (_is_hash(old_root) and _is_hash(new_root) and all(_is_hash(p) for p in proof)):
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is itself a node
        path.insert(0, old_root)
    if not path:
        return False
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root


# --- ranges: the shape of a proof, independent of where the hashes come from -------------


def inclusion_ranges(index: int, tree_size: int) -> list[tuple[int, int]]:
    """The leaf ranges whose tree hashes make up PATH(index, D[tree_size]), leaf to root."""
    out: list[tuple[int, int]] = []
    start, end = 0, tree_size
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            out.append((start + k, end))
            end = start + k
        else:
            out.append((start, start + k))
            start += k
    out.reverse()
    return out


def consistency_ranges(old_size: int, new_size: int) -> list[tuple[int, int]]:
    """The leaf ranges whose tree hashes make up PROOF(old_size, D[new_size])."""
    if old_size == 0 or old_size == new_size:
        return []
    out: list[tuple[int, int]] = []
    m, start, end, whole = old_size, 0, new_size, True
    while True:
        n = end - start
        if m == n:
            if not whole:
                out.append((start, end))
            break
        k = _split(n)
        if m <= k:
            out.append((start + k, end))
            end = start + k
        else:
            out.append((start, start + k))
            start += k
            m -= k
            whole = False
    out.reverse()
    return out


def range_nodes(start: int, end: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` (start aligned as in every proof range) into complete subtrees,
    as ``(level, index)`` pairs left to right: the node ``(level, index)`` covers leaves
    ``[index·2^level, (index+1)·2^level)``."""
    out: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        level = (end - pos).bit_length() - 1
        if pos:
            level = min(level, (pos & -pos).bit_length() - 1)
        out.append((level, pos >> level))
        pos += 1 << level
    return out


def fold_range(hashes: Sequence[bytes]) -> bytes:
    """The tree hash of a range from its ``range_nodes`` hashes (right to left)."""
    acc = hashes[-1]
    for h in reversed(hashes[:-1]):
        acc = node_hash(h, acc)
    return acc


# --- the right edge of a growing tree -----------------------------------------------------


class CompactRange:
    """The right edge of the Merkle tree of leaves ``[0, size)``: the hash of each complete
    subtree of ``range_nodes(0, size)``, largest first, one per set bit of ``size``.

    That is all a log needs to keep in memory to go on appending and to know its root:
    appending a leaf merges it with the edge's smallest subtrees while they are as large as
    what is being carried (O(1) amortized, O(log n) memory), and ``root()`` folds the edge.
    Values in, values out; storing anything is the caller's business, and ``extend`` hands it
    the hashes to store: each new leaf hash, followed by every complete subtree it completes,
    smallest first (the order of Go's sumdb ``tlog`` storage, ``proofplane.store.audit_log``).

    Hashes are checked: a hash that is not 32 ``bytes`` raises ``TypeError``/``ValueError``
    before the range changes."""

    __slots__ = ("_hashes", "_size")

    def __init__(self, size: int = 0, hashes: Iterable[bytes] = ()) -> None:
        """The range of a tree of ``size`` leaves whose edge is ``hashes`` (largest subtree
        first, e.g. read back from storage at ``range_nodes(0, size)``)."""
        edge = list(hashes)
        if size < 0:
            raise ValueError(f"a tree size is not negative, got {size}")
        if len(edge) != size.bit_count():
            raise ValueError(
                f"a tree of {size} leaves has {size.bit_count()} edge hashes, not {len(edge)}"
            )
        for h in edge:
            _check_hash(h, "an edge hash")
        self._size = size
        self._hashes = edge

    @property
    def size(self) -> int:
        """The number of leaves."""
        return self._size

    @property
    def hashes(self) -> list[bytes]:
        """The edge: the hashes of ``range_nodes(0, size)``, largest subtree first (a copy)."""
        return list(self._hashes)

    def copy(self) -> CompactRange:
        other = CompactRange.__new__(CompactRange)
        other._size, other._hashes = self._size, list(self._hashes)
        return other

    def append(self, leaf_hash: bytes) -> None:
        """Add one leaf (its leaf hash, ``leaf_hash(entry)``)."""
        if not isinstance(leaf_hash, bytes) or len(leaf_hash) != HASH_SIZE:
            _check_hash(leaf_hash, "a leaf hash")
        n = self._size
        self._size = n + 1
        hashes, cur = self._hashes, leaf_hash
        while n & 1:
            cur = _sha256(b"\x01" + hashes.pop() + cur).digest()
            n >>= 1
        hashes.append(cur)

    def append_subtree(self, level: int, subtree_hash: bytes) -> None:
        """Add ``2^level`` leaves at once, given the hash of their complete subtree; the size
        must be a multiple of ``2^level`` (the subtree is aligned)."""
        _check_hash(subtree_hash, "a subtree hash")
        if level < 0 or self._size & ((1 << level) - 1):
            raise ValueError(
                f"a subtree of level {level} cannot follow {self._size} leaves (not aligned)"
            )
        hashes, n, cur = self._hashes, self._size >> level, subtree_hash
        while n & 1:
            cur = _sha256(b"\x01" + hashes.pop() + cur).digest()
            n >>= 1
        hashes.append(cur)
        self._size += 1 << level

    def extend(self, leaf_hashes: Iterable[bytes]) -> list[bytes]:
        """``append`` each leaf hash in order (one loop: the bulk path), and return the hashes
        a log stores for them, in storage order: each leaf hash, then the hash of every
        complete subtree it completes, smallest first. For leaves ``size..size+k`` these are
        ``2k − popcount(size+k) + popcount(size)`` hashes. Nothing changes when a hash is
        refused."""
        leaves = leaf_hashes if isinstance(leaf_hashes, list | tuple) else list(leaf_hashes)
        for leaf in leaves:
            if not isinstance(leaf, bytes) or len(leaf) != HASH_SIZE:
                _check_hash(leaf, "a leaf hash")
        hashes, n, sha = self._hashes, self._size, _sha256
        stored: list[bytes] = []
        keep = stored.append
        for cur in leaves:
            keep(cur)
            m = n
            while m & 1:
                cur = sha(b"\x01" + hashes.pop() + cur).digest()
                keep(cur)
                m >>= 1
            hashes.append(cur)
            n += 1
        self._size = n
        return stored

    def root(self) -> bytes:
        """The Merkle tree hash of the leaves so far (SHA-256("") for none)."""
        return fold_range(self._hashes) if self._hashes else EMPTY_ROOT

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompactRange):
            return NotImplemented
        return self._size == other._size and self._hashes == other._hashes

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"CompactRange(size={self._size}, root={self.root().hex()})"


def _check_hash(value: object, what: str) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{what} is {HASH_SIZE} bytes, not a {type(value).__name__}")
    if len(value) != HASH_SIZE:
        raise ValueError(f"{what} is {HASH_SIZE} bytes, not {len(value)}")


def _split(n: int) -> int:
    """The largest power of two strictly less than n (n ≥ 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_of_hashes(leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes (not entries), iteratively: level by level, carrying an odd last
    node up. SHA-256("") for none."""
    if not leaves:
        return EMPTY_ROOT
    level = list(leaves)
    while len(level) > 1:
        nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) & 1:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _check_tree_size(tree_size: int, available: int) -> None:
    if not 0 <= tree_size <= available:
        raise ValueError(f"tree size {tree_size} is outside 0..{available} (the entries given)")


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes | bytearray) and len(value) == HASH_SIZE
