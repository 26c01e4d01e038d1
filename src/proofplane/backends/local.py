"""The local executor: runs each placed workload as a process group on this machine.

Per job, a directory under ``<state_dir>/jobs/<job id>/`` holds everything needed to find the
job again after a restart of the control plane:

* ``spec.json``   the command, environment and limits (written before the process starts)
* ``state.json``  the supervisor's pid and its process identity (start time in clock ticks
  since boot, and the boot id), so a reused pid is never mistaken for our job
* ``stdout.log`` / ``stderr.log``  the command's output
* ``exit.json``   the exit status, written by the supervisor when the command ends
* ``cancel.json`` written before a cancel signals the group
* ``work/``       the only directory the command can write (``/job`` inside its sandbox)

The directory is 0700 and owned by the server: the command reaches its logs only through the
file descriptors it is given and cannot forge ``exit.json``.

The sandbox (issue 19): every command runs under bubblewrap (``bwrap``) in its own mount, PID,
network, IPC and UTS namespaces. Its filesystem is built from a list of what it may see: the
system's ``/usr`` (and the ``/bin``, ``/lib`` links), a few files of ``/etc`` (users, name
resolution, certificates), the Python the server runs on, ``/sys``, a fresh ``/proc``, a
minimal ``/dev`` plus the NVIDIA device files, a private ``/tmp``, and its own ``work/`` at
``/job``. The server's database, key files, configuration, other jobs' directories and sockets
are simply not there. A server running as root drops the command to a dedicated unprivileged
user (``proofplane-job``, created on first use) that owns nothing of the server's; a server
running as another user cannot switch uid, so the command runs in a user namespace as uid
65534 (the server's uid outside it, with none of the server's files in view). When the sandbox
cannot be set up the job fails with the reason; it never runs unsandboxed. Only
``Sandbox(enabled=False)`` (``PROOFPLANE_LOCAL_SANDBOX=off``) runs commands as the server's
user, and says it is insecure wherever it can.

A job whose ``exit.json`` is missing and whose process identity no longer matches is reported
failed with the reason; nothing is guessed.

Resource limits: cgroup v2 when ``/sys/fs/cgroup`` is a writable cgroup2 hierarchy with the
needed controllers, rlimits otherwise. ``limit_mode()`` says which, and why.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from proofplane.backends.base import (
    BackendError,
    BackendUnavailable,
    Change,
    ChangeKind,
    JobRejected,
    JobSpec,
)
from proofplane.errors import NotFound
from proofplane.model import PlacedDevice

logger = logging.getLogger(__name__)

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


JOB_USER = "proofplane-job"
JOB_MOUNT = "/job"  # where the job's work directory appears inside its sandbox
USERNS_UID = 65534  # the uid a non-root server's jobs have inside their user namespace
# What of /etc a job sees: users and groups, name resolution, the dynamic linker, time zone,
# CA certificates, alternatives links. Nothing else (no shadow, no service configuration).
ETC_VISIBLE = (
    "passwd",
    "group",
    "nsswitch.conf",
    "host.conf",
    "hosts",
    "resolv.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "ssl/certs",
    "ca-certificates",
    "alternatives",
    "mime.types",
    "protocols",
    "services",
    "os-release",
)
INSECURE = "insecure: jobs run as the server's user and can read everything it can"


class SandboxUnavailable(BackendError):
    """The sandbox cannot be set up for a job (the job fails with this reason)."""

    code = "sandbox_unavailable"


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How the local executor confines commands (see the module docstring).

    ``enabled=False`` runs them as the server's user with its whole filesystem in view: for a
    developer's machine where bubblewrap cannot run, never for a shared one."""

    enabled: bool = True
    user: str = JOB_USER  # the job uid when the server runs as root (created on first use)
    bwrap: str = "bwrap"
    ro_paths: tuple[str, ...] = ()  # more read-only paths jobs may see (e.g. /opt/cuda)


