"""The Slurm backend: the pure mapping, error classification, and a real Slurm 22.05.

The real cluster (slurmctld + three slurmd with fake GPU devices + munge, tests/slurm_cluster.py)
starts once for this module. Without the Slurm binaries these tests are skipped locally and
FAIL in CI (CI=true): a missing dependency never passes silently.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ci import unavailable
from proofplane.backends.base import (
    BackendUnavailable,
    Change,
    ChangeKind,
    DrainFailed,
    JobRejected,
    JobSpec,
)
from proofplane.backends.slurm import (
    SlurmBackend,
    SlurmOptions,
    changes_from_squeue,
    gres_conf_lines,
    gres_request,
    gres_slots,
    lost_nodes_from_sinfo,
    parse_gres_indices,
    sbatch_args,
    slurm_feature,
    slurm_indices,
    slurm_node_line,
)
from proofplane.model import Gpu, MigInstance, Node, PlacedDevice, Placement
from slurm_cluster import SlurmCluster, missing_binaries, remove_cluster, start_cluster

H100 = "H100-80GB"
MIG_GPU0 = (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4))
MIG_GPU1 = (MigInstance("1g.10gb", 0), MigInstance("1g.10gb", 1))
NODES = (
    Node(
        "gpu-a",
        "eu",
        "eu-1",
        certifications={"hipaa": "true", "gdpr-zone": "frankfurt"},
        labels={"pci-dss": "true"},  # self-declared: must never become a feature
        gpus=tuple(Gpu(i, f"GPU-a{i}", H100, 81920) for i in range(4)),
    ),
    Node("gpu-b", "eu", "eu-1", gpus=tuple(Gpu(i, f"GPU-b{i}", H100, 81920) for i in range(4))),
    Node(
        "gpu-c",
        "eu",
        "eu-1",
        certifications={"gdpr-zone": "frankfurt"},
        gpus=(
            Gpu(0, "GPU-c0", H100, 81920, mig_enabled=True, mig_instances=MIG_GPU0),
            Gpu(1, "GPU-c1", H100, 81920, mig_enabled=True, mig_instances=MIG_GPU1),
        ),
    ),
)
NODE = {n.name: n for n in NODES}
MODELS = {g.uuid: g.model for n in NODES for g in n.gpus}
REPORT = "echo NODE=$SLURMD_NODENAME CVD=$CUDA_VISIBLE_DEVICES GPUS=$SLURM_JOB_GPUS"


def spec(
    name: str,
    node: str,
    devices: tuple[PlacedDevice, ...],
    tags: dict[str, str] | None = None,
    command: tuple[str, ...] = ("sh", "-c", REPORT),
) -> JobSpec:
    return JobSpec(name, "t1", command, Placement(node, devices), tags=tags or {})


def gpus(node: str, *indices: int) -> tuple[PlacedDevice, ...]:
    return tuple(PlacedDevice(i, f"GPU-{node[-1]}{i}") for i in indices)


# --- pure mapping ----------------------------------------------------------------------------


def test_features_are_an_injective_encoding_of_tags() -> None:
    assert slurm_feature("hipaa", "true") == "hipaa"
    assert slurm_feature("gdpr-zone", "frankfurt") == "gdpr-zone@frankfurt"
    # Pairs that a naive "key_value" / "key-value" encoding would merge stay apart.
    pairs = [("a_b", "c"), ("a", "b_c"), ("a-b", "c"), ("a", "b-c"), ("a", "true"), ("a", "yes")]
    assert len({slurm_feature(k, v) for k, v in pairs}) == len(pairs)


def test_node_lines_and_gres_conf_come_from_the_inventory() -> None:
    assert slurm_node_line(NODE["gpu-a"], cpus=8, memory_mb=1000) == (
        "NodeName=gpu-a CPUs=8 RealMemory=1000 Features=gdpr-zone@frankfurt,hipaa Gres=gpu:h100:4"
    )
    assert "pci-dss" not in slurm_node_line(NODE["gpu-a"])
    assert slurm_node_line(NODE["gpu-c"]).endswith("Gres=gpu:1g.10gb:2,gpu:3g.40gb:2")
    assert (
        gres_conf_lines(NODE["gpu-b"])[3] == "NodeName=gpu-b Name=gpu Type=h100 File=/dev/nvidia3"
    )
    # MIG units are numbered by type first, as Slurm numbers them.
    assert gres_slots(NODE["gpu-c"]) == [
        ("1g.10gb", "GPU-c1", 0),
        ("1g.10gb", "GPU-c1", 1),
        ("3g.40gb", "GPU-c0", 0),
        ("3g.40gb", "GPU-c0", 4),
    ]
    mig = Placement("gpu-c", (PlacedDevice(0, "GPU-c0", mig_profile="3g.40gb", mig_start=4),))
    assert slurm_indices(mig, NODE["gpu-c"]) == (3,)


def test_sbatch_arguments_carry_node_gres_and_constraint() -> None:
    job = spec("train", "gpu-a", gpus("gpu-a", 1, 2), tags={"hipaa": "true", "gdpr-zone": "fra"})
    args = sbatch_args(job, output_dir="/out", models=MODELS, partition="gpu")
    assert args[:2] == ["sbatch", "--parsable"]
    assert "--nodelist=gpu-a" in args and "--nodes=1" in args
    assert "--gres=gpu:h100:2" in args
    assert "--constraint=gdpr-zone@fra&hipaa" in args
    assert "--partition=gpu" in args and "--job-name=pp.t1.train" in args
    assert args[-1].endswith("exec sh -c 'echo NODE=$SLURMD_NODENAME CVD=$CUDA_VISIBLE_DEVICES "
                              "GPUS=$SLURM_JOB_GPUS'")  # fmt: skip
    mig = (
        PlacedDevice(0, "GPU-c0", mig_profile="3g.40gb", mig_start=0),
        PlacedDevice(1, "GPU-c1", mig_profile="1g.10gb", mig_start=0),
        PlacedDevice(1, "GPU-c1", mig_profile="1g.10gb", mig_start=1),
    )
    assert gres_request(mig, MODELS) == "gpu:1g.10gb:2,gpu:3g.40gb:1"
    assert gres_request(gpus("gpu-b", 0), {}) == "gpu:1"  # model unknown: untyped
    with pytest.raises(JobRejected, match="shared-GPU"):
        gres_request((PlacedDevice(0, "GPU-b0", share_milli=500),), MODELS)
    with pytest.raises(JobRejected, match="no command"):
        sbatch_args(spec("x", "gpu-a", gpus("gpu-a", 0), command=()), output_dir="/o")


def test_squeue_and_sinfo_documents_become_changes() -> None:
    doc = {
        "jobs": [
            {"job_id": 7, "job_state": "RUNNING", "nodes": "gpu-a",
             "gres_detail": ["gpu:h100:2(IDX:0-1)"], "state_reason": "None"},
            {"job_id": 8, "job_state": "PENDING", "nodes": "", "state_reason": "ReqNodeNotAvail"},
            {"job_id": 9, "job_state": "FAILED", "nodes": "gpu-b", "exit_code": 2,
             "state_reason": "NonZeroExitCode"},
            {"job_id": 10, "job_state": ["COMPLETED"], "nodes": "gpu-b"},
            {"job_id": 11, "job_state": "CANCELLED", "nodes": "gpu-b"},
            {"job_id": 12, "job_state": "RUNNING", "nodes": "gpu-b"},
        ]
    }  # fmt: skip
    got = changes_from_squeue(doc, ["7", "8", "9", "10", "11", "99"])
    assert got["7"] == Change(ChangeKind.RUNNING, "7", message="running on gpu-a",
                              devices={"gpu-a": (0, 1)})  # fmt: skip
    assert got["8"].kind is ChangeKind.RUNNING and "ReqNodeNotAvail" in got["8"].message
    assert got["9"].kind is ChangeKind.FAILED and got["9"].exit_code == 2
    assert got["10"].kind is ChangeKind.SUCCEEDED and got["11"].kind is ChangeKind.CANCELLED
    assert "12" not in got and "99" not in got
    assert parse_gres_indices(["gpu:a:1(IDX:0,2-3)", "gpu:b:1(IDX:5)"]) == (0, 2, 3, 5)
    nodes = {
        "nodes": [
            {"name": "gpu-a", "state": "idle", "state_flags": ["DRAIN"]},
            {"name": "gpu-b", "state": "down", "state_flags": [], "reason": "Not responding"},
            {"name": "gpu-c", "state": ["IDLE", "NOT_RESPONDING"]},  # transient: not lost
            {"name": "gpu-d", "state": ["DOWN", "NOT_RESPONDING"]},
        ]
    }
    lost = lost_nodes_from_sinfo(nodes)
    assert [c.node for c in lost] == ["gpu-b", "gpu-d"]
    assert lost[0].message == "Slurm reports the node down: Not responding"


def _runner(returncode: int = 0, stdout: str = "", stderr: str = "", exc: Exception | None = None):
    calls: list[list[str]] = []

    def run(args, env, timeout):
        calls.append(list(args))
        if exc is not None:
            raise exc
        return subprocess.CompletedProcess(args, returncode, stdout, stderr)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_errors_are_classified(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    for name in ("sbatch", "scontrol", "squeue", "sinfo", "scancel"):
        (bins / name).write_text("#!/bin/sh\n")
        (bins / name).chmod(0o755)
    opts = SlurmOptions(bin_dir=str(bins))
    job = spec("w", "gpu-a", gpus("gpu-a", 0))
    down = "sbatch: error: Batch job submission failed: Unable to contact slurm controller"
    with pytest.raises(BackendUnavailable, match="Unable to contact"):
        SlurmBackend(opts, runner=_runner(1, stderr=down)).submit(job)
    timeout = subprocess.TimeoutExpired(["sbatch"], 1)
    with pytest.raises(BackendUnavailable, match="did not answer"):
        SlurmBackend(opts, runner=_runner(exc=timeout)).submit(job)
    rejected = "sbatch: error: Batch job submission failed: Invalid generic resource specification"
    with pytest.raises(JobRejected, match="Invalid generic resource"):
        SlurmBackend(opts, runner=_runner(1, stderr=rejected)).submit(job)
    with pytest.raises(DrainFailed, match="Invalid node name"):
        SlurmBackend(opts, runner=_runner(1, stderr="Invalid node name specified")).drain("x", "r")
    with pytest.raises(BackendUnavailable, match="'sbatch' not found"):
        SlurmBackend(SlurmOptions(bin_dir=str(tmp_path / "nope"))).submit(job)
    quiet = _runner(1, stderr="scancel: error: Kill job error on job id 5: Invalid job id")
    SlurmBackend(opts, runner=quiet).cancel("5")  # already gone: not an error
    assert SlurmBackend(opts, runner=_runner(1, stderr=down)).describe()["healthy"] is False


# --- a real Slurm ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        message = (
            f"Slurm is not installed (missing: {', '.join(missing)}); "
            "see scripts/debian-packages.txt"
        )
        unavailable(message)
    c = start_cluster(NODES)
    yield c
    remove_cluster(c)


@pytest.fixture(scope="module")
def slurm(cluster: SlurmCluster) -> SlurmBackend:
    options = SlurmOptions(conf=str(cluster.conf), output_dir=str(cluster.output_dir))
    return SlurmBackend(options, models=lambda _job: MODELS)


def finished(slurm: SlurmBackend, job_id: str, timeout_s: float = 20) -> Change:
    deadline = time.monotonic() + timeout_s
    while True:
        change = next(c for c in slurm.sync([job_id]) if c.job_id == job_id)
        if change.kind is not ChangeKind.RUNNING:
            return change
        assert time.monotonic() < deadline, f"job {job_id} still {change.message}"
        time.sleep(0.1)


def running(slurm: SlurmBackend, job_id: str, timeout_s: float = 20) -> Change:
    deadline = time.monotonic() + timeout_s
    while True:
        change = next(c for c in slurm.sync([job_id]) if c.job_id == job_id)
        if change.kind is ChangeKind.RUNNING and change.message.startswith("running"):
            return change
        assert change.kind is ChangeKind.RUNNING, change
        assert time.monotonic() < deadline, f"job {job_id} still {change.message}"
        time.sleep(0.1)


def output(cluster: SlurmCluster, job_id: str) -> str:
    return (cluster.output_dir / f"{job_id}.out").read_text().strip()


def test_jobs_land_on_the_node_and_gpus_proofplane_chose(
    cluster: SlurmCluster, slurm: SlurmBackend
) -> None:
    whole = spec("whole", "gpu-a", gpus("gpu-a", 0, 1), tags={"hipaa": "true"})
    mig_devices = (PlacedDevice(0, "GPU-c0", mig_profile="3g.40gb", mig_start=0),)
    mig = spec("mig", "gpu-c", mig_devices, tags={"gdpr-zone": "frankfurt"})
    jobs = {slurm.submit(whole): whole, slurm.submit(mig): mig}
    for job_id, job in jobs.items():
        done = finished(slurm, job_id)
        assert done.kind is ChangeKind.SUCCEEDED, (done, cluster.logs())
        want = slurm_indices(job.placement, NODE[job.placement.node])
        listed = ",".join(map(str, want))
        assert output(cluster, job_id) == (f"NODE={job.placement.node} CVD={listed} GPUS={listed}")
    assert want == (2,)  # the MIG 3g.40gb at slot 0: after the two 1g.10gb units


def test_slurm_itself_refuses_a_node_that_lacks_the_compliance_features(
    slurm: SlurmBackend,
) -> None:
    # proofplane would never place this; if it did, Slurm's constraint is a second wall.
    with pytest.raises(JobRejected, match="Slurm rejected t1/leak"):
        slurm.submit(spec("leak", "gpu-b", gpus("gpu-b", 0), tags={"hipaa": "true"}))


def test_a_drained_node_gets_no_new_work_and_resume_releases_it(
    cluster: SlurmCluster, slurm: SlurmBackend
) -> None:
    slurm.drain("gpu-b", "quarantined: attestation failed")
    state = slurm.node_states()["gpu-b"]
    assert "drain" in state["flags"] or state["state"].startswith("drain"), state
    assert state["reason"] == "proofplane: quarantined: attestation failed"
    try:
        job_id = slurm.submit(spec("held", "gpu-b", gpus("gpu-b", 0)))
        time.sleep(1.5)  # several scheduling passes
        held = next(c for c in slurm.sync([job_id]) if c.job_id == job_id)
        assert held.kind is ChangeKind.RUNNING and held.message.startswith("pending in Slurm")
        assert not (cluster.output_dir / f"{job_id}.out").exists()
    finally:
        slurm.resume("gpu-b")
    # Slurm starts the held job on its next scheduling pass after the resume: seconds on a
    # quiet machine, longer on a loaded CI box; a generous bound keeps the test honest there.
    assert finished(slurm, job_id, timeout_s=90).kind is ChangeKind.SUCCEEDED
    assert output(cluster, job_id).startswith("NODE=gpu-b ")
    with pytest.raises(DrainFailed, match="no-such-node"):
        slurm.drain("no-such-node", "test")


def test_cancel_reaches_slurm(cluster: SlurmCluster, slurm: SlurmBackend) -> None:
    job_id = slurm.submit(spec("long", "gpu-b", gpus("gpu-b", 0), command=("sleep", "300")))
    assert running(slurm, job_id).devices == {"gpu-b": (0,)}
    slurm.cancel(job_id)
    assert finished(slurm, job_id).kind is ChangeKind.CANCELLED
    states = cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").stdout.split()
    assert states == ["CANCELLED"]
    slurm.cancel(job_id)  # again: not an error


def test_a_device_divergence_is_visible(slurm: SlurmBackend) -> None:
    # proofplane says GPU 3 on an idle node; Slurm picks the lowest free index, 0.
    skew = spec("skew", "gpu-a", gpus("gpu-a", 3), tags={"hipaa": "true"}, command=("sleep", "30"))
    job_id = slurm.submit(skew)
    assert running(slurm, job_id).devices == {"gpu-a": (0,)}
    slurm.cancel(job_id)
    assert slurm_indices(Placement("gpu-a", gpus("gpu-a", 3)), NODE["gpu-a"]) == (3,)


def test_a_down_node_is_reported_lost(cluster: SlurmCluster, slurm: SlurmBackend) -> None:
    cluster.run("scontrol", "update", "NodeName=gpu-c", "State=DOWN", "Reason=fan failure")
    try:
        lost = [c for c in slurm.sync([]) if c.kind is ChangeKind.NODE_LOST]
        assert [(c.node, c.message) for c in lost] == [
            ("gpu-c", "Slurm reports the node down: fan failure")
        ]
    finally:
        cluster.run("scontrol", "update", "NodeName=gpu-c", "State=RESUME")
    # Right after RESUME the node is IDLE+NOT_RESPONDING until its next ping: not lost.
    assert not [c for c in slurm.sync([]) if c.kind is ChangeKind.NODE_LOST]


def test_unreachable_slurm_is_backend_unavailable(cluster: SlurmCluster, tmp_path: Path) -> None:
    # The same cluster's configuration, pointing at a controller port where nobody listens.
    conf = tmp_path / "slurm.conf"
    text = cluster.conf.read_text()
    port = next(ln for ln in text.splitlines() if ln.startswith("SlurmctldPort="))
    conf.write_text(
        text.replace(port, "SlurmctldPort=1").replace("MessageTimeout=5", "MessageTimeout=1")
    )
    (tmp_path / "gres.conf").write_text((cluster.conf.parent / "gres.conf").read_text())
    away = SlurmBackend(SlurmOptions(conf=str(conf), timeout_s=10))
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        away.submit(spec("w", "gpu-a", gpus("gpu-a", 0)))
    with pytest.raises(BackendUnavailable):
        away.sync(["1"])
    assert time.monotonic() - started < 25
    assert away.describe()["healthy"] is False
