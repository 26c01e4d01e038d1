"""The local executor: runs each placed workload as a process group on this machine.

Per job, a directory under ``<state_dir>/jobs/<job id>/`` holds everything needed to find the
job again after a restart of the control plane:

* ``spec.json``   the command, environment and limits (written before the process starts)
* ``state.json``  the supervisor's pid and its process identity (start time in clock ticks
  since boot, and the boot id), so a reused pid is never mistaken for our job
* ``stdout.log`` / ``stderr.log``  the command's output
* ``exit.json``   the exit status, written by the supervisor when the command ends
* ``cancel.json`` written before a cancel signals the group

A job whose ``exit.json`` is missing and whose process identity no longer matches is reported
failed with the reason; nothing is guessed.

Resource limits: cgroup v2 when ``/sys/fs/cgroup`` is a writable cgroup2 hierarchy with the
needed controllers, rlimits otherwise. ``limit_mode()`` says which, and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from proofplane.backends.base import (
    BackendUnavailable,
    Change,
    ChangeKind,
    JobRejected,
    JobSpec,
)
from proofplane.errors import NotFound
from proofplane.model import PlacedDevice

SUPERVISOR = Path(__file__).with_name("_supervise.py")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-.")

# (gpu uuid, mig profile, mig start) -> the MIG device UUID CUDA expects, or None if unknown.
MigResolver = Callable[[str, str, int], str | None]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-job resource limits; None means not limited."""

    memory_mb: int | None = None
    cpus: float | None = None  # cgroup v2 only (cpu.max); rlimits cannot express a CPU share
    pids: int | None = None  # cgroup v2 pids.max; rlimit NPROC is per user, so not used
    cpu_seconds: int | None = None  # rlimit CPU (total CPU time)
    nofile: int | None = 4096


@dataclass(frozen=True, slots=True)
class LimitMode:
    mode: str  # "cgroup2" | "rlimit"
    reason: str
    parent: str | None = None  # the cgroup under which jobs get their own cgroup


def simulated_mig_uuid(gpu_uuid: str, profile: str, start: int) -> str:
    """A stand-in MIG device id for simulated nodes (no NVML on this host). Real nodes must
    resolve MIG device UUIDs through NVML; this id only keeps the demo honest about *which*
    slice a job was given."""
    return f"MIG-SIM-{gpu_uuid.removeprefix('GPU-')}-{profile}-{start}"


