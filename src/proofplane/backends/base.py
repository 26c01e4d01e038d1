"""The execution-backend contract: what proofplane asks of an engine, and what it hears back.

proofplane decides *where* a workload runs; an engine (a local process, Slurm, Kubernetes) runs
it. The contract is deliberately small: ``submit`` a placed workload and get the engine's job
id, ``cancel`` it, ``sync`` the status of the jobs proofplane believes are live, ``drain`` and
``resume`` a node. Everything an engine says comes back as values (``Change``); turning them
into events and status changes is the service layer's job (``service/execution.py``).

Errors form one hierarchy so that callers can act on the *kind* of failure:

* ``BackendUnavailable`` — the engine cannot be reached; nothing happened, try again later.
* ``JobRejected`` — the engine refused this job; retrying the same job will not help.
* ``DrainFailed`` — a drain or resume did not take effect; must be reported, never ignored.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from proofplane.errors import ProofplaneError
from proofplane.model import (
    GpuRequest,
    IsolationLevel,
    Placement,
    Workload,
    WorkloadStatus,
)


class BackendError(ProofplaneError):
    """Base class of every error an execution backend raises."""

    code = "backend_error"


class BackendUnavailable(BackendError):
    """The engine cannot be reached (daemon down, command missing, timeout). Retry later."""

    code = "backend_unavailable"


class JobRejected(BackendError):
    """The engine refused the job (bad request, unknown node, unsupported shape)."""

    code = "job_rejected"


class DrainFailed(BackendError):
    """A drain or resume of a node did not take effect in the engine."""

    code = "drain_failed"


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything an engine needs to run one placed workload, and nothing else."""

    workload: str
    tenant: str
    command: tuple[str, ...]
    placement: Placement
    tags: dict[str, str] = field(default_factory=dict)
    isolation: IsolationLevel = IsolationLevel.EXCLUSIVE_GPU
    gpus: GpuRequest = field(default_factory=GpuRequest)
    gpu_models: dict[str, str] = field(default_factory=dict)  # GPU UUID -> model (inventory)

    @classmethod
    def of(cls, workload: Workload, gpu_models: dict[str, str] | None = None) -> JobSpec:
        """The job for a workload the scheduler has placed; anything else is a caller bug."""
        if workload.status is not WorkloadStatus.PLACED or workload.placement is None:
            raise JobRejected(
                f"workload {workload.name!r} is {workload.status.value}, not placed",
                details={"workload": workload.name, "status": workload.status.value},
            )
        return cls(
            workload=workload.name,
            tenant=workload.tenant,
            command=tuple(workload.command),
            placement=workload.placement,
            tags=dict(workload.tags),
            isolation=workload.isolation,
            gpus=workload.gpus,
            gpu_models=dict(gpu_models or {}),
        )

    @property
    def key(self) -> str:
        """``tenant/workload``: unique in a cluster, used to name jobs in engines."""
        return f"{self.tenant}/{self.workload}"


class ChangeKind(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NODE_LOST = "node_lost"  # a node the engine considers down; ``job_id`` is None


@dataclass(frozen=True, slots=True)
class Change:
    """One thing an engine reports. For job changes ``job_id`` is set; for ``node_lost``
    ``node`` is. ``devices`` lists the GPU indices the engine actually allocated where it
    says so (Slurm), so a divergence from proofplane's placement can be detected."""

    kind: ChangeKind
    job_id: str | None = None
    node: str | None = None
    message: str = ""
    exit_code: int | None = None
    devices: dict[str, tuple[int, ...]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "message": self.message}
        if self.job_id is not None:
            out["job_id"] = self.job_id
        if self.node is not None:
            out["node"] = self.node
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        if self.devices is not None:
            out["devices"] = {n: list(ix) for n, ix in self.devices.items()}
        return out


@runtime_checkable
class Backend(Protocol):
    """An execution engine. Implementations are thin: they translate, run a command or a
    request, and parse the answer; every decision is proofplane's."""

    name: str

    def submit(self, job: JobSpec) -> str:
        """Hand a placed workload to the engine; returns the engine's job id."""
        ...

    def cancel(self, job_id: str) -> None:
        """Stop the job. Cancelling a job the engine no longer knows is not an error."""
        ...

    def sync(self, job_ids: Collection[str]) -> list[Change]:
        """The current state of ``job_ids`` (the jobs proofplane believes live) as changes,
        plus ``node_lost`` for every node the engine reports down."""
        ...

    def drain(self, node: str, reason: str) -> None:
        """Send no new work to ``node``; running work keeps running."""
        ...

    def resume(self, node: str) -> None:
        """Accept new work on ``node`` again."""
        ...

    def describe(self) -> dict[str, Any]:
        """What ``proofplane backends list`` shows: kind, options, health, limits."""
        ...
