"""The server's background loops, each on one :class:`Worker` base (start, prompt stop,
interval, jitter, error backoff, the time of the last success).

A worker calls application-service functions (``proofplane.service``) on a timer; it holds no
use case of its own. The API server's lifespan runs them (``proofplane.api.app``); the demo's
attester (``proofplane.demo``) is one too.
"""

from proofplane.workers.base import Worker, started
from proofplane.workers.checkpoints import CheckpointWorker, checkpoint_worker
from proofplane.workers.reconcile import SyncWorker, sync_worker
from proofplane.workers.siem import ExportWorker, export_worker
from proofplane.workers.staleness import StaleWorker, stale_worker

__all__ = [
    "CheckpointWorker",
    "ExportWorker",
    "StaleWorker",
    "SyncWorker",
    "Worker",
    "checkpoint_worker",
    "export_worker",
    "stale_worker",
    "started",
    "sync_worker",
]
