"""Engines for the two supported stores: SQLite (WAL, one file, the default) and PostgreSQL.

Writes are serialized: on SQLite every transaction starts with ``BEGIN IMMEDIATE`` (the writer
lock is taken up front, so read-then-write never dead-ends in SQLITE_BUSY), and on PostgreSQL a
write transaction takes one transaction-scoped advisory lock. On SQLite the writers of all the
server's processes first queue on ``writer_gate`` (a thread lock, then an exclusive ``flock`` on
``<database>.writer``): SQLite's own busy handler polls with sleeps of up to 100 ms, so two
worker processes contending for the file lock lost most of their time asleep; a blocked
``flock`` is woken by the kernel the moment the holder lets go. On PostgreSQL the writers of one
process queue on an in-process gate (a thread lock) before they begin, so each process has at
most one backend waiting on the advisory lock: with every writer parked in PostgreSQL (20-odd
under a fleet of agents) each held a pooled connection, which left the process's reads waiting
for one. The control plane makes decisions
from what it just read (placement, event sequence numbers), so one writer at a time is the rule;
reads stay concurrent.

A SQLite database holds password hashes, token hashes and sink secrets: its file is created
0600 whatever the umask (the WAL and SHM files SQLite creates take the database file's mode,
and are set 0600 too), and a server refuses to start on a database file that other users can
read (``check_private``), naming the ``chmod`` that fixes it (issue 19, §6). ``secure_delete``
zeroes what a deleted row occupied.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session

from proofplane.errors import Unavailable, ValidationFailed
from proofplane.store.audit_log import stored_before

WRITE_LOCK_KEY = 84700001  # advisory-lock key for PostgreSQL write transactions
BUSY_TIMEOUT_S = 30  # SQLite busy_timeout, and the longest wait for the writer gate


def default_database_url() -> str:
    data_dir = Path(platformdirs.user_data_dir("proofplane"))
    return f"sqlite:///{data_dir / 'proofplane.db'}"


def normalize_url(url: str) -> str:
    """Accept the spellings people paste (``postgresql://``, ``postgres://``) and pick psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        msg = f"invalid database URL: {url!r}"
        raise ValidationFailed(msg, code="invalid_database_url") from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(url, parsed.database)
    if backend == "postgresql":
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)
    raise ValidationFailed(
        f"unsupported database {backend!r}: use sqlite:///PATH or postgresql+psycopg://…",
        code="invalid_database_url",
    )


def _sqlite_engine(url: str, database: str | None) -> Engine:
    if not database or database == ":memory:":
        raise ValidationFailed(
            "SQLite needs a file path (sqlite:///PATH): an in-memory database would vanish",
            code="invalid_database_url",
        )
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    if not database.startswith("file:"):
        create_private(Path(database))
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # noqa: ANN001
        # Let SQLAlchemy, not the driver, decide when transactions begin (see "begin" below).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA secure_delete=ON")
        cur.close()
        if not database.startswith("file:"):
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.chmod(f"{database}{suffix}", 0o600)

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # noqa: ANN001
        immediate = conn.get_execution_options().get("proofplane_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


PRIVATE_MODE = 0o600


def create_private(path: Path) -> None:
    """Create a new SQLite file 0600 before SQLite would create it with the umask's mode (its
    WAL and SHM files then take that mode too). An existing file is left as it is."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_MODE)
    except OSError:
        return  # it exists, or SQLite will say why it cannot open it
    try:
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)


def check_private(url: str) -> None:
    """At start-up: a SQLite database file other users can read or write is refused with
    ValidationFailed (``insecure_database_file``) naming the ``chmod`` to run. (A copy made
    with ``cp`` for an offline ``audit verify`` is not the server's business.)"""
    try:
        parsed = make_url(normalize_url(url))
    except ArgumentError:
        return
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return
    if database.startswith("file:"):
        return
    path = Path(database)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return  # not there yet: it will be created 0600
    if mode & 0o077:
        raise ValidationFailed(
            f"the database file {path} is open to other users (mode {mode:04o}); it holds "
            f"credentials and secrets: run `chmod 600 {path}` (and its -wal and -shm files) "
            "and start again",
            code="insecure_database_file",
            details={"path": str(path), "mode": f"{mode:04o}", "fix": f"chmod 600 {path}"},
        )


def erase_freed_pages(engine: Engine) -> None:
    """After deleting secrets: on SQLite, move the write-ahead log into the database and
    truncate it, so the log keeps no older copy of the deleted rows (``secure_delete`` has
    zeroed them in the database pages). Best effort: a busy reader postpones it."""
    if engine.dialect.name != "sqlite":
        return
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        cursor.close()
    finally:
        raw.close()


# The lock and, once it is held, the newest event's seq: two statements sent as one simple
# query (no parameters, so the driver allows several), each with its own snapshot, so the
# second sees every transaction committed before the lock was granted. One round trip instead
# of two in every write transaction on PostgreSQL (issue 20).
_LOCK_THEN_NEWEST_SEQ = (
    f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY}); SELECT max(seq) FROM events"
)
#: ``Session.info`` key of a PostgreSQL write session: the newest event's seq read right after
#: its transaction took the write lock (``Tx.newest_seq`` uses it instead of reading again).
LOCKED_NEWEST_SEQ = "proofplane.locked_newest_seq"
#: ``Session.info`` key of a PostgreSQL write session opened with ``events_after``: ``(after,
#: rows)``, the events after seq ``after`` as ``(seq, target_type, target_id, action)`` in seq
#: order, read in the lock's round trip; at most ``LOCKED_EVENTS_MAX`` + 1 rows (more: the
#: rows are not all of them).
LOCKED_EVENTS = "proofplane.locked_events"
#: The most events a write transaction's lock query brings along. A writer that is further
#: behind (a replica that has only read for a while) reads what its caches need itself.
LOCKED_EVENTS_MAX = 256
#: ``Session.info`` key of the same session: ``(after, rows)``, the Merkle log's stored hashes
#: from the first one a log of ``after`` leaves does not hold, as ``(id, hash)`` in id order
#: (what extends this process's last edge by another writer's appends, ``Appender.extended``);
#: at most ``LOCKED_HASHES_MAX`` + 1 rows.
LOCKED_HASHES = "proofplane.locked_hashes"
#: Enough for the hashes of ``LOCKED_EVENTS_MAX`` leaves (each leaf and the subtrees it
#: completes: fewer than two a leaf, plus the edge's height).
LOCKED_HASHES_MAX = 2 * LOCKED_EVENTS_MAX + 64


