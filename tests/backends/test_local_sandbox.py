"""The local executor's sandbox (issue 19, §1): a workload attacks the host it runs on.

A job's command tries to read the server's database, its audit signing key, another tenant's
job files and the server's socket, and to reach the network: every attempt fails, the job runs
as a uid that is not the server's, its directory is 0700, and a sandbox that cannot be set up
fails the job with the reason instead of running it unsandboxed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci import unavailable
from proofplane import config
from proofplane.backends.base import ChangeKind, JobSpec
from proofplane.backends.local import (
    JOB_MOUNT,
    USERNS_UID,
    LimitMode,
    LocalExecutor,
    Sandbox,
    bwrap_args,
)
from proofplane.errors import ValidationFailed
from proofplane.model import PlacedDevice, Placement

PY = sys.executable
RLIMIT = LimitMode("rlimit", "forced by the test")


def _bwrap_usable() -> None:
    if shutil.which("bwrap") is None:
        unavailable("bwrap (Debian package bubblewrap) is not installed")
    probe = ["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "true"]
    if os.geteuid() != 0:
        probe.insert(1, "--unshare-user")
    done = subprocess.run(probe, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        unavailable(f"bwrap cannot create namespaces here: {done.stderr.strip()}")


def job(command: list[str], name: str = "w1", tenant: str = "t1") -> JobSpec:
    devices = (PlacedDevice(0, "GPU-aaaa"),)
    return JobSpec(
        workload=name, tenant=tenant, command=tuple(command), placement=Placement("n1", devices)
    )


@pytest.fixture
def server(tmp_path: Path) -> dict[str, Path]:
    """A server's data directory as a real install lays it out: the SQLite database with its
    WAL, the audit signing key (0600), a socket, and the executor's state next to the DB."""
    _bwrap_usable()
    data = tmp_path / "data"
    data.mkdir()
    db = data / "proofplane.db"
    db.write_text("SQLite format 3 - users, tokens, every tenant's workloads")
    os.chmod(db, 0o644)  # what SQLite leaves under the usual umask
    (data / "proofplane.db-wal").write_text("wal")
    key = data / "audit-signing.key"
    key.write_text("ed25519 private key")
    os.chmod(key, 0o600)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(data / "server.sock"))
    return {"data": data, "db": db, "key": key, "sock": data / "server.sock", "tmp": tmp_path}


# What the attacking workload tries; it prints {attempt: "ok: ..." | error class name}.
ATTACK = r"""
import json, os, socket, subprocess, sys
targets = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        out[name] = "ok: " + str(fn())[:200]
    except Exception as exc:
        out[name] = type(exc).__name__
for name, path in targets["files"].items():
    attempt(name, lambda path=path: open(path, "rb").read())
for name, path in targets["dirs"].items():
    attempt(name, lambda path=path: os.listdir(path))
def connect_unix():
    s = socket.socket(socket.AF_UNIX)
    s.connect(targets["socket"])
attempt("server socket", connect_unix)
def connect_tcp():
    s = socket.create_connection(("127.0.0.1", targets["port"]), timeout=2)
attempt("server port", connect_tcp)
attempt("shadow", lambda: open("/etc/shadow").read())
out["passwd"] = "root:" in open("/etc/passwd").read()  # what a program needs is there
open("/tmp/scratch", "w").write("a private /tmp")
def other_processes():
    mine = {"1", str(os.getpid())}
    seen = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid not in mine:
            try:
                seen.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                pass
    if any(b"secret-job" in c or b"pytest" in c for c in seen):
        return "other jobs' or the server's processes are visible"
    raise LookupError("none visible")
attempt("processes", other_processes)
out["id -u"] = subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip()
out["uid"] = os.getuid()
status = dict(ln.split(":\t", 1) for ln in open("/proc/self/status").read().splitlines())
out["caps"] = [status[k].strip() for k in ("CapPrm", "CapEff", "CapAmb", "NoNewPrivs")]
out["cwd"] = os.getcwd()
open("written-by-the-job", "w").write("fine")
print(json.dumps(out))
"""

SECRET_JOB = (
    "import time; open('secret', 'w').write('tenant two secret'); print('secret-job', flush=True);"
    " time.sleep(60)"
)


