"""Workloads, what they ask for, and where they were placed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from proofplane.model.tenant import IsolationLevel


class WorkloadStatus(StrEnum):
    PENDING = "pending"  # waiting for compliant capacity; ``reason`` says why
    PLACED = "placed"  # capacity reserved on a node; handed to the execution backend
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def holds_capacity(self) -> bool:
        return self in (WorkloadStatus.PLACED, WorkloadStatus.RUNNING)


_TERMINAL = frozenset({WorkloadStatus.SUCCEEDED, WorkloadStatus.FAILED, WorkloadStatus.CANCELLED})

MAX_BATCH = 1000  # workloads in one batch submission: one transaction, all or nothing
# A workload's command is stored for good in its submission event and shipped to every SIEM
# (issue 19, §3); a longer script belongs in a file on the node or in the image.
MAX_COMMAND_ARGS = 256  # arguments
MAX_COMMAND_ARG_CHARS = 4096  # characters in one argument
MAX_COMMAND_CHARS = 16384  # characters in all arguments together
MAX_SKU_CHARS = 63  # a GPU model or a MIG profile name (what the tables' columns hold)

MAX_CPU_MILLI = 2**31 - 1  # what the 32-bit columns hold: ~2 million cores
MAX_MEMORY_MIB = 2**31 - 1  # ~2 PiB


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """Exactly one shape: ``count`` whole GPUs, ``count`` MIG slices of ``mig_profile``, or a
    ``share_milli`` fraction (1..999 thousandths) of one GPU. ``model`` pins a GPU SKU.

    ``nodes`` > 1 makes a gang: ``count`` whole GPUs in total, ``count // nodes`` on each of
    ``nodes`` distinct nodes, placed all together or not at all (Slurm's ``--nodes`` with
    ``--gpus-per-node``)."""

    count: int = 1
    model: str | None = None
    mig_profile: str | None = None
    share_milli: int | None = None
    nodes: int = 1

    @property
    def per_node(self) -> int:
        """Whole GPUs (or MIG instances) each node of the placement holds."""
        return self.count // self.nodes if self.nodes > 0 else self.count

    @property
    def natural_isolation(self) -> IsolationLevel:
        if self.mig_profile is not None:
            return IsolationLevel.MIG
        if self.share_milli is not None:
            return IsolationLevel.SHARED
        return IsolationLevel.EXCLUSIVE_GPU

    def to_row(self) -> dict[str, Any]:
        """The workload table's columns that hold this request, by column name."""
        return {
            "gpu_count": self.count,
            "gpu_model": self.model,
            "mig_profile": self.mig_profile,
            "share_milli": self.share_milli,
            "gpu_nodes": self.nodes,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any] | Any) -> GpuRequest:
        """Back from those columns: a mapping of column values (what ``to_row`` gives, an
        insert's parameters) or an object with them as attributes (a workload row)."""
        if isinstance(row, Mapping):
            return cls(
                count=row["gpu_count"],
                model=row["gpu_model"],
                mig_profile=row["mig_profile"],
                share_milli=row["share_milli"],
                nodes=row["gpu_nodes"],
            )
        return cls(
            count=row.gpu_count,
            model=row.gpu_model,
            mig_profile=row.mig_profile,
            share_milli=row.share_milli,
            nodes=row.gpu_nodes,
        )


class TopologyMode(StrEnum):
    """How a gang's topology request binds (issue 17 §4)."""

    REQUIRED = "required"  # every member in one domain at the level, or the gang waits
    PREFERRED = "preferred"  # as few domains as the cluster allows now; never waits for it


@dataclass(frozen=True, slots=True)
class TopologyRequest:
    """A gang's ask to be packed into the fewest domains at ``level`` (one of
    ``model.node.TOPOLOGY_LEVELS``). Only gangs (``gpus.nodes`` > 1) carry one."""

    level: str
    mode: TopologyMode = TopologyMode.REQUIRED

    def to_json(self) -> dict[str, str]:
        return {"level": self.level, "mode": self.mode.value}

    @classmethod
    def from_json(cls, value: Mapping[str, Any] | None) -> TopologyRequest | None:
        if not value:
            return None
        return cls(str(value["level"]), TopologyMode(value["mode"]))


@dataclass(frozen=True, slots=True)
class PlacedDevice:
    """One device a placement holds: a whole GPU, a MIG instance, or a share of a GPU."""

    gpu_index: int
    gpu_uuid: str
    mig_profile: str | None = None
    mig_start: int | None = None
    share_milli: int | None = None


def devices_json(devices: Iterable[PlacedDevice]) -> list[dict[str, Any]]:
    """A placement's devices as the placement row stores them and the API answers them."""
    return [
        {
            "gpu_index": d.gpu_index,
            "gpu_uuid": d.gpu_uuid,
            "mig_profile": d.mig_profile,
            "mig_start": d.mig_start,
            "share_milli": d.share_milli,
        }
        for d in devices
    ]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a workload holds capacity. ``node`` and ``devices`` are its first (for most
    workloads its only) node; a gang placement lists every node and its devices in
    ``members``, the first member being ``node``/``devices`` again."""

    node: str
    devices: tuple[PlacedDevice, ...]
    members: tuple[Placement, ...] = ()

    @property
    def parts(self) -> tuple[Placement, ...]:
        """Every (node, devices) part of the placement: the members, or the placement itself."""
        return self.members or (Placement(self.node, self.devices),)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(p.node for p in self.parts)

    @staticmethod
    def of_parts(parts: tuple[Placement, ...]) -> Placement:
        """A placement from its parts: one part is a plain placement, several a gang."""
        first = parts[0]
        if len(parts) == 1:
            return Placement(first.node, first.devices)
        return Placement(
            first.node, first.devices, tuple(Placement(p.node, p.devices) for p in parts)
        )


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    tenant: str
    tags: dict[str, str] = field(default_factory=dict)
    isolation: IsolationLevel = IsolationLevel.EXCLUSIVE_GPU
    gpus: GpuRequest = field(default_factory=GpuRequest)
    priority: int = 0
    command: tuple[str, ...] = ()
    status: WorkloadStatus = WorkloadStatus.PENDING
    reason: str | None = None
    placement: Placement | None = None
    reason_details: dict[str, Any] | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    co_residency: bool = True  # may its MIG slice or share sit on a GPU with other tenants'?
    cpu_milli: int = 0  # issue 17: CPU (milli-cores) and memory (MiB) it asks for, besides GPUs
    memory_mib: int = 0
    # issue 17 §3: it may be stopped and started again elsewhere (it checkpoints itself), so
    # defragmentation may move it while it runs; False: only while idle (no job started)
    restartable: bool = False
    topology: TopologyRequest | None = None  # issue 17 §4: a gang's packing request
