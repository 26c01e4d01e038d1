"""What the server's defragmentation step needs from the store (issue 17, §3): the move budget
left in the rolling hour, counted from the audit record, and which held workloads may move.

The planner (``schedule.defrag``) is pure; ``service.scheduling`` builds its ``Defragmenter``
from these two answers once per transaction (on the first MIG request that waits) and persists
the moves it makes. Below scheduling: nothing here imports it.

* **Budget**: ``PROOFPLANE_DEFRAG_MAX_MOVES_PER_HOUR`` (default 20; 0 turns defragmentation
  off) less the moves recorded in the last hour: every ``workload.evict`` event with reason
  ``defragmentation`` is one move. The record is the one source: replicas and restarts share it.
* **Eligibility**: a workload holding capacity may move when it declares itself restartable
  (``restartable``: it checkpoints itself) or when it is idle: placed, with no engine job
  started (no job row in a live state).
"""

from __future__ import annotations

from collections.abc import Hashable
from datetime import datetime, timedelta

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from proofplane.config import defrag_max_moves_per_hour
from proofplane.model import WorkloadStatus
from proofplane.schedule.reasons import DEFRAGMENTATION
from proofplane.service.jobs import LIVE_STATES
from proofplane.store.tables import EventRow, ExecutionJobRow, WorkloadRow

WINDOW = timedelta(hours=1)
MOVE_ACTION = "workload.evict"  # a move is an eviction (then a placement) with this reason


def max_moves_per_hour() -> int:
    """``PROOFPLANE_DEFRAG_MAX_MOVES_PER_HOUR`` (``config``; ``serve`` checked it at start)."""
    return defrag_max_moves_per_hour()


def moves_in_window(session: Session, now: datetime) -> int:
    """Defragmentation moves recorded in the hour before ``now``."""
    rows = session.execute(
        select(EventRow.details).where(
            EventRow.action == MOVE_ACTION, EventRow.ts > now - WINDOW, EventRow.ts <= now
        )
    )
    return sum(1 for (details,) in rows if (details or {}).get("reason") == DEFRAGMENTATION)


def budget_left(session: Session, now: datetime) -> int:
    """Moves defragmentation may still make in the rolling hour ending ``now``."""
    top = max_moves_per_hour()
    if top == 0:
        return 0
    return max(0, top - moves_in_window(session, now))


class Movable:
    """``movable(key)`` for the planner: whether the workload of row id ``key`` may move. Reads
    the store once, on the first question; a workload this transaction placed after that read
    (a batch's earlier items) is looked up on its own when first asked about."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._seen: frozenset[Hashable] | None = None  # holding capacity at the read
        self._ok: set[Hashable] = set()
        self._late: dict[Hashable, bool] = {}

    def __call__(self, key: Hashable) -> bool:
        if self._seen is None:
            self._load()
        assert self._seen is not None
        if key in self._seen:
            return key in self._ok
        found = self._late.get(key)
        if found is None:
            found = self._late[key] = self._one(key)
        return found

    def _load(self) -> None:
        holds = (WorkloadStatus.PLACED.value, WorkloadStatus.RUNNING.value)
        session = self.session
        rows = session.execute(
            select(WorkloadRow.id, WorkloadRow.status, WorkloadRow.restartable, _LIVE).where(
                WorkloadRow.status.in_(holds)
            )
        )
        seen = set()
        for wid, status, restartable, live in rows:
            seen.add(wid)
            if restartable or (status == WorkloadStatus.PLACED.value and not live):
                self._ok.add(wid)
        self._seen = frozenset(seen)

    def _one(self, key: Hashable) -> bool:
        """A workload placed in this transaction: restartable, or no job started yet."""
        row = self.session.execute(
            select(WorkloadRow.restartable, _LIVE).where(WorkloadRow.id == key)
        ).first()
        return row is not None and bool(row[0] or not row[1])


_LIVE = (
    exists()
    .where(ExecutionJobRow.workload_id == WorkloadRow.id, ExecutionJobRow.state.in_(LIVE_STATES))
    .label("live")
)