def test_a_workload_cannot_reach_the_server_or_other_tenants(server: dict[str, Path]) -> None:
    ex = LocalExecutor(server["data"] / "proofplane.db.jobs", limit_mode=RLIMIT, kill_grace_s=1)
    other = ex.submit(job([PY, "-c", SECRET_JOB], name="victim", tenant="t2"))
    deadline = time.monotonic() + 10
    while ex.logs(other) != b"secret-job\n":
        assert time.monotonic() < deadline, ex.logs(other, "stderr")
        time.sleep(0.02)
    other_dir = ex.jobs_dir / other
    assert (other_dir / "work" / "secret").read_text() == "tenant two secret"

    listener = socket.create_server(("127.0.0.1", 0))  # the API the workload must not reach
    port = listener.getsockname()[1]
    targets = {
        "files": {
            "database": str(server["db"]),
            "database wal": str(server["db"]) + "-wal",
            "signing key": str(server["key"]),
            "other job's spec": str(other_dir / "spec.json"),
            "other job's log": str(other_dir / "stdout.log"),
            "other job's file": str(other_dir / "work" / "secret"),
            "own spec": str(ex.jobs_dir / "x" / "spec.json"),
            "server's home": os.path.expanduser("~/.bashrc"),
        },
        "dirs": {
            "data dir": str(server["data"]),
            "jobs dir": str(ex.jobs_dir),
            "other job's dir": str(other_dir),
            "other job's work": str(other_dir / "work"),
        },
        "socket": str(server["sock"]),
        "port": port,
    }
    try:
        attacker = ex.submit(job([PY, "-c", ATTACK, json.dumps(targets)], name="probe"))
        change = ex.wait(attacker)
    finally:
        listener.close()
        ex.cancel(other)
    assert change.kind is ChangeKind.SUCCEEDED, (change, ex.logs(attacker, "stderr"))
    seen = json.loads(ex.logs(attacker))
    refused = {"FileNotFoundError", "PermissionError", "NotADirectoryError"}
    for name in [*targets["files"], *targets["dirs"], "server socket", "shadow"]:
        assert seen[name] in refused, (name, seen[name])
    assert seen["passwd"] is True
    assert seen["server port"] in {"ConnectionRefusedError", "OSError", "TimeoutError"}
    assert seen["processes"] == "LookupError"
    server_uid = os.geteuid()
    assert seen["id -u"] == str(seen["uid"]) and seen["uid"] not in (0, server_uid)
    assert seen["cwd"] == JOB_MOUNT
    assert seen["caps"] == ["0000000000000000"] * 3 + ["1"]  # no capabilities, no way to gain any
    work = ex.jobs_dir / attacker / "work"
    assert (work / "written-by-the-job").read_text() == "fine"  # its own directory is writable
    if server_uid == 0:  # a dedicated user that owns nothing of the server's
        assert work.stat().st_uid == seen["uid"]
    else:  # a user namespace: unprivileged inside, the server's uid (and no files) outside
        assert seen["uid"] == USERNS_UID


