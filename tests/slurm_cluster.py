"""A real Slurm (slurmctld + one slurmd per fake GPU node + munge) under one temporary directory.

Everything lives under the directory: config, state, logs, munge key and socket, the fake GPU
character devices. Ports are picked free at start, so nothing touches /etc/slurm, /run/munge
or a Slurm the host may run. The node lines and gres.conf come from proofplane's own
generators (``backends.slurm``), so the test cluster is what proofplane would configure.
See ../shared/notes/slurm.md for the recipe.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proofplane.backends.slurm import gres_conf_lines, slurm_node_line
from proofplane.model import Node

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "munged")


def missing_binaries() -> list[str]:
    extra = ("/usr/sbin", "/sbin")
    path = os.pathsep.join([os.environ.get("PATH", ""), *extra])
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _which(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ["PATH"], "/usr/sbin", "/sbin"]))
    assert found, name
    return found


@dataclass
class SlurmCluster:
    root: Path
    nodes: Sequence[Node]
    conf: Path = field(init=False)
    pids: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.conf = self.root / "etc" / "slurm.conf"

    @property
    def output_dir(self) -> Path:
        return self.root / "out"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, check=check, timeout=30
        )

    # --- bring-up ---------------------------------------------------------------------------

    def _device(self, node: Node, k: int) -> str:
        return str(self.root / "dev" / node.name / f"nvidia{k}")

    def write_config(self, ctld_port: int, node_ports: dict[str, int]) -> None:
        r = self.root
        for d in ("etc", "state", "log", "spool", "out", "munge", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        lines = [
            "ClusterName=proofplane-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "DefMemPerCPU=1000",
            "GresTypes=gpu",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "MinJobAge=600",
            "MessageTimeout=5",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=2",
        ]
        for node in self.nodes:
            lines.append(
                f"{slurm_node_line(node, cpus=8, memory_mb=64000)} "
                f"NodeAddr=127.0.0.1 NodeHostname={host} Port={node_ports[node.name]}"
            )
        lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        gres = ["AutoDetect=off"]
        for node in self.nodes:
            (r / "dev" / node.name).mkdir(parents=True, exist_ok=True)
            node_lines = gres_conf_lines(node, self._device)
            for k in range(len(node_lines)):
                dev = Path(self._device(node, k))
                if not dev.exists():
                    os.mknod(dev, 0o600 | 0o020000, os.makedev(195, k))  # like /dev/nvidia<k>
            gres.extend(node_lines)
        (r / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")

    def start_munge(self) -> None:
        m = self.root / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        shutil.chown(m, "munge", "munge")
        m.chmod(0o711)
        subprocess.run(
            [
                "runuser", "-u", "munge", "--", _which("munged"),
                f"--socket={m / 'munge.socket'}", f"--key-file={key}",
                f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
            check=True,
            timeout=30,
        )  # fmt: skip
        self.pids.append(m / "munged.pid")

    def start(self) -> None:
        ports = _free_ports(len(self.nodes) + 1)
        self.write_config(ports[0], {n.name: p for n, p in zip(self.nodes, ports[1:], strict=True)})
        self.start_munge()
        run = self.root / "run"
        subprocess.run([_which("slurmctld"), "-c", "-f", str(self.conf)], check=True,
                       env=self.env(), timeout=30)  # fmt: skip
        self.pids.append(run / "slurmctld.pid")
        for node in self.nodes:
            subprocess.run([_which("slurmd"), "-f", str(self.conf), "-N", node.name],
                           check=True, env=self.env(), timeout=30)  # fmt: skip
            self.pids.append(run / f"slurmd-{node.name}.pid")
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            res = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = res.stdout
            lines = [ln.split() for ln in res.stdout.splitlines() if ln.strip()]
            if (
                res.returncode == 0
                and len(lines) == len(self.nodes)
                and all(s[1] in ("idle", "mix", "alloc") for s in lines)
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Slurm did not come up: {states!r}\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text()[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """TERM every daemon at once (slurmctld takes ~2 s), then KILL what is left."""
        pids = []
        for pid_file in self.pids:
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                continue
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def start_cluster(nodes: Sequence[Node]) -> SlurmCluster:
    root = Path(tempfile.mkdtemp(prefix="pp-slurm-"))
    root.chmod(0o755)  # munged runs as the munge user and must reach its directory
    cluster = SlurmCluster(root, nodes)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def remove_cluster(cluster: SlurmCluster) -> None:
    cluster.stop()
    shutil.rmtree(cluster.root, ignore_errors=True)