def cuda_visible_devices(
    devices: tuple[PlacedDevice, ...], mig_resolver: MigResolver = simulated_mig_uuid
) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a placement: GPU UUIDs for whole GPUs and shares, MIG
    device UUIDs for MIG instances (never indices: indices change when MIG is reconfigured,
    UUIDs do not). Pure."""
    out: list[str] = []
    for d in devices:
        if d.mig_profile is not None:
            assert d.mig_start is not None
            uuid = mig_resolver(d.gpu_uuid, d.mig_profile, d.mig_start)
            if uuid is None:
                raise JobRejected(
                    f"no MIG device {d.mig_profile} at slot {d.mig_start} on GPU {d.gpu_uuid}",
                    details={"gpu": d.gpu_uuid, "profile": d.mig_profile, "start": d.mig_start},
                )
            out.append(uuid)
        elif d.gpu_uuid not in out:
            out.append(d.gpu_uuid)
    return ",".join(out)


def job_environment(
    job: JobSpec, job_id: str, mig_resolver: MigResolver = simulated_mig_uuid
) -> dict[str, str]:
    """The variables proofplane sets for a job (merged over a minimal base environment)."""
    part = job.placement.parts[0]
    env = {
        "CUDA_VISIBLE_DEVICES": cuda_visible_devices(part.devices, mig_resolver),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PROOFPLANE_JOB_ID": job_id,
        "PROOFPLANE_WORKLOAD": job.workload,
        "PROOFPLANE_TENANT": job.tenant,
        "PROOFPLANE_NODE": part.node,
        "PROOFPLANE_NODES": ",".join(job.placement.nodes),
        "PROOFPLANE_GPU_INDICES": ",".join(str(d.gpu_index) for d in part.devices),
    }
    shares = [d.share_milli for d in part.devices if d.share_milli is not None]
    if shares:
        env["PROOFPLANE_GPU_SHARE_MILLI"] = str(shares[0])
    return env


def rlimits_for(limits: Limits) -> dict[str, int]:
    """The rlimits the supervisor sets when cgroups are not available. Pure."""
    out: dict[str, int] = {"core": 0}
    if limits.memory_mb is not None:
        out["as"] = limits.memory_mb * 1024 * 1024
    if limits.cpu_seconds is not None:
        out["cpu"] = limits.cpu_seconds
    if limits.nofile is not None:
        out["nofile"] = limits.nofile
    return out


def cgroup_settings(limits: Limits) -> dict[str, str]:
    """cgroup v2 interface files and their values for ``limits``. Pure."""
    out: dict[str, str] = {}
    if limits.memory_mb is not None:
        out["memory.max"] = str(limits.memory_mb * 1024 * 1024)
        out["memory.swap.max"] = "0"
    if limits.pids is not None:
        out["pids.max"] = str(limits.pids)
    if limits.cpus is not None:
        period = 100_000
        out["cpu.max"] = f"{int(limits.cpus * period)} {period}"
    return out


def detect_limit_mode(
    root: Path = CGROUP_ROOT, parent_name: str = "proofplane", *, probe_only: bool = False
) -> LimitMode:
    """cgroup v2 if ``root`` is a cgroup2 hierarchy where we can create a parent cgroup with
    the memory, pids and cpu controllers delegated to it; rlimits otherwise, with the reason.
    ``probe_only``: change nothing, judge by permissions (for read-only views)."""
    if not (root / "cgroup.controllers").is_file():
        return LimitMode("rlimit", f"{root} is not a cgroup v2 hierarchy (cgroup v1 or none)")
    available = set((root / "cgroup.controllers").read_text().split())
    wanted = {"memory", "pids", "cpu"}
    if not wanted <= available:
        missing = ", ".join(sorted(wanted - available))
        return LimitMode("rlimit", f"cgroup v2 lacks the controllers: {missing}")
    parent = root / parent_name
    if probe_only:
        if os.access(root, os.W_OK):
            return LimitMode("cgroup2", f"cgroup v2 under {parent} (probed)", str(parent))
        return LimitMode("rlimit", f"cgroup v2 at {root} is not writable by this process")
    try:
        enabled = set((root / "cgroup.subtree_control").read_text().split())
        if not wanted <= enabled:
            (root / "cgroup.subtree_control").write_text(
                " ".join(f"+{c}" for c in sorted(wanted - enabled))
            )
        parent.mkdir(exist_ok=True)
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
    except OSError as exc:
        return LimitMode("rlimit", f"cgroup v2 is not writable here: {exc}")
    return LimitMode("cgroup2", f"cgroup v2 under {parent}", str(parent))


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # pragma: no cover - not Linux
        return "unknown"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces
    return fields[0], int(fields[19])


class LocalExecutor:
    """Runs workloads as local processes. Thread-compatible (one caller at a time per job)."""

    name = "local"

    def __init__(
        self,
        state_dir: Path | str,
        *,
        limits: Limits | None = None,
        mig_resolver: MigResolver = simulated_mig_uuid,
        kill_grace_s: float = 5.0,
        limit_mode: LimitMode | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.jobs_dir = self.state_dir / "jobs"
        self.limits = limits or Limits()
        self.mig_resolver = mig_resolver
        self.kill_grace_s = kill_grace_s
        self._limit_mode = limit_mode
        self.base_env = dict(
            base_env
            if base_env is not None
            else {k: os.environ[k] for k in ("PATH", "LANG", "HOME") if k in os.environ}
        )
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def limit_mode(self) -> LimitMode:
        """Detected on first use (it may create the parent cgroup), then fixed."""
        if self._limit_mode is None:
            self._limit_mode = detect_limit_mode()
        return self._limit_mode

    # --- the Backend protocol -----------------------------------------------------------------

    def submit(self, job: JobSpec) -> str:
        if not job.command:
            raise JobRejected(
                f"workload {job.key} has no command to run", details={"workload": job.workload}
            )
        job_id = f"{job.tenant}.{job.workload}.{secrets.token_hex(4)}"
        job_dir = self.jobs_dir / job_id
        try:
            job_dir.mkdir(parents=True)
        except OSError as exc:
            raise BackendUnavailable(
                f"local executor state directory {self.jobs_dir} is not usable: {exc}"
            ) from exc
        env = {**self.base_env, **job_environment(job, job_id, self.mig_resolver)}
        spec: dict[str, Any] = {
            "job_id": job_id,
            "workload": job.workload,
            "tenant": job.tenant,
            "command": list(job.command),
            "env": env,
            "limits": asdict(self.limits),
            "limit_mode": self.limit_mode.mode,
            "cgroup": self._make_cgroup(job_id),
            "rlimits": rlimits_for(self.limits) if self.limit_mode.mode == "rlimit" else {},
        }
        _write_json(job_dir / "spec.json", spec)
        try:
            with open(job_dir / "supervisor.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-I", str(SUPERVISOR), str(job_dir)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,  # own session and process group: pgid == pid
                    close_fds=True,
                )
        except OSError as exc:
            raise BackendUnavailable(f"cannot start the job supervisor: {exc}") from exc
        stat = _proc_stat(proc.pid)
        _write_json(
            job_dir / "state.json",
            {
                "pid": proc.pid,
                "pgid": proc.pid,
                "starttime": stat[1] if stat else None,
                "boot_id": _boot_id(),
                "started_at": time.time(),
            },
        )
        self._children[job_id] = proc
        return job_id

    def cancel(self, job_id: str) -> None:
        job_dir = self._job_dir(job_id)
        if job_dir is None or (job_dir / "exit.json").exists():
            return
        if not (job_dir / "cancel.json").exists():
            _write_json(job_dir / "cancel.json", {"requested_at": time.time()})
        state = _read_json(job_dir / "state.json")
        if state is None or not self._alive(job_id, state):
            return
        pgid = int(state["pgid"])
        _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline:
            if not self._alive(job_id, state) or (job_dir / "exit.json").exists():
                break
            time.sleep(0.02)
        # Whatever of the group is left (a command that ignores SIGTERM) is killed; the
        # supervisor too, if the command outlived the grace period.
        if not (job_dir / "exit.json").exists() or _group_exists(pgid):
            _killpg(pgid, signal.SIGKILL)
            # SIGKILL is delivered asynchronously: return once nothing of the group runs
            # (zombies waiting for a reaper do not count), or after a bounded wait
            deadline = time.monotonic() + 2.0
            while _group_running(pgid) and time.monotonic() < deadline:
                time.sleep(0.01)
        self._reap(job_id)

    def sync(self, job_ids: Collection[str]) -> list[Change]:
        return [self._status(job_id) for job_id in job_ids]

    def drain(self, node: str, reason: str) -> None:
        """Every job runs on this one machine: there is no node to drain in the engine.
        proofplane's own placement already stops sending work to a quarantined node."""

    def resume(self, node: str) -> None:
        """See ``drain``."""

    def describe(self) -> dict[str, Any]:
        """Read-only: creates no directory and no cgroup."""
        mode = self._limit_mode or detect_limit_mode(probe_only=True)
        parent = self.state_dir
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        return {
            "name": self.name,
            "state_dir": str(self.state_dir),
            "limits": {k: v for k, v in asdict(self.limits).items() if v is not None},
            "limit_mode": mode.mode,
            "limit_mode_reason": mode.reason,
            "healthy": os.access(parent, os.W_OK),
        }

    # --- beyond the protocol ------------------------------------------------------------------

    def adopt(self) -> list[str]:
        """Job ids found still running from an earlier server (for a log line at start-up);
        ``sync`` does the real re-adoption by checking each job's process identity."""
        found = []
        if not self.jobs_dir.is_dir():
            return found
        for job_dir in sorted(self.jobs_dir.iterdir()):
            state = _read_json(job_dir / "state.json")
            if state and not (job_dir / "exit.json").exists() and self._alive(job_dir.name, state):
                found.append(job_dir.name)
        return found

    def logs(self, job_id: str, stream: str = "stdout", tail_bytes: int | None = None) -> bytes:
        """The captured output of a job (the last ``tail_bytes`` when given)."""
        if stream not in ("stdout", "stderr"):
            raise ValueError("stream is stdout or stderr")
        job_dir = self._job_dir(job_id)
        if job_dir is None:
            raise NotFound(f"no local job {job_id!r}", details={"job_id": job_id})
        path = job_dir / f"{stream}.log"
        if not path.exists():
            return b""
        with open(path, "rb") as f:
            if tail_bytes is not None:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail_bytes))
            return f.read()

    def wait(self, job_id: str, timeout_s: float = 10.0) -> Change:
        """Poll until the job is no longer running (tests, the demo)."""
        deadline = time.monotonic() + timeout_s
        while True:
            change = self._status(job_id)
            if change.kind is not ChangeKind.RUNNING or time.monotonic() > deadline:
                return change
            time.sleep(0.02)

    # --- internals ----------------------------------------------------------------------------

    def _job_dir(self, job_id: str) -> Path | None:
        if not job_id or not set(job_id) <= _JOB_ID_CHARS or job_id.startswith("."):
            return None
        job_dir = self.jobs_dir / job_id
        return job_dir if job_dir.is_dir() else None

    def _make_cgroup(self, job_id: str) -> str | None:
        if self.limit_mode.mode != "cgroup2" or self.limit_mode.parent is None:
            return None
        path = Path(self.limit_mode.parent) / job_id
        try:
            path.mkdir()
            for name, value in cgroup_settings(self.limits).items():
                (path / name).write_text(value)
        except OSError as exc:
            raise BackendUnavailable(f"cannot create the job's cgroup {path}: {exc}") from exc
        return str(path)

    def _reap(self, job_id: str) -> None:
        proc = self._children.get(job_id)
        if proc is not None and proc.poll() is not None:
            del self._children[job_id]

    def _alive(self, job_id: str, state: dict[str, Any]) -> bool:
        """Is the job's supervisor still the process we started (not a zombie, not a reused
        pid, not from before a reboot)?"""
        self._reap(job_id)
        if state.get("boot_id") != _boot_id():
            return False
        stat = _proc_stat(int(state["pid"]))
        return stat is not None and stat[0] not in ("Z", "X") and stat[1] == state["starttime"]

    def _status(self, job_id: str) -> Change:
        job_dir = self._job_dir(job_id)
        if job_dir is None:
            return Change(
                ChangeKind.FAILED,
                job_id,
                message="the local executor has no record of this job (state directory lost)",
            )
        state = _read_json(job_dir / "state.json")
        running = state is not None and self._alive(job_id, state)
        exit_info = _read_json(job_dir / "exit.json")  # read after the liveness check: no race
        cancelled = (job_dir / "cancel.json").exists()
        if exit_info is None and running:
            return Change(ChangeKind.RUNNING, job_id, message=f"pid {state['pid']}")  # type: ignore[index]
        if cancelled:
            return Change(ChangeKind.CANCELLED, job_id, message="cancelled")
        if exit_info is None:
            if state is not None and state.get("boot_id") != _boot_id():
                why = "the host rebooted while the job ran"
            else:
                pid = state["pid"] if state else "?"
                why = f"process {pid} ended without an exit status (killed outside proofplane?)"
            return Change(ChangeKind.FAILED, job_id, message=f"job lost: {why}")
        rc = int(exit_info["returncode"])
        if rc == 0:
            return Change(ChangeKind.SUCCEEDED, job_id, message="exit status 0", exit_code=0)
        if "error" in exit_info:
            message = str(exit_info["error"])
        elif rc < 0:
            message = f"killed by signal {-rc} ({signal.Signals(-rc).name})"
        else:
            message = f"exit status {rc}"
        return Change(ChangeKind.FAILED, job_id, message=message, exit_code=rc)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive and not a zombie (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