def test_job_directories_are_0700_whatever_the_umask(server: dict[str, Path]) -> None:
    ex = LocalExecutor(server["data"] / "proofplane.db.jobs", limit_mode=RLIMIT)
    old = os.umask(0)
    try:
        job_id = ex.submit(job([PY, "-c", "print('hi')"]))
    finally:
        os.umask(old)
    assert ex.wait(job_id).kind is ChangeKind.SUCCEEDED
    for path in (ex.jobs_dir, ex.jobs_dir / job_id, ex.jobs_dir / job_id / "work"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for log in ("stdout.log", "stderr.log"):
        assert stat.S_IMODE((ex.jobs_dir / job_id / log).stat().st_mode) == 0o600
    assert (ex.jobs_dir / job_id).stat().st_uid == os.geteuid()  # control files: the server's


def _never_ran(ex: LocalExecutor, job_id: str, marker: Path) -> str:
    change = ex.wait(job_id)
    assert change.kind is ChangeKind.FAILED, change
    assert "cannot set up the job sandbox" in change.message
    assert "the command did not run" in change.message
    assert not marker.exists() and b"RAN" not in ex.logs(job_id)
    return change.message


def test_a_sandbox_that_cannot_be_set_up_fails_the_job_and_never_runs_it(
    server: dict[str, Path],
) -> None:
    marker = server["tmp"] / "ran-unsandboxed"
    # The command would leave a file on the host and print RAN if it ever ran unsandboxed.
    command = [PY, "-c", f"open({str(marker)!r}, 'w'); print('RAN')"]
    state = server["data"] / "proofplane.db.jobs"

    missing = LocalExecutor(state, limit_mode=RLIMIT, sandbox=Sandbox(bwrap="no-such-bwrap"))
    message = _never_ran(missing, missing.submit(job(command)), marker)
    assert "'no-such-bwrap' (Debian/Ubuntu package bubblewrap) is not installed" in message
    assert "PROOFPLANE_LOCAL_SANDBOX=off" in message

    broken = server["tmp"] / "broken-bwrap"  # a launcher that fails to set the sandbox up
    broken.write_text("#!/bin/sh\necho 'bwrap: simulated mount failure' >&2\nexit 1\n")
    broken.chmod(0o755)
    ex = LocalExecutor(state, limit_mode=RLIMIT, sandbox=Sandbox(bwrap=str(broken)))
    message = _never_ran(ex, ex.submit(job(command)), marker)
    assert message.endswith(
        "cannot set up the job sandbox: bwrap: simulated mount failure; the command did not run"
    )

    silent = server["tmp"] / "silent-bwrap"  # exits 0 without running anything
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    ex = LocalExecutor(state, limit_mode=RLIMIT, sandbox=Sandbox(bwrap=str(silent)))
    _never_ran(ex, ex.submit(job(command)), marker)

    # the real bwrap, failing to mount a path that does not exist
    bad_mount = Sandbox(ro_paths=("/nonexistent-proofplane-path",))
    ex = LocalExecutor(state, limit_mode=RLIMIT, sandbox=bad_mount)
    message = _never_ran(ex, ex.submit(job(command)), marker)
    assert "bwrap: Can't find source path /nonexistent-proofplane-path" in message

    # a read-only path that would show the job the server's data directory is refused
    exposing = Sandbox(ro_paths=(str(server["tmp"]),))
    ex = LocalExecutor(state, limit_mode=RLIMIT, sandbox=exposing)
    message = _never_ran(ex, ex.submit(job(command)), marker)
    assert "holds the server's data directory" in message

    if os.geteuid() == 0:  # a "job user" that is root is no sandbox
        ex = LocalExecutor(state, limit_mode=RLIMIT, sandbox=Sandbox(user="root"))
        message = _never_ran(ex, ex.submit(job(command)), marker)
        assert "is root or the server's own user" in message


def test_the_sandbox_is_described_and_off_is_marked_insecure(
    server: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    state = server["data"] / "proofplane.db.jobs"
    assert LocalExecutor(state, limit_mode=RLIMIT).describe()["sandbox"].startswith("bubblewrap")
    with caplog.at_level(logging.WARNING, logger="proofplane.backends.local"):
        off = LocalExecutor(state, limit_mode=RLIMIT, sandbox=Sandbox(enabled=False))
    assert "sandbox is off (insecure" in caplog.text
    assert off.describe()["sandbox"].startswith("off (insecure")
    job_id = off.submit(job([PY, "-c", "import os; print(os.getuid())"]))
    assert off.wait(job_id).kind is ChangeKind.SUCCEEDED
    assert off.logs(job_id) == f"{os.geteuid()}\n".encode()  # as the server: the opt-out


def test_bwrap_arguments_list_what_a_job_sees() -> None:
    args = bwrap_args("/srv/jobs/j1/work", userns=False, ro_paths=("/opt/py",), devices=("/dev/x",))
    for ns in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent"):
        assert ns in args
    assert "--unshare-user" not in args and args[args.index("--cap-drop") + 1] == "ALL"
    pairs = {(args[i], args[i + 1], args[i + 2]) for i in range(len(args) - 2)}
    assert ("--bind", "/srv/jobs/j1/work", JOB_MOUNT) in pairs  # the only writable host path
    assert ("--ro-bind", "/opt/py", "/opt/py") in pairs and ("--dir", "/opt", "--ro-bind") in pairs
    assert ("--dev-bind", "/dev/x", "/dev/x") in pairs
    binds = [args[i + 1] for i, a in enumerate(args) if a in ("--bind", "--ro-bind")]
    assert "/etc/passwd" in binds and "/etc/shadow" not in binds and "/etc" not in binds
    assert "/" not in binds and "/home" not in binds and "/root" not in binds
    userns = bwrap_args("/w", userns=True)
    assert userns[userns.index("--uid") + 1] == str(USERNS_UID) and "--cap-add" not in userns


def test_a_python_below_tmp_is_mounted_over_the_private_tmp_not_hidden_by_it() -> None:
    # CI's checkout (and its venv) may live under /tmp: the tmpfs must come first
    args = bwrap_args("/w", userns=False, ro_paths=("/tmp/ci/.venv",))
    tmpfs = args.index("--tmpfs")
    assert args[tmpfs + 1] == "/tmp"
    venv = [i for i, a in enumerate(args) if a == "--ro-bind" and args[i + 1] == "/tmp/ci/.venv"]
    assert venv and venv[0] > tmpfs
    assert ("--dir", "/tmp") not in {(args[i], args[i + 1]) for i in range(len(args) - 1)}


def test_the_sandbox_setting() -> None:
    assert config.execution_from_env({}).local_sandbox is True
    assert config.execution_from_env({"PROOFPLANE_LOCAL_SANDBOX": "off"}).local_sandbox is False
    got = config.execution_from_env({"PROOFPLANE_LOCAL_JOB_USER": "pp-jobs"})
    assert got.local_job_user == "pp-jobs"
    with pytest.raises(ValidationFailed, match="PROOFPLANE_LOCAL_SANDBOX must be on or off"):
        config.execution_from_env({"PROOFPLANE_LOCAL_SANDBOX": "maybe"})


def test_a_server_that_is_not_root_runs_jobs_in_a_user_namespace(
    server: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a developer's ``make up`` takes: no uid switch, a user namespace instead (here
    the server only pretends not to be root: a really unprivileged server cannot be started on
    this machine, whose Python lives under /root, 0700)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ex = LocalExecutor(server["data"] / "proofplane.db.jobs", limit_mode=RLIMIT)
    assert "user namespace" in ex.describe()["sandbox"]
    script = f"import os; print(os.getuid()); open({str(server['key'])!r})"
    job_id = ex.submit(job([PY, "-c", script]))
    change = ex.wait(job_id)
    assert change.kind is ChangeKind.FAILED and change.message == "exit status 1"
    assert ex.logs(job_id) == f"{USERNS_UID}\n".encode()
    assert b"FileNotFoundError" in ex.logs(job_id, "stderr")
    assert json.loads((ex.jobs_dir / job_id / "spec.json").read_text())["sandbox"]["uid"] == -1
