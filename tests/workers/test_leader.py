"""The leader lease (workers/leader.py): background loops run in one process per database.

On SQLite the lease is a flock beside the database file, on PostgreSQL a session advisory
lock; both end when their holder dies, which the takeover test shows with a real process
killed by SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from proofplane.service.context import Store
from proofplane.workers.base import Worker, started
from proofplane.workers.leader import Leadership, leadership_for

HOLDER = """
import sys, time
from proofplane.service.context import Store
from proofplane.workers.leader import leadership_for
lease = leadership_for(Store(sys.argv[1]))
print("held" if lease.held() else "refused", flush=True)
time.sleep(120)
"""


def _holder(db_url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, db_url], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_one_holder_at_a_time_and_release_hands_over(db_url: str) -> None:
    a, b = Store(db_url), Store(db_url)  # two engines: two processes, as far as locks go
    try:
        first, second = Leadership(a.engine), Leadership(b.engine)
        assert first.held() and first.held()  # held stays held
        assert not second.held()
        first.release()
        assert second.held() and not first.held()
        assert first.acquisitions == 1 and second.acquisitions == 1
        second.release()
    finally:
        a.dispose()
        b.dispose()


def test_a_killed_leader_is_taken_over(db_url: str) -> None:
    store = Store(db_url)
    proc = _holder(db_url)
    try:
        lease = Leadership(store.engine)
        assert not lease.held()  # the other process leads
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while not lease.held():
            assert time.monotonic() < deadline, "the lease was never freed"
            time.sleep(0.1)
        assert lease.leading and lease.acquisitions == 1
        lease.release()
    finally:
        proc.kill()
        proc.wait()
        store.dispose()


class _Counting(Worker):
    def __init__(self, store: Store) -> None:
        super().__init__("counting", 3600)
        self.store = store
        self.ran = 0

    def run_once(self) -> None:
        self.ran += 1


def test_workers_of_a_follower_skip_their_passes(db_url: str) -> None:
    leader_store, follower_store = Store(db_url), Store(db_url)
    try:
        lead, follow = _Counting(leader_store), _Counting(follower_store)
        with started(lead), started(follow):
            assert lead.leadership is leadership_for(leader_store)
            assert lead.tick() and lead.ran == 1
            assert follow.tick() and follow.ran == 0 and follow.skipped == 1
            assert follow.status()["leader"] is False and lead.status()["leader"] is True
        # the leader's last worker stopped: the lease is free for the other process
        with started(follow):
            assert follow.tick() and follow.ran == 1
    finally:
        leader_store.dispose()
        follower_store.dispose()


def test_a_worker_without_a_store_or_leader_only_off_always_runs(db_url: str) -> None:
    store = Store(db_url)
    holder = Leadership(Store(db_url).engine)
    try:
        assert holder.held()
        free = Worker("free", 3600, target=lambda: None)
        with started(free):
            assert free.leadership is None and free.tick() and free.passes == 1
        every = _Counting(store)
        every.leader_only = False
        with started(every):
            assert every.tick() and every.ran == 1
    finally:
        holder.release()
        store.dispose()


def test_a_lease_that_went_away_is_no_longer_held(db_url: str) -> None:
    """PostgreSQL: the lease's session is replaced (the connection died and was reopened);
    SQLite: ``<db>.leader`` was deleted, so another process locks a new file. Either way the
    old holder must stop leading while the other one leads."""
    store, other_store = Store(db_url), Store(db_url)
    try:
        lease, other = Leadership(store.engine), Leadership(other_store.engine)
        assert lease.held() and not other.held()
        if store.engine.dialect.name == "postgresql":
            conn = lease._conn
            assert conn is not None
            conn.invalidate()  # the server side went away
        else:
            path = lease._sqlite_path()
            assert path is not None and path.exists()
            path.unlink()
        # the lock is free to take: on PostgreSQL once the old session's backend has exited,
        # a moment after its connection closed (longer on a loaded box: CI lost that race once)
        deadline = time.monotonic() + 10
        while not other.held() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.held()
        assert not lease.held()  # and the old holder knows it lost it
        other.release()
        lease.release()
    finally:
        store.dispose()
        other_store.dispose()
