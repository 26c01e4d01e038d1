"""Execution backends: an engine runs what proofplane placed (issue 7).

The contract and its errors are re-exported here; the engines live in their modules
(``local``, ``slurm``, ``k8s``) and are built from settings by ``service.execution``.
"""

from proofplane.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    Change,
    ChangeKind,
    DrainFailed,
    JobRejected,
    JobSpec,
)

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Change",
    "ChangeKind",
    "DrainFailed",
    "JobRejected",
    "JobSpec",
]
