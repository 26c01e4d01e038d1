"""Whole-log recomputation straight from a SQLite file, fast: the leaf of every event row
rebuilt from its columns, the tree rebuilt from the leaves, chunk by chunk (in parallel
processes when there are several chunks).

Rows written by ``Tx.record``/``record_many`` on SQLite keep their details as canonical
(RFC 8785) JSON text, so a row's entry bytes are laid out from its columns without parsing::

    {"action":<q(action)>,"actor":<q(actor)>,"details":<details text>,"outcome":<q(outcome)>,
     "seq":<seq>,"target_id":<q(target_id)>,"target_type":<q(target_type)>,
     "ts":"<ts, its space made a T>Z","v":1}

(``canonical.entry_frame``/``entry_text``: the one layout, also the event writer's) with
``q`` the RFC 8785 string quoting (``canonical.quote_string``), for rows whose ``ts`` is
text with a space at position 10 and no ``"`` (what the column stores). Where the details
text is not in canonical form (an older writer, an edit) the bytes differ from the entry,
the chunk does not reproduce the stored subtree hashes, and the chunk is recomputed exactly
instead (details parsed and re-canonicalized), as the slow pass does.

Why hashing those bytes proves as much as recomputing from the parsed row: the layout is
injective. Reading the bytes from the front, ``action`` and ``actor`` are JSON string
literals (self-delimiting); from the back, ``ts`` holds no quote, ``target_type``,
``target_id``, ``outcome`` are string literals and ``seq`` is digits; the details text is
what lies between. So bytes that hash to the leaf the checkpoint signed can only come from
a row whose every column is, byte for byte, the one that was logged. Which path a chunk
takes is decided by the stored hashes (only a hint); what is accepted is decided by the
signed checkpoint root the caller compares with.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from multiprocessing import get_context
from typing import Any

from proofplane.audit import merkle
from proofplane.audit.canonical import (
    canonical_json,
    entry_frame,
    entry_text,
    fast_details_json,
    format_ts,
    quote_string,
)
from proofplane.errors import ProofplaneError

__all__ = [
    "CHUNK_LEVEL",
    "PARALLEL_FROM",
    "Unverifiable",
    "chunk_bounds",
    "chunk_leaves_exact",
    "exact_leaf",
    "log_roots",
    "subtrees",
]

CHUNK_LEVEL = 16  # 2^16 leaves per chunk, aligned: a full chunk is one complete subtree
PARALLEL_FROM = 1 << 19  # events: below this, one process (the pool would cost more)
MIN_PARALLEL_CHUNK_LEVEL = 13  # with several workers, chunks no smaller than this …
CHUNKS_PER_WORKER = 8  # … but small enough for this many each (an even finish)

_ROW_SQL = (
    "SELECT seq, ts, actor, action, target_type, target_id, outcome, details FROM events"
    " WHERE seq > ? AND seq <= ? ORDER BY seq"
)

# what SQLAlchemy stores in a SQLite DATETIME column (naive UTC), fraction optional
_TS_SHAPE = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{1,6})?")

Node = tuple[int, bytes]  # (level, hash) of a complete subtree
_NOTHING: Any = object()


class Unverifiable(ProofplaneError):
    """A chunk could not be recomputed (a seq missing, a row that is no event): the caller
    runs the exact pass, which says where."""

    code = "unverifiable"


def subtrees(leaves: Sequence[bytes]) -> list[Node]:
    """The complete subtrees of ``leaves`` (which start at a multiple of a power of two no
    smaller than their number), largest first: level-wise, in tight loops."""
    out: list[Node] = []
    sha = hashlib.sha256
    pos, n = 0, len(leaves)
    while pos < n:
        level = (n - pos).bit_length() - 1
        layer = leaves[pos : pos + (1 << level)]
        while len(layer) > 1:
            pairs = iter(layer)  # zip(it, it): consecutive pairs, no slicing
            layer = [sha(b"\x01" + a + b).digest() for a, b in zip(pairs, pairs, strict=True)]
        out.append((level, layer[0]))
        pos += 1 << level
    return out


def exact_leaf(row: tuple[Any, ...]) -> bytes:
    """The leaf of an event row ``(seq, ts, actor, action, target_type, target_id, outcome,
    details)`` recomputed from its parsed columns (RFC 8785). ``Unverifiable`` when the row
    is no event."""
    seq, ts, actor, action, ttype, tid, outcome, details = row
    if not all(isinstance(v, str) for v in (ts, actor, action, ttype, tid, outcome, details)):
        raise Unverifiable(f"event seq {seq}: a column is not text")
    try:
        det = fast_details_json(details)
        if det is None:
            det = canonical_json(json.loads(details)).decode()
        if len(ts) == 26 and ts[10] == " ":
            ts_text = ts[:10] + "T" + ts[11:] + "Z"
        elif _TS_SHAPE.fullmatch(ts):
            ts_text = format_ts(datetime.fromisoformat(ts).replace(tzinfo=UTC))
        else:
            raise ValueError(f"ts {ts!r} is not a stored timestamp")
    except ValueError as exc:
        raise Unverifiable(f"event seq {seq}: {exc}") from exc
    text = entry_text(seq, ts_text, actor, action, ttype, tid, outcome, det)
    try:
        return merkle.leaf_hash(text.encode())
    except UnicodeEncodeError as exc:
        raise Unverifiable(f"event seq {seq}: not valid Unicode") from exc


def chunk_leaves_exact(cur: sqlite3.Cursor, lo: int, hi: int) -> list[bytes]:
    """Leaves of events ``(lo, hi]`` recomputed from the parsed columns (RFC 8785)."""
    leaves = []
    for k, row in enumerate(cur.execute(_ROW_SQL, (lo, hi))):
        if row[0] != lo + 1 + k:
            raise Unverifiable(f"event seq {lo + 1 + k} is missing")
        leaves.append(exact_leaf(row))
    if len(leaves) != hi - lo:
        raise Unverifiable(f"event seq {lo + len(leaves) + 1} is missing")
    return leaves


def _laid_out_leaves(rows: Iterable[tuple[Any, ...]]) -> list[bytes]:
    """Leaves from the columns as laid out (see the module docstring). The parts that
    repeat (actor, action, target type, outcome, ts: a handful of values, the same from one
    row to the next in a batch) are quoted once: kept while a row repeats the one before,
    else looked up."""
    sha = hashlib.sha256
    q = quote_string
    frames: dict[tuple[Any, ...], tuple[str, str, str]] = {}
    out: list[bytes] = []
    append = out.append
    p_ts = p_actor = p_action = p_ttype = p_outcome = _NOTHING  # unequal to any value
    head = mid = tail = ""
    for seq, ts, actor, action, ttype, tid, outcome, details in rows:
        if (
            ts != p_ts
            or action != p_action
            or actor != p_actor
            or ttype != p_ttype
            or outcome != p_outcome
        ):
            # ``!=`` is exact for str; any other type fails in ``q`` or the checks below
            key = p_ts, p_actor, p_action, p_ttype, p_outcome = ts, actor, action, ttype, outcome
            frame = frames.get(key)
            if frame is None:
                if type(ts) is not str or len(ts) < 11 or ts[10] != " " or '"' in ts:
                    raise ValueError("ts is not in the stored shape")
                head, mid, tail = entry_frame(
                    f"{ts[:10]}T{ts[11:]}Z", actor, action, ttype, outcome
                )
                frame = frames[key] = ("\x00" + head, mid, tail)  # 0x00: the leaf prefix
            head, mid, tail = frame
        if type(details) is not str or type(seq) is not int:
            raise TypeError("a column of the wrong type")
        append(sha(f'{head}{details}{mid}{seq},"target_id":{q(tid)}{tail}'.encode()).digest())
    return out


def _stored_match(cur: sqlite3.Cursor, lo: int, nodes: list[Node]) -> bool:
    ids, pos = [], lo
    for level, _ in nodes:
        index = pos >> level
        end = (index + 1) << level  # node (level, index): stored after leaf end-1's hashes
        ids.append(2 * (end - 1) - (end - 1).bit_count() + level)
        pos += 1 << level
    marks = ",".join("?" * len(ids))
    stored = dict(cur.execute(f"SELECT id, hash FROM audit_hashes WHERE id IN ({marks})", ids))
    return all(stored.get(i) == h for i, (_, h) in zip(ids, nodes, strict=True))


def _chunk(
    path: str, lo: int, hi: int, cuts: Sequence[int]
) -> tuple[list[Node], dict[int, list[Node]], bool]:
    """(subtrees of events (lo, hi], {cut: subtrees of (lo, cut]}, whether the raw layout
    reproduced the stored hashes)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        cur = conn.cursor()
        cur.execute("BEGIN")
        leaves: list[bytes] | None
        try:  # rows streamed off the cursor: no list of 2^16 row tuples (it costs ~20 %)
            leaves = _laid_out_leaves(cur.execute(_ROW_SQL, (lo, hi)))
        except (TypeError, ValueError):  # a column of another type, a stray quote
            leaves = None
        if leaves is not None and len(leaves) != hi - lo:
            leaves = None  # seq is the key: hi − lo rows in (lo, hi] are all of them, else not
        fast = False
        if leaves is not None:
            nodes = subtrees(leaves)
            fast = _stored_match(cur, lo, nodes)
        if not fast:
            leaves = chunk_leaves_exact(cur, lo, hi)
            nodes = subtrees(leaves)
        assert leaves is not None
        # a cut at the chunk's end is the chunk itself; one inside it, its first leaves
        at_cuts = {
            c: nodes if c == hi else subtrees(leaves[: c - lo]) for c in cuts if lo < c <= hi
        }
        cur.execute("COMMIT")
        return nodes, at_cuts, fast
    finally:
        conn.close()


