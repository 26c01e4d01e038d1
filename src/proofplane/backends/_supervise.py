"""The local executor's per-job supervisor: ``python -I _supervise.py JOB_DIR``.

Runs as the leader of its own session and process group (the executor starts it with
``start_new_session``), applies the job's resource limits to itself so the command inherits
them, runs the command with its output in files, and writes the exit status to ``exit.json``
atomically. The exit file is what lets a restarted control plane learn how a job ended even
though the job is no longer its child.

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
        open(job_dir / "stdout.log", "ab") as out,
        open(job_dir / "stderr.log", "ab") as err,
    ):
        try:
            proc = subprocess.Popen(
                spec["command"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=spec.get("cwd") or str(job_dir),
            )
        except OSError as exc:  # not found, not executable
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            result = {"returncode": code, "error": f"cannot start {spec['command'][0]!r}: {exc}"}
        else:
            while True:
                try:
                    rc = proc.wait()
                    break
                except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                    continue
            result = {"returncode": rc}
            if rc < 0:
                result["signal"] = -rc
    _write_json(job_dir / "exit.json", {**result, "finished_at": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
