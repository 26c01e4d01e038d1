"""One leader per deployment for the background loops (issue 20 §3).

Several API worker processes (``serve --workers N``) and several replicas share one database;
the checkpoint signer, the SIEM exporter, the staleness check, the change-review check and the
engine reconcile must each run once per deployment, not once per process (two exporters would
deliver every event twice; two staleness checks race to quarantine). Every process may serve
requests; only the process holding the lease runs background passes.

The lease is one the operating system or the database ends when its holder dies, so a
successor takes over on its next tick without a timeout to tune:

* PostgreSQL: a session-level advisory lock (``pg_try_advisory_lock``) held on a dedicated
  connection. A process that dies, or loses its connection, loses the lock.
* SQLite: an exclusive ``flock`` on ``<database>.leader`` beside the database file. The kernel
  drops it when the holding process exits, however it exits.

``Leadership.held()`` is cheap when already held (one look at ``pg_locks`` on PostgreSQL,
which also notices a connection that died or was replaced, nothing on SQLite) and tries to
take the lease when not.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import IO

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import Pool

from proofplane.service.context import Store

log = logging.getLogger(__name__)

LEADER_LOCK_KEY = 84700002  # advisory-lock key of the leader lease (the write lock is ...001)
# Whether this session still holds the lease (a key below 2^32 is classid 0, objid the key).
HOLDS_LOCK = text(
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = 0"
    " AND objid = :k AND objsubid = 1 AND granted AND pid = pg_backend_pid())"
)


class Leadership:
    """The background-work lease of one database, for this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._file: IO[bytes] | None = None
        self._leading = False
        #: times this process took the lease (a takeover shows as 1 on the new leader)
        self.acquisitions = 0
        self._users = 0

    def attach(self) -> None:
        """A worker of this process starts depending on the lease."""
        with self._lock:
            self._users += 1

    def detach(self) -> None:
        """A worker stopped; the last one gives the lease up, so a successor (another
        process, or a later server on the same database) need not wait for this one to
        exit."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0:
                self._drop(unlock=True)
                self._leading = False

    @property
    def leading(self) -> bool:
        """Whether this process held the lease at its last check (no I/O)."""
        return self._leading

    def held(self) -> bool:
        """Whether this process leads now; takes the lease when it is free."""
        with self._lock:
            was = self._leading
            try:
                self._leading = self._check() or self._acquire()
            except Exception:  # the database is unreachable: nobody can be sure; do not lead
                log.warning("leader lease: cannot check the lease", exc_info=True)
                self._drop()
                self._leading = False
            if self._leading and not was:
                self.acquisitions += 1
                log.info("this process now runs the background work (leader, pid %d)", os.getpid())
            elif was and not self._leading:
                log.warning("this process lost the leader lease (pid %d)", os.getpid())
            return self._leading

    def release(self) -> None:
        """Give the lease up (at shutdown: a successor need not wait for this process to
        exit)."""
        with self._lock:
            self._drop(unlock=True)
            self._leading = False

    # --- the two kinds of lease -------------------------------------------------------------

    def _sqlite_path(self) -> Path | None:
        if self.engine.dialect.name != "sqlite":
            return None
        database = self.engine.url.database
        return Path(f"{database}.leader") if database else None

    def _check(self) -> bool:
        if self._conn is not None:
            try:  # a reconnected session would answer SELECT 1 without holding the lock
                mine = self._conn.execute(HOLDS_LOCK, {"k": LEADER_LOCK_KEY}).scalar()
                self._conn.commit()
            except Exception:  # the connection died and took the lock with it
                mine = False
            if not mine:
                self._drop()
            return bool(mine)
        if self._file is None:
            return False
        # the lock lives on the file we opened: if <db>.leader was deleted or replaced, another
        # process can lock the new file, so this one no longer leads
        path = self._sqlite_path()
        try:
            mine = path is not None and os.fstat(self._file.fileno()).st_ino == path.stat().st_ino
        except OSError:
            mine = False
        if not mine:
            self._drop()
        return mine

    def _acquire(self) -> bool:
        path = self._sqlite_path()
        if path is not None:
            return self._acquire_file(path)
        if self.engine.dialect.name == "postgresql":
            return self._acquire_advisory()
        return True  # a database nobody else can share: this process is the deployment

    def _acquire_file(self, path: Path) -> bool:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        handle = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        except BaseException:
            handle.close()
            raise
        try:
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n".encode())
            handle.flush()
        except BaseException:
            handle.close()  # closing the descriptor also drops a lock taken above
            raise
        self._file = handle
        return True

    def _acquire_advisory(self) -> bool:
        conn = self.engine.connect()
        try:
            got = conn.execute(
                text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK_KEY}
            ).scalar()
            conn.commit()  # end the implicit transaction; the session-level lock stays
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            return False
        self._conn = conn
        return True

    def _drop(self, *, unlock: bool = False) -> None:
        """Let the lease go. ``unlock`` (a deliberate release, on a live connection) unlocks
        before closing: the server drops a closed session's locks only once its backend
        notices the disconnect, so without it a successor that asks at once can be refused."""
        conn, self._conn = self._conn, None
        if conn is not None and unlock:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LEADER_LOCK_KEY})
                conn.commit()
            except Exception:  # closing below ends the session and its lock all the same
                log.debug("leader lease: unlocking before close failed", exc_info=True)
        if conn is not None:
            try:  # closing the connection ends the session, and the session's lock
                conn.invalidate()
                conn.close()
            except Exception:
                log.debug("leader lease: closing the lease connection failed", exc_info=True)
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()  # closing the descriptor drops the flock


_LEASES: weakref.WeakKeyDictionary[Pool, Leadership] = weakref.WeakKeyDictionary()
_LEASES_LOCK = threading.Lock()


def leadership_for(store: Store) -> Leadership:
    """The one lease object of ``store``'s database in this process."""
    with _LEASES_LOCK:
        lease = _LEASES.get(store.engine.pool)
        if lease is None:
            lease = _LEASES[store.engine.pool] = Leadership(store.engine)
        return lease