def first_undecodable(path: str) -> tuple[int, int] | None:
    """(index, seq) of the first event row holding text that is not valid UTF-8 (a row
    altered in the database; Python's sqlite3 refuses to decode it), or None."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    conn.text_factory = bytes
    try:
        for index, row in enumerate(conn.execute(_ROW_SQL, (0, 2**62))):
            for value in row[1:]:
                if isinstance(value, bytes):
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return index, row[0]
        return None
    finally:
        conn.close()


def chunk_bounds(size: int, workers: int, chunk_level: int | None = None) -> list[tuple[int, int]]:
    """The chunks ``(lo, hi]`` of events 1..size: aligned, 2^chunk_level events each but the
    last. Default level ``CHUNK_LEVEL``, lowered with several workers (not below
    ``MIN_PARALLEL_CHUNK_LEVEL``) until each has ``CHUNKS_PER_WORKER`` chunks: the pool hands
    them out as workers free up, so small ones at the end make the workers finish together."""
    if chunk_level is None:
        chunk_level = CHUNK_LEVEL
        while workers > 1 and chunk_level > MIN_PARALLEL_CHUNK_LEVEL:
            if size >> chunk_level >= CHUNKS_PER_WORKER * workers:
                break
            chunk_level -= 1
    chunk = 1 << chunk_level
    return [(lo, min(size, lo + chunk)) for lo in range(0, size, chunk)]


def log_roots(
    path: str,
    size: int,
    cuts: Sequence[int] = (),
    *,
    workers: int | None = None,
    chunk_level: int | None = None,
) -> tuple[bytes, dict[int, bytes], int]:
    """(root of events 1..size, {cut: root of events 1..cut}, chunks that took the exact
    path) recomputed from the SQLite file at ``path``. ``workers``: processes (default: one
    per CPU from ``PARALLEL_FROM`` events on, else one; at most one per chunk).
    ``chunk_level``: chunks of 2^chunk_level events (default ``CHUNK_LEVEL``, smaller with
    several workers, down to ``MIN_PARALLEL_CHUNK_LEVEL``, so that each gets several chunks
    and they finish together). Raises ``Unverifiable`` when a row is missing or is no
    event."""
    if workers is None:  # starting processes costs about a second: worth it on big logs only
        workers = (os.cpu_count() or 1) if size >= PARALLEL_FROM else 1
    bounds = chunk_bounds(size, workers, chunk_level)
    workers = max(1, min(workers, len(bounds)))
    results = None
    if workers > 1:
        # fork is cheap but unsafe in a threaded process (a server): spawn there
        ctx = get_context("fork" if threading.active_count() == 1 else "spawn")
        try:
            with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                futures = [pool.submit(_chunk, path, lo, hi, list(cuts)) for lo, hi in bounds]
                results = [f.result() for f in futures]
        except (BrokenProcessPool, OSError):  # no processes to be had: do it here
            results = None
    if results is None:
        results = [_chunk(path, lo, hi, cuts) for lo, hi in bounds]
    tree = merkle.CompactRange()
    roots = {0: merkle.EMPTY_ROOT} if 0 in cuts else {}
    slow = 0
    for nodes, at_cuts, fast in results:
        slow += not fast
        for c, part in at_cuts.items():
            upto = tree.copy()
            for level, h in part:
                upto.append_subtree(level, h)
            roots[c] = upto.root()
        for level, h in nodes:
            tree.append_subtree(level, h)
    return tree.root(), roots, slow