def write_session(engine: Engine, events_after: int | None = None) -> Session:
    """A session whose transaction holds the single-writer lock from its first statement. On
    PostgreSQL the newest event's seq under that lock is in ``info[LOCKED_NEWEST_SEQ]`` once
    the transaction has begun, and with ``events_after`` (the newest seq this process knows
    of) the events another process or replica wrote since are in ``info[LOCKED_EVENTS]``:
    what the per-process caches catch up from, read in the same round trip (issue 20), with
    the Merkle log's hashes they appended in ``info[LOCKED_HASHES]``."""
    if engine.dialect.name == "sqlite":
        return Session(_writing(engine), expire_on_commit=False)
    session = Session(engine, expire_on_commit=False)
    after = None if events_after is None else int(events_after)  # an int: safe in the text
    sql = _LOCK_THEN_NEWEST_SEQ
    if after is not None:
        sql += (
            f"; SELECT seq, target_type, target_id, action FROM events WHERE seq > {after}"
            f" ORDER BY seq LIMIT {LOCKED_EVENTS_MAX + 1}"
            f"; SELECT id, hash FROM audit_hashes WHERE id >= {stored_before(after)}"
            f" ORDER BY id LIMIT {LOCKED_HASHES_MAX + 1}"
        )

    @event.listens_for(session, "after_begin")
    def _lock(_session, _tx, connection) -> None:  # noqa: ANN001
        result = connection.exec_driver_sql(sql)
        try:
            cursor = result.context.cursor
            if not cursor.nextset():
                raise RuntimeError("no result for the newest seq after the write lock")
            row = cursor.fetchone()
            if after is not None:
                if not cursor.nextset():
                    raise RuntimeError("no result for the events after the write lock")
                events = [tuple(r) for r in cursor.fetchall()]
                if not cursor.nextset():
                    raise RuntimeError("no result for the log's hashes after the write lock")
                hashes = [(int(i), bytes(h)) for i, h in cursor.fetchall()]
        finally:
            result.close()
        session.info[LOCKED_NEWEST_SEQ] = int(row[0] or 0)
        if after is not None:
            session.info[LOCKED_EVENTS] = (after, events)
            session.info[LOCKED_HASHES] = (after, hashes)

    return session


def _writing(engine: Engine) -> Engine:
    """``engine`` with the write option (its ``BEGIN IMMEDIATE``), made once per engine: a new
    option engine per transaction cost three times the session itself."""
    writing: Engine | None = engine.__dict__.get("_proofplane_writing")
    if writing is None:
        writing = engine.__dict__["_proofplane_writing"] = engine.execution_options(
            proofplane_write=True
        )
    return writing


# How long a read starting in one thread waits while another thread of the same process holds
# the database's SQLite write slot (``yield_to_writer``). A write alone holds it ~7 ms; a group
# of writes committed together (``Store.write_grouped``) longer. At 50 ms the reads' p99 in
# bench/api.py's 500 req/s mix sat at that cap (the worst kind's 50-57 ms in four runs); at
# 20 ms the worst kind's was 39-55 ms (median ~44 in eight), the writes unchanged (issue 20).
READ_YIELD_S = 0.02


