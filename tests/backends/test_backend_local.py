"""The local executor against real processes: environment, output, limits, cancel, restart."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from proofplane.backends.base import ChangeKind, JobRejected, JobSpec
from proofplane.backends.local import (
    LimitMode,
    Limits,
    LocalExecutor,
    cgroup_settings,
    cuda_visible_devices,
    detect_limit_mode,
    rlimits_for,
)
from proofplane.model import PlacedDevice, Placement

PY = sys.executable
RLIMIT = LimitMode("rlimit", "forced by the test")


def job(command: list[str], devices: tuple[PlacedDevice, ...] | None = None, name: str = "w1"):
    devices = devices or (PlacedDevice(2, "GPU-aaaa"), PlacedDevice(5, "GPU-bbbb"))
    return JobSpec(
        workload=name, tenant="t1", command=tuple(command), placement=Placement("n1", devices)
    )


@pytest.fixture
def executor(tmp_path: Path) -> LocalExecutor:
    return LocalExecutor(tmp_path / "state", limit_mode=RLIMIT, kill_grace_s=1.0)


def test_cuda_visible_devices_uses_uuids_and_mig_device_ids() -> None:
    devices = (
        PlacedDevice(0, "GPU-aaaa", mig_profile="3g.40gb", mig_start=4),
        PlacedDevice(1, "GPU-bbbb"),
    )
    seen = []

    def resolver(gpu: str, profile: str, start: int) -> str:
        seen.append((gpu, profile, start))
        return "MIG-1234"

    assert cuda_visible_devices(devices, resolver) == "MIG-1234,GPU-bbbb"
    assert seen == [("GPU-aaaa", "3g.40gb", 4)]
    with pytest.raises(JobRejected, match="no MIG device 3g.40gb at slot 4"):
        cuda_visible_devices(devices, lambda *_: None)


def test_job_runs_with_its_devices_and_output_is_captured(executor: LocalExecutor) -> None:
    script = (
        "import os,sys; print(os.environ['CUDA_VISIBLE_DEVICES']);"
        "print(os.environ['PROOFPLANE_WORKLOAD'], os.environ['PROOFPLANE_GPU_INDICES']);"
        "print('oops', file=sys.stderr)"
    )
    job_id = executor.submit(job([PY, "-c", script]))
    change = executor.wait(job_id)
    assert change.kind is ChangeKind.SUCCEEDED, change
    assert executor.logs(job_id).decode().splitlines() == ["GPU-aaaa,GPU-bbbb", "w1 2,5"]
    assert executor.logs(job_id, "stderr") == b"oops\n"
    assert executor.logs(job_id, tail_bytes=4) == b"2,5\n"


def test_failures_carry_the_reason(executor: LocalExecutor) -> None:
    failing = executor.submit(job([PY, "-c", "raise SystemExit(3)"]))
    missing = executor.submit(job(["/nonexistent/binary"], name="w2"))
    assert executor.wait(failing).kind is ChangeKind.FAILED
    assert executor.wait(failing).message == "exit status 3"
    assert executor.wait(failing).exit_code == 3
    lost = executor.wait(missing)
    assert lost.kind is ChangeKind.FAILED and lost.exit_code == 127
    assert "cannot start '/nonexistent/binary'" in lost.message
    with pytest.raises(JobRejected, match="no command"):
        executor.submit(job([]))


def test_memory_limit_is_enforced_with_rlimits(tmp_path: Path) -> None:
    ex = LocalExecutor(tmp_path / "s", limits=Limits(memory_mb=256), limit_mode=RLIMIT)
    grab = "b = bytearray(600 * 2**20); print('allocated')"
    small = "b = bytearray(20 * 2**20); print('allocated')"
    over, under = ex.submit(job([PY, "-c", grab])), ex.submit(job([PY, "-c", small], name="w2"))
    assert ex.wait(over).kind is ChangeKind.FAILED
    assert b"MemoryError" in ex.logs(over, "stderr")
    assert ex.wait(under).kind is ChangeKind.SUCCEEDED
    assert ex.describe()["limit_mode"] == "rlimit"


def test_limit_translation_is_pure() -> None:
    limits = Limits(memory_mb=512, cpus=1.5, pids=64, cpu_seconds=60, nofile=128)
    assert rlimits_for(limits) == {"core": 0, "as": 512 * 2**20, "cpu": 60, "nofile": 128}
    assert cgroup_settings(limits) == {
        "memory.max": str(512 * 2**20),
        "memory.swap.max": "0",
        "pids.max": "64",
        "cpu.max": "150000 100000",
    }


def test_limit_mode_detection(tmp_path: Path) -> None:
    assert detect_limit_mode(tmp_path).mode == "rlimit"  # no cgroup.controllers: v1 or none
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    mode = detect_limit_mode(tmp_path)
    assert mode.mode == "rlimit" and "memory, pids" in mode.reason
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    mode = detect_limit_mode(tmp_path)  # a plain directory stands in for a writable cgroup2
    assert mode.mode == "cgroup2" and mode.parent == str(tmp_path / "proofplane")
    assert (tmp_path / "proofplane" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"


def _pids_in_group(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_text()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def test_cancel_kills_the_whole_process_group(executor: LocalExecutor) -> None:
    # The command starts a grandchild that ignores SIGTERM: only a group kill reaches it.
    script = (
        "import subprocess,sys,time;"
        "subprocess.Popen([sys.executable,'-c',"
        "'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']);"
        "print('started', flush=True); time.sleep(60)"
    )
    job_id = executor.submit(job([PY, "-c", script]))
    state = json.loads((executor.jobs_dir / job_id / "state.json").read_text())
    deadline = time.monotonic() + 10
    while executor.logs(job_id) != b"started\n" or len(_pids_in_group(state["pgid"])) < 3:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.02)
    assert executor.sync([job_id])[0].kind is ChangeKind.RUNNING
    executor.cancel(job_id)
    assert _pids_in_group(state["pgid"]) == []
    assert executor.sync([job_id])[0].kind is ChangeKind.CANCELLED
    executor.cancel(job_id)  # idempotent
    executor.cancel("no-such-job")  # unknown: nothing to do


def test_a_restarted_executor_readopts_running_work_and_reports_lost_work(tmp_path: Path) -> None:
    first = LocalExecutor(tmp_path / "state", limit_mode=RLIMIT)
    # the job sees only its own work directory (its cwd): the marker is put there
    wait_for_marker = "import os,time\nwhile not os.path.exists('go'): time.sleep(0.02)"
    keeps = first.submit(job([PY, "-c", wait_for_marker], name="keeps"))
    dies = first.submit(job([PY, "-c", "import time; time.sleep(60)"], name="dies"))
    del first  # the server goes away; its jobs do not

    second = LocalExecutor(tmp_path / "state", limit_mode=RLIMIT)
    assert sorted(second.adopt()) == sorted([keeps, dies])
    assert {c.kind for c in second.sync([keeps, dies])} == {ChangeKind.RUNNING}
    # While "nobody watched", the supervisor of one job is killed outright (OOM killer, kill -9).
    pid = json.loads((second.jobs_dir / dies / "state.json").read_text())["pid"]
    os.killpg(pid, signal.SIGKILL)
    (second.jobs_dir / keeps / "work" / "go").touch()

    third = LocalExecutor(tmp_path / "state", limit_mode=RLIMIT)
    assert third.wait(keeps).kind is ChangeKind.SUCCEEDED
    lost = third.wait(dies)
    assert lost.kind is ChangeKind.FAILED
    assert lost.message.startswith("job lost: process") and "without an exit status" in lost.message
    unknown = third.sync(["t1.gone.0000"])[0]
    assert unknown.kind is ChangeKind.FAILED and "no record" in unknown.message


def test_a_reused_pid_is_not_mistaken_for_the_job(executor: LocalExecutor) -> None:
    job_id = executor.submit(job([PY, "-c", "import time; time.sleep(60)"]))
    state_file = executor.jobs_dir / job_id / "state.json"
    state = json.loads(state_file.read_text())
    try:
        forged = {**state, "starttime": state["starttime"] - 1}  # same pid, other process
        state_file.write_text(json.dumps(forged))
        change = executor.sync([job_id])[0]
        assert change.kind is ChangeKind.FAILED and "job lost" in change.message
    finally:
        os.killpg(state["pgid"], signal.SIGKILL)


def test_job_ids_cannot_escape_the_state_directory(executor: LocalExecutor) -> None:
    for bad in ("../x", "/etc", "", ".."):
        assert executor.sync([bad])[0].kind is ChangeKind.FAILED
        executor.cancel(bad)


def test_a_job_user_setting_that_is_no_user_name_is_refused() -> None:
    from proofplane.config import execution_from_env
    from proofplane.errors import ValidationFailed

    assert execution_from_env({}).local_job_user == "proofplane-job"
    assert execution_from_env({"PROOFPLANE_LOCAL_JOB_USER": "pp_jobs"}).local_job_user == "pp_jobs"
    for bad in ("-ou0", "--help", "a b", "Root!", "x" * 40):
        with pytest.raises(ValidationFailed) as raised:
            execution_from_env({"PROOFPLANE_LOCAL_JOB_USER": bad})
        assert raised.value.code == "invalid_setting"


def test_the_ready_handshake_is_split_however_the_pipe_delivers_it() -> None:
    """'ready' and the exec failure written right after it can arrive in one read (seen in a
    loaded CI run: a missing binary read as a sandbox failure, exit 126 for 127)."""
    from proofplane.backends._supervise import split_handshake

    failed = b"exec-failed 127 [Errno 2] No such file"
    assert split_handshake(b"ready\n" + failed) == (True, failed)
    assert split_handshake(b"ready\n") == (True, b"")
    assert split_handshake(b"ready") == (False, b"")  # cut short: no newline
    assert split_handshake(b"error cannot drop to the job user") == (False, b"")
    assert split_handshake(b"") == (False, b"")