def interpreter_paths() -> tuple[str, ...]:
    """The directories the server's Python lives in (outside ``/usr``), which the supervisor's
    exec stub and ``sys.executable`` commands need inside the sandbox."""
    out: list[str] = []
    for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        real = os.path.realpath(p)
        for path in (p, real):
            if path not in out and not _within(path, "/usr") and os.path.isdir(path):
                out.append(path)
    return tuple(out)


def _within(path: str, parent: str) -> bool:
    path, parent = os.path.normpath(path), os.path.normpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def bwrap_args(
    work_dir: str,
    *,
    userns: bool,
    ro_paths: tuple[str, ...] = (),
    devices: tuple[str, ...] = (),
) -> list[str]:
    """bubblewrap's options for one job: namespaces, and a filesystem of only what the job may
    see (everything not listed here does not exist for it). ``userns``: the server is not
    root, so the job gets a user namespace (uid 65534 inside) instead of a uid switch."""
    args = [
        "--die-with-parent",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "proofplane-job",
    ]
    if userns:
        args += ["--unshare-user", "--uid", str(USERNS_UID), "--gid", str(USERNS_UID)]
    else:
        # root without a user namespace keeps only what the exec stub needs to drop to the
        # job's uid (after which the kernel clears them); no_new_privs is always set
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    made: set[str] = set()

    def bind(how: str, path: str, dest: str | None = None) -> None:
        # bwrap would create a destination's parents with mode 0700 (or the host's, /root),
        # which the job user could not traverse: they are empty 0755 directories here
        for parent in reversed(Path(dest or path).parents):
            if str(parent) != "/" and str(parent) not in made:
                made.add(str(parent))
                args.extend(["--perms", "0755", "--dir", str(parent)])
        args.extend([how, path, dest or path])

    # the private /tmp first: a read-only path below /tmp (a venv in a checkout under /tmp, as
    # CI's) is then mounted on top of it instead of being hidden by it
    args += ["--perms", "1777", "--tmpfs", "/tmp"]
    made.add("/tmp")
    bind("--ro-bind", "/usr")
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            bind("--ro-bind", top)
    for name in ETC_VISIBLE:
        if os.path.exists(f"/etc/{name}"):
            bind("--ro-bind", f"/etc/{name}")
    for path in ro_paths:
        if not _within(path, "/usr"):
            bind("--ro-bind", path)
    args += ["--ro-bind-try", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev"]
    for dev in devices:  # CUDA needs them; CUDA_VISIBLE_DEVICES picks the job's GPUs
        args += ["--dev-bind", dev, dev]
    bind("--bind", work_dir, JOB_MOUNT)  # the stub enters it after the uid switch
    return args


def gpu_device_files() -> tuple[str, ...]:
    """The NVIDIA device files of this host (``/dev/nvidia*``, ``/dev/nvidia-caps`` for MIG)."""
    return tuple(sorted(glob.glob("/dev/nvidia*")))


def ensure_job_user(name: str) -> tuple[int, int]:
    """(uid, gid) of the job user, created as a system user without home or shell on first
    use. Refuses a user that is root or the server's own."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        cmd = [useradd, "--system", "--user-group", "--no-create-home"]
        cmd += ["--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"cannot create the job user {name!r}: {exc}") from exc
        try:
            entry = pwd.getpwnam(name)  # another server may have created it meanwhile
        except KeyError:
            why = done.stderr.strip() or f"useradd exit status {done.returncode}"
            raise SandboxUnavailable(f"cannot create the job user {name!r}: {why}") from None
        logger.info("created the job user %s (uid %d)", name, entry.pw_uid)
    if entry.pw_uid in (0, os.geteuid()) or entry.pw_gid == 0:
        raise SandboxUnavailable(
            f"the job user {name!r} (uid {entry.pw_uid}) is root or the server's own user"
        )
    return entry.pw_uid, entry.pw_gid


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
        sandbox: Sandbox | None = None,
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
        self.sandbox = sandbox or Sandbox()
        if not self.sandbox.enabled:
            logger.warning("the local executor's sandbox is off (%s)", INSECURE)

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
        work_dir = job_dir / "work"
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            _private_dir(self.jobs_dir)
            _private_dir(job_dir, exist_ok=False)
            work_dir.mkdir(mode=0o700)
            os.chmod(work_dir, 0o700)
        except OSError as exc:
            raise BackendUnavailable(
                f"local executor state directory {self.jobs_dir} is not usable: {exc}"
            ) from exc
        env = {**self.base_env, **job_environment(job, job_id, self.mig_resolver)}
        try:
            sandbox = self._sandbox_plan(work_dir)
        except SandboxUnavailable as exc:
            # recorded as the job's end: it fails with the reason and nothing runs
            reason = f"cannot set up the job sandbox: {exc}; the command did not run"
            logger.error("job %s: %s", job_id, reason)
            _write_json(
                job_dir / "exit.json",
                {"returncode": 126, "error": reason, "finished_at": time.time()},
            )
            return job_id
        if sandbox is not None:
            env["HOME"] = JOB_MOUNT
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
            "cwd": str(work_dir),
            "sandbox": sandbox,
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
            "sandbox": self._sandbox_description(),
            "healthy": os.access(parent, os.W_OK),
        }

    # --- beyond the protocol ------------------------------------------------------------------

    def adopt(self) -> list[str]:
        """Job ids found still running from an earlier server (for a log line at start-up);
        ``sync`` does the real re-adoption by checking each job's process identity."""
        found: list[str] = []
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

    def _sandbox_plan(self, work_dir: Path) -> dict[str, Any] | None:
        """What the supervisor needs to start the command in its sandbox (None: sandbox off).
        Raises SandboxUnavailable with the reason when it cannot be had."""
        if not self.sandbox.enabled:
            return None
        bwrap = shutil.which(self.sandbox.bwrap)
        if bwrap is None:
            raise SandboxUnavailable(
                f"{self.sandbox.bwrap!r} (Debian/Ubuntu package bubblewrap) is not installed;"
                " install it, or set PROOFPLANE_LOCAL_SANDBOX=off to run jobs unsandboxed"
                f" ({INSECURE})"
            )
        ro_paths = tuple(dict.fromkeys((*interpreter_paths(), *self.sandbox.ro_paths)))
        data_dir = str(self.state_dir.resolve().parent)  # where the SQLite database lives
        for path in ro_paths:
            if path in ("/", "") or _within(data_dir, path):
                raise SandboxUnavailable(
                    f"the read-only path {path} that jobs see holds the server's data"
                    f" directory {data_dir}; move the state directory out of it"
                )
        userns = os.geteuid() != 0
        if userns:
            uid = gid = -1  # no switch: bwrap's user namespace gives uid 65534 inside
        else:
            uid, gid = ensure_job_user(self.sandbox.user)
            try:
                os.chown(work_dir, uid, gid)
            except OSError as exc:
                raise SandboxUnavailable(f"cannot give {work_dir} to the job user: {exc}") from exc
        return {
            "bwrap": bwrap,
            "args": bwrap_args(
                str(work_dir), userns=userns, ro_paths=ro_paths, devices=gpu_device_files()
            ),
            "uid": uid,
            "gid": gid,
            "cwd": JOB_MOUNT,
        }

    def _sandbox_description(self) -> str:
        if not self.sandbox.enabled:
            return f"off ({INSECURE})"
        if os.geteuid() == 0:
            return f"bubblewrap namespaces, as the unprivileged user {self.sandbox.user}"
        return (
            f"bubblewrap namespaces, in a user namespace as uid {USERNS_UID} (the server is not"
            " root: outside the namespace the job has the server's uid, but none of its files)"
        )

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


def _private_dir(path: Path, *, exist_ok: bool = True) -> None:
    """A directory only its owner can enter: 0700 whatever the umask (a directory that already
    exists is tightened too)."""
    path.mkdir(mode=0o700, exist_ok=exist_ok)
    os.chmod(path, 0o700)


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