def yield_to_writer(engine: Engine, timeout: float | None = None) -> None:
    """Before a read on ``engine``: while another thread of this process holds its SQLite
    database's write slot, wait for it to let go, at most ``timeout`` seconds (default
    ``READ_YIELD_S``).

    Python runs one thread of a process at a time. A thread holding the write slot, which
    every other process's writers wait for, gives the interpreter up at every SQLite call and
    then has to win it back from every other busy thread of its process: under a flood of reads
    it held the slot several times as long as its work took, and a worker passed a handful of
    writes a second (issue 20). So a read waits while the slot is held: the writer runs alone,
    and the reads, which no lock holds up, follow. The holder's own reads, reads of another
    database, and reads while no thread of this process holds the slot never wait."""
    gate = _gate_for(engine, create=False)
    if gate is not None and not gate.idle.is_set() and gate.owner != threading.get_ident():
        gate.idle.wait(READ_YIELD_S if timeout is None else timeout)


class _Gate:
    """One database's writer queue in this process: a thread lock and, for a SQLite file
    (``path``), an exclusive ``flock`` on a file opened by this process (threads share the
    process's open file, and a ``flock`` already held by it would not block them; after a fork
    the child opens its own, so its lock is its own). A PostgreSQL engine's gate (no ``path``)
    is the thread lock alone: across processes and replicas the advisory lock decides, and its
    reads never wait for it (``owner`` stays None: ``yield_to_writer`` is for SQLite's slot).
    Re-entrant in the thread holding it: work a committed transaction triggers (an
    ``after_commit`` hook writing its own record) runs before the gate is let go, and must not
    wait for itself."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.depth = 0  # changed only by the thread holding ``lock``
        self.fd: int | None = None
        self.pid = 0
        # the thread holding the slot (None: none), and set while none does (yield_to_writer)
        self.owner: int | None = None
        self.idle = threading.Event()
        self.idle.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        # as long as SQLite's own busy timeout: a writer that waits longer gives up the same way
        if not self.lock.acquire(timeout=BUSY_TIMEOUT_S):
            raise Unavailable("the database is busy: no write slot within 30 s")
        try:
            if self.depth == 0 and self.path is not None:
                if self.fd is None or self.pid != os.getpid():
                    self.fd = os.open(
                        self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_MODE
                    )
                    self.pid = os.getpid()
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                self.owner = threading.get_ident()
                self.idle.clear()
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.owner = None
                    self.idle.set()
                    if self.fd is not None:
                        fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.lock.release()


_GATES: dict[str, _Gate] = {}
_GATES_LOCK = threading.Lock()


def writer_gate(engine: Engine) -> contextlib.AbstractContextManager[None]:
    """Hold this around a write transaction (before its ``BEGIN IMMEDIATE``, released after its
    commit or rollback): on a SQLite file, the writers of every process queue here instead of in
    SQLite's sleeping busy handler; on PostgreSQL the writers of this process queue here, one of
    them at a time waiting on the advisory lock (a ``_Gate`` without a file); anything else (an
    in-memory SQLite database) passes at once."""
    gate = _gate_for(engine, create=True)
    if gate is not None:
        return gate.held()
    if engine.dialect.name == "postgresql":
        found: _Gate | None = engine.__dict__.get("_proofplane_process_gate")
        if found is None:
            with _GATES_LOCK:
                found = engine.__dict__.setdefault("_proofplane_process_gate", _Gate(None))
        return found.held()
    return contextlib.nullcontext()


def _gate_for(engine: Engine, *, create: bool) -> _Gate | None:
    """The writer gate of ``engine``'s SQLite file (made if ``create``), or None: not a file
    (PostgreSQL, an in-memory or URI database), or no writer of this process made it yet."""
    gate: _Gate | None = engine.__dict__.get("_proofplane_gate")
    if gate is not None:
        return gate
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database.startswith("file:") or database == ":memory:":
        return None
    path = f"{os.path.abspath(database)}.writer"
    gate = _GATES.get(path)
    if gate is None:
        if not create:
            return None
        with _GATES_LOCK:
            gate = _GATES.setdefault(path, _Gate(path))
    engine.__dict__["_proofplane_gate"] = gate
    return gate


def read_session(engine: Engine, *, streaming: bool = False) -> Session:
    """A session for reads. On PostgreSQL it runs in autocommit unless ``streaming``: under
    READ COMMITTED every statement takes its own snapshot whether or not a transaction wraps
    it, so a read transaction's BEGIN and COMMIT bought nothing but two round trips per read
    request (issue 20). ``streaming``: a server-side cursor (``yield_per``) is declared, which
    needs a transaction."""
    if streaming or engine.dialect.name != "postgresql":
        return Session(engine, expire_on_commit=False)
    autocommit: Engine | None = engine.__dict__.get("_proofplane_autocommit")
    if autocommit is None:
        autocommit = engine.__dict__["_proofplane_autocommit"] = engine.execution_options(
            isolation_level="AUTOCOMMIT"
        )
    return Session(autocommit, expire_on_commit=False)
