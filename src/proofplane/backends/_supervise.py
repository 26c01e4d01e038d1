"""The local executor's per-job supervisor: ``python -I _supervise.py JOB_DIR``.

Runs as the leader of its own session and process group (the executor starts it with
``start_new_session``), applies the job's resource limits to itself so the command inherits
them, runs the command with its output in files, and writes the exit status to ``exit.json``
atomically. The exit file is what lets a restarted control plane learn how a job ended even
though the job is no longer its child.

With a sandbox in the spec (the default), the command is started as
``bwrap <namespaces and mounts> -- python -I -c <exec stub> FD UID GID COMMAND...``: inside the
sandbox the stub drops to the job's uid, reports ``ready`` on the pipe FD, and execs the
command. No ``ready`` means the sandbox was not set up: the job fails with bwrap's (or the
stub's) reason and the command never ran. A command that cannot be started is reported through
the same pipe.

Stand-alone on purpose (``-I``: no site packages, no proofplane import): it must start fast and
must not depend on the server's environment.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_RLIMITS = {
    "as": resource.RLIMIT_AS,
    "cpu": resource.RLIMIT_CPU,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "core": resource.RLIMIT_CORE,
}


# Runs inside the sandbox, before the command: argv = FD UID GID CWD COMMAND... (UID -1: no
# switch, the user namespace already made the job unprivileged). The working directory is
# entered after the switch: it belongs to the job user, and root here has no CAP_DAC_OVERRIDE.
EXEC_STUB = """
import os, sys
fd, uid, gid, cwd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    if uid >= 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if 0 in os.getresuid() or 0 in os.getresgid() or (uid >= 0 and os.getgroups()):
        raise PermissionError('still root after the uid switch')
except OSError as exc:
    os.write(fd, ('error cannot drop to the job user: %s' % exc).encode())
    os._exit(126)
try:
    os.chdir(cwd)
except OSError as exc:
    os.write(fd, ('error cannot enter the job directory: %s' % exc).encode())
    os._exit(126)
os.write(fd, b'ready\\n')
os.set_inheritable(fd, False)
try:
    os.execvp(sys.argv[5], sys.argv[5:])
except OSError as exc:
    code = 127 if isinstance(exc, FileNotFoundError) else 126
    os.write(fd, ('exec-failed %d %s' % (code, exc)).encode())
    os._exit(code)
"""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _apply_limits(spec: dict[str, Any]) -> None:
    cgroup = spec.get("cgroup")
    if cgroup:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    for name, value in (spec.get("rlimits") or {}).items():
        resource.setrlimit(_RLIMITS[name], (value, value))


def main(job_dir: Path) -> int:
    spec = json.loads((job_dir / "spec.json").read_text())
    # A cancel signals the whole group: the command stops, this process stays to record how.
    # A handler (not SIG_IGN) so that the command, after exec, gets default dispositions.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    result: dict[str, Any]
    try:
        _apply_limits(spec)
    except OSError as exc:
        result = {"returncode": 126, "error": f"cannot apply resource limits: {exc}"}
        _write_json(job_dir / "exit.json", {**result, "finished_at": time.time()})
        return 0
    env = {**spec["env"]}
    with (
        _log(job_dir / "stdout.log") as out,
        _log(job_dir / "stderr.log") as err,
    ):
        if spec.get("sandbox"):
            result = _run_sandboxed(spec, env, out, err, job_dir / "stderr.log")
        else:
            result = _run(spec, env, out, err, cwd=spec.get("cwd") or str(job_dir))
    _write_json(job_dir / "exit.json", {**result, "finished_at": time.time()})
    return 0


def _log(path: Path) -> Any:
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def _wait(proc: subprocess.Popen[bytes]) -> int:
    while True:
        try:
            return proc.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue


def _exit_result(rc: int) -> dict[str, Any]:
    result: dict[str, Any] = {"returncode": rc}
    if rc < 0:
        result["signal"] = -rc
    return result


def _run(spec: dict[str, Any], env: dict[str, str], out: Any, err: Any, cwd: str) -> dict[str, Any]:
    """The command as this process's child, unconfined (the sandbox is off)."""
    try:
        proc = subprocess.Popen(
            spec["command"], stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd
        )
    except OSError as exc:  # not found, not executable
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        return {"returncode": code, "error": f"cannot start {spec['command'][0]!r}: {exc}"}
    return _exit_result(_wait(proc))


def split_handshake(received: bytes) -> tuple[bool, bytes]:
    """Whether the stub said ``ready``, and what it wrote after it (an exec failure).
    ``ready\n`` and an exec failure written right after it may arrive in one read."""
    first, newline, rest = received.partition(b"\n")
    if first == b"ready" and newline:
        return True, rest
    return False, b""


def _read_message(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            break
    return b"".join(chunks)


def _run_sandboxed(
    spec: dict[str, Any], env: dict[str, str], out: Any, err: Any, err_path: Path
) -> dict[str, Any]:
    """The command inside its sandbox (bwrap, then the exec stub); never without it."""
    sandbox = spec["sandbox"]
    command = spec["command"]
    err_start = os.fstat(err.fileno()).st_size
    ready_r, ready_w = os.pipe()
    argv = [sandbox["bwrap"], *sandbox["args"], "--", sys.executable, "-I", "-c", EXEC_STUB]
    argv += [str(ready_w), str(sandbox["uid"]), str(sandbox["gid"]), sandbox["cwd"], *command]
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, pass_fds=(ready_w,)
        )
    except OSError as exc:
        os.close(ready_r)
        return _sandbox_failed(f"cannot start {sandbox['bwrap']!r}: {exc}")
    finally:
        os.close(ready_w)  # only the sandbox holds the write end now: EOF when it is gone
    with os.fdopen(ready_r, "rb", buffering=0) as ready:
        received = _read_message(ready.fileno())
        rc = _wait(proc)
        received += ready.read() or b""
    ready_seen, rest = split_handshake(received)
    if not ready_seen:
        if received.startswith(b"error "):
            return _sandbox_failed(received[6:].decode(errors="replace"))
        with open(err_path, "rb") as f:  # what bwrap said
            f.seek(err_start)
            said = f.read(4096).decode(errors="replace").strip()
        why = said.splitlines()[-1] if said else f"{sandbox['bwrap']} exit status {rc}"
        return _sandbox_failed(why)
    if rest.startswith(b"exec-failed "):
        code, _, message = rest[12:].decode(errors="replace").partition(" ")
        return {"returncode": int(code), "error": f"cannot start {command[0]!r}: {message}"}
    if 128 < rc < 128 + 65:  # bwrap reports a command killed by signal N as 128 + N
        rc = 128 - rc
    return _exit_result(rc)


def _sandbox_failed(why: str) -> dict[str, Any]:
    return {
        "returncode": 126,
        "error": f"cannot set up the job sandbox: {why}; the command did not run",
        "sandbox_failed": True,
    }


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
