"""The checkpoint signer: signs the audit log every ``interval_s`` when it grew."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from proofplane.access import SYSTEM
from proofplane.service.audit import AuditKeys, sign_checkpoint
from proofplane.service.context import Store
from proofplane.workers.base import Worker, started


class CheckpointWorker(Worker):
    """Signs a checkpoint every ``interval_s`` seconds when the log grew (server thread). A
    failed round is kept in ``last_error`` (cleared by the next success) and retried at the
    next tick."""

    def __init__(self, store: Store, keys: AuditKeys, interval_s: float) -> None:
        super().__init__("audit-checkpoints", interval_s)
        self.store, self.keys, self.actor = store, keys, SYSTEM

    def run_once(self) -> str | None:
        return sign_checkpoint(
            self.store, self.actor, self.keys, datetime.now(UTC), only_if_grown=True
        )

    def on_error(self, exc: Exception) -> None:
        pass  # keep serving; ``last_error`` says what failed and the next round retries


@contextmanager
def checkpoint_worker(
    store: Store, keys: AuditKeys, interval_s: float | None
) -> Iterator[CheckpointWorker | None]:
    """The checkpoint signer for the duration of the block (none when ``interval_s`` is
    falsy)."""
    worker = CheckpointWorker(store, keys, interval_s) if interval_s else None
    with started(worker) as running:
        yield running
