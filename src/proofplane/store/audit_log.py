"""The Merkle log on the database: every complete subtree hash, appended in the same
transaction as its event, so any proof at any tree size needs O(log n) point reads.

Layout (the storage order of Go's sumdb ``tlog``): the hashes live in one append-only table
``audit_hashes(id, hash)``. Appending leaf ``n`` writes its leaf hash and then the hash of
every complete subtree that leaf completes, at consecutive ids, so the table only ever grows
at its end (a B-tree append, no page splits) and nothing is rewritten. The node at
``(level, index)`` (covering leaves ``[index·2^level, (index+1)·2^level)``) has id
``stored_before(((index+1) << level) - 1) + level`` with ``stored_before(n) = 2n − popcount(n)``,
the number of hashes stored for the first ``n`` leaves.

A proof is a list of range hashes (``merkle.inclusion_ranges``/``consistency_ranges``), each
range a handful of complete subtrees (``merkle.range_nodes``): one ``SELECT … WHERE id IN``
of at most ~2·log2(n) ids, then a few hashes in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select
from sqlalchemy.orm import Session

from proofplane.audit import merkle
from proofplane.errors import ProofplaneError
from proofplane.store.tables import AuditHashRow


def stored_before(n: int) -> int:
    """How many hashes the first ``n`` leaves store (leaf hashes + complete subtrees)."""
    return 2 * n - n.bit_count()


def node_id(level: int, index: int) -> int:
    """Storage id of the complete subtree ``(level, index)``."""
    return stored_before(((index + 1) << level) - 1) + level


def size_from_count(count: int) -> int:
    """The tree size whose stored hashes number ``count`` (inverse of ``stored_before``)."""
    n = count // 2
    while stored_before(n) < count:
        n += 1
    if stored_before(n) != count:
        raise LogCorrupted(f"{count} stored hashes do not make a whole tree")
    return n


class LogCorrupted(ProofplaneError):
    """The stored hashes do not form the log the events say they should."""

    code = "audit_log_inconsistent"

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ProofRangeError(ProofplaneError, ValueError):
    """A proof asked for sizes or indices outside the log."""

    code = "proof_range_invalid"


class Appender:
    """The log's right edge (``merkle.CompactRange``) and the hashes a batch of appends
    produces, not yet written (``pending``: the last ``len(pending)`` of the
    ``stored_before(size)`` hashes, in storage order); pure except for ``load``/``flush``."""

    __slots__ = ("pending", "range")

    def __init__(
        self, size: int = 0, edge: Iterable[bytes] = (), pending: Iterable[bytes] = ()
    ) -> None:
        self.range = merkle.CompactRange(size, edge)
        self.pending: list[bytes] = list(pending)

    @property
    def size(self) -> int:
        return self.range.size

    @classmethod
    def load(cls, db: Session | Connection, size: int) -> Appender:
        """The appender for a log that must hold exactly ``size`` leaves."""
        stored = tree_size(db)
        if stored != size:
            raise LogCorrupted(f"the Merkle log holds {stored} leaves but {size} events")
        ids = [node_id(lv, ix) for lv, ix in merkle.range_nodes(0, size)]
        hashes = _fetch(db, ids)
        try:
            return cls(size, [hashes[i] for i in ids])
        except ValueError as exc:  # a stored edge hash that is not 32 bytes
            raise LogCorrupted(f"the Merkle log's right edge is damaged: {exc}") from exc

    @classmethod
    def extended(
        cls, size: int, edge: Iterable[bytes], stored: Sequence[tuple[int, bytes]], to: int
    ) -> Appender:
        """The appender for a log that must hold exactly ``to`` leaves, from its edge at
        ``size`` leaves (``edge``) and every hash stored after those, ``stored`` (``(id,
        hash)`` in id order, from id ``stored_before(size)`` on): the leaves appended since
        extend the edge, and every hash that computes must be the stored one. No read: another
        writer's appends, which came with the write lock, move this process's last edge."""
        start, end = stored_before(size), stored_before(to)
        if [i for i, _ in stored] != list(range(start, end)):
            raise LogCorrupted(
                f"the Merkle log holds hashes {stored[0][0] if stored else '-'}.."
                f"{stored[-1][0] if stored else '-'} after its edge at {size} leaves, not "
                f"{start}..{end - 1} for {to} events"
            )
        by_id = dict(stored)
        out = cls(size, edge)
        try:
            out.append_leaves(by_id[node_id(0, i)] for i in range(size, to))
        except ValueError as exc:  # a stored leaf hash that is not 32 bytes
            raise LogCorrupted(f"the Merkle log's hashes are damaged: {exc}") from exc
        if out.pending != [h for _, h in stored]:
            raise LogCorrupted(
                f"the Merkle log's hashes after {size} leaves are not those of its leaves"
            )
        out.pending = []  # stored already
        return out

    def append_leaf(self, leaf: bytes) -> None:
        self.pending += self.range.extend((leaf,))

    def append_leaves(self, leaves: Iterable[bytes]) -> None:
        """``append_leaf`` for each leaf in order (one loop, for bulk appends)."""
        self.pending += self.range.extend(leaves)

    def root(self) -> bytes:
        return self.range.root()

    def flush(self, db: Session | Connection) -> None:
        if not self.pending:
            return
        end = stored_before(self.range.size)
        rows = zip(range(end - len(self.pending), end), self.pending, strict=True)
        raw = sqlite_connection(db)
        if raw is not None:
            raw.executemany("INSERT INTO audit_hashes (id, hash) VALUES (?, ?)", rows)
        else:
            _core(db).execute(_INSERT_HASH, [{"id": i, "hash": h} for i, h in rows])
        self.pending = []


# Built once and run on the session's Connection (the write path runs them in every
# transaction, issue 20): plain Core statements, nothing for the ORM to compile or track.
_HASH_TABLE = AuditHashRow.__table__
_INSERT_HASH = insert(_HASH_TABLE)
_MAX_ID = select(func.max(_HASH_TABLE.c.id))
_HASHES = select(_HASH_TABLE.c.id, _HASH_TABLE.c.hash).where(
    _HASH_TABLE.c.id.in_(bindparam("ids", expanding=True))
)


def _core(db: Session | Connection) -> Connection:
    """The Connection under ``db`` (inside ``db``'s transaction)."""
    return db.connection() if isinstance(db, Session) else db


def sqlite_connection(db: Session | Connection) -> Any | None:
    """The DB-API (``sqlite3``) connection under ``db``, inside ``db``'s transaction, or None
    on other databases: the hot paths bind plain tuples to prepared statements there."""
    conn = db.connection() if isinstance(db, Session) else db
    if conn.dialect.name != "sqlite":
        return None
    return conn.connection.driver_connection


def tree_size(db: Session | Connection) -> int:
    """The number of leaves in the stored tree (one index seek: the largest id)."""
    raw = sqlite_connection(db)
    if raw is not None:
        last = raw.execute("SELECT max(id) FROM audit_hashes").fetchone()[0]
    else:
        last = _core(db).execute(_MAX_ID).scalar()
    return 0 if last is None else size_from_count(last + 1)


def root_at(db: Session | Connection, size: int) -> bytes:
    if size == 0:
        return merkle.EMPTY_ROOT
    nodes = merkle.range_nodes(0, size)
    hashes = _fetch(db, [node_id(lv, ix) for lv, ix in nodes])
    return merkle.fold_range([hashes[node_id(lv, ix)] for lv, ix in nodes])


def leaf_hashes(db: Session | Connection, start: int, end: int) -> list[bytes]:
    ids = [node_id(0, i) for i in range(start, end)]
    hashes = _fetch(db, ids)
    return [hashes[i] for i in ids]


def inclusion(db: Session | Connection, index: int, size: int) -> tuple[bytes, list[bytes]]:
    """(leaf hash, proof) for leaf ``index`` in the tree of ``size`` leaves."""
    current = tree_size(db)
    if not 0 < size <= current:
        raise ProofRangeError(f"tree_size must be between 1 and the log size {current}")
    if not 0 <= index < size:
        raise ProofRangeError(f"index must be between 0 and {size - 1}")
    ranges = merkle.inclusion_ranges(index, size)
    leaf_id = node_id(0, index)
    hashes = _fetch(db, [leaf_id, *_range_ids(ranges)])
    return hashes[leaf_id], _fold(ranges, hashes)


def consistency(db: Session | Connection, old_size: int, new_size: int) -> list[bytes]:
    current = tree_size(db)
    if not 0 < new_size <= current:
        raise ProofRangeError(f"new_size must be between 1 and the log size {current}")
    if not 0 < old_size <= new_size:
        raise ProofRangeError(f"old_size must be between 1 and new_size ({new_size})")
    ranges = merkle.consistency_ranges(old_size, new_size)
    return _fold(ranges, _fetch(db, _range_ids(ranges)))


def _range_ids(ranges: Iterable[tuple[int, int]]) -> list[int]:
    return [node_id(lv, ix) for a, b in ranges for lv, ix in merkle.range_nodes(a, b)]


def _fold(ranges: Sequence[tuple[int, int]], hashes: dict[int, bytes]) -> list[bytes]:
    return [
        merkle.fold_range([hashes[node_id(lv, ix)] for lv, ix in merkle.range_nodes(a, b)])
        for a, b in ranges
    ]


def _fetch(db: Session | Connection, ids: Sequence[int]) -> dict[int, bytes]:
    if not ids:
        return {}
    wanted = set(ids)
    raw = sqlite_connection(db)
    if raw is not None:
        # one prepared statement per id count (sqlite3 caches them): point reads on the key
        marks = ",".join("?" * len(wanted))
        rows = raw.execute(f"SELECT id, hash FROM audit_hashes WHERE id IN ({marks})", [*wanted])
    else:
        rows = _core(db).execute(_HASHES, {"ids": list(wanted)}).all()
    found = {r[0]: bytes(r[1]) for r in rows}
    missing = wanted - found.keys()
    if missing:
        raise LogCorrupted(f"{len(missing)} stored hashes are missing (e.g. id {min(missing)})")
    return found
