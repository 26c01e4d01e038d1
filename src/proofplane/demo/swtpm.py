"""`proofplane up`'s real attesters (issue 5): when swtpm and tpm2-tools are installed, a few
demo nodes (``SWTPM_NODES``) are attested by the node agent's own round
(:func:`proofplane.cli.agent.attest_once`: enrollment with EK and AK, MakeCredential answered by
``tpm2_activatecredential``, nonce, ``tpm2_quote``, event log, inventory) against their own
swtpm process, not by the simulated attester. This module launches and stops those swtpm
processes and derives their policy; the agents that speak to the API with them are the edge's
(:mod:`proofplane.cli.demo_agents`).

Each swtpm is manufactured in a temporary directory (its own EK, EK certificate and ECC AK) and
"boots" by extending its PCRs with the events of a real Secure-Boot-enabled firmware log
(``PROOFPLANE_DEMO_EVENTLOG``, else ``intel_svr.bin`` of the shared TCG log collection when it is
there, else a synthetic shim + grub log). The nodes carry ``node-class: demo-swtpm``, whose
enforcing policy is derived from that log (Secure Boot, its boot applications and kernel, golden
PCRs 0-9 from its replay) and from their GPUs (VBIOS allow-list, minimum driver).

The agents speak HTTP to the API, in process (the app on the same store, through an ASGI
transport): the demo admits them while it loads, before the server listens. Their evidence is
real TPM evidence and is not marked simulated; their GPU inventory is the cluster file's (the
demo has no GPUs), sent as NVML would.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proofplane.agent.tpm import swtpm
from proofplane.attest.policy import parse_version
from proofplane.demo.attester import DRIFT_NODE, inventory
from proofplane.hardware.cluster_file import ClusterSpec
from proofplane.model import Node, NodeState

#: the demo nodes attested by swtpm (us-east nodes without certifications: no placement
#: depends on them being simulated)
SWTPM_NODES = ("use-h100-04", "use-a100-01")
NODE_CLASS = "demo-swtpm"
EVENTLOG_ENV = "PROOFPLANE_DEMO_EVENTLOG"
REAL_LOG = "intel_svr.bin"  # an Intel server's firmware log: Secure Boot on, shim, grub, Debian
SHARED_LOGS = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "tcg-eventlogs"


def missing_tools() -> list[str]:
    """What swtpm nodes need and this machine lacks (empty: ``up`` runs them)."""
    return swtpm.missing_tools(swtpm.AGENT_TOOLS)


def pick_nodes(spec: ClusterSpec, count: int = 2, drift_node: str | None = DRIFT_NODE) -> list[str]:
    """The nodes to attest with swtpm: ``SWTPM_NODES`` where the cluster has them, else the
    first nodes the file admits (never the drifting one)."""
    admitted = [
        ns.node.name
        for ns in spec.nodes
        if ns.state is not NodeState.REGISTERED and ns.node.name != drift_node
    ]
    chosen = [n for n in SWTPM_NODES if n in admitted]
    chosen += [n for n in admitted if n not in chosen][: count - len(chosen)]
    return chosen[:count]


def demo_eventlog() -> tuple[str, bytes]:
    """(where it came from, the binary log) the swtpm nodes boot."""
    named = os.environ.get(EVENTLOG_ENV)
    if named:
        return named, Path(named).read_bytes()
    shared = SHARED_LOGS / REAL_LOG
    if shared.is_file():
        return str(shared), shared.read_bytes()
    return "synthetic shim + grub log", swtpm.boot_log()


@dataclass
class SwtpmAgent:
    """What one swtpm node's agent attests with: its TPM, its boot log and its inventory."""

    name: str
    tpm: swtpm.SwtpmNode
    eventlog: bytes
    inventory: dict[str, Any]


class SwtpmFleet:
    """The demo's swtpm nodes: their TPM processes (in a temporary directory) and agents."""

    node_class = NODE_CLASS

    def __init__(self, workdir: Path, log_source: str, log: bytes) -> None:
        self.workdir = workdir
        self.log_source = log_source
        self.log = log
        self.agents: list[SwtpmAgent] = []

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.agents)

    @classmethod
    def start(cls, nodes: list[Node]) -> SwtpmFleet:
        """Manufacture a TPM per node (its own EK: the server refuses a cloned one), start it
        and measure the demo's boot log into it. Stops what it started if one fails."""
        source, log = demo_eventlog()
        fleet = cls(Path(tempfile.mkdtemp(prefix="proofplane-demo-swtpm-")), source, log)

        def one(node: Node) -> SwtpmAgent:
            template = swtpm.manufacture(fleet.workdir / f"{node.name}-template", aks=("ecc",))
            tpm = swtpm.SwtpmNode.start(template, fleet.workdir / node.name)
            agent = SwtpmAgent(node.name, tpm, log, inventory(node, source="cluster-file"))
            fleet.agents.append(agent)
            swtpm.measure(tpm, log)
            return agent

        try:
            with ThreadPoolExecutor(2) as pool:
                started = list(pool.map(one, nodes))
            fleet.agents = started  # in the nodes' order
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def policy(self, nodes: list[Node]) -> dict[str, Any]:
        """The demo-swtpm class's policy: what the log proves, and the nodes' GPU firmware."""
        gpus = [g for n in nodes for g in n.gpus]
        drivers = [g.driver_version for g in gpus if g.driver_version]
        doc = swtpm.measured_boot_policy(self.log, NODE_CLASS, policy_id="demo-swtpm-boot")
        doc.update(
            require_inventory=True,
            allowed_vbios=sorted({g.vbios_version for g in gpus if g.vbios_version}),
            min_driver=min(drivers, key=parse_version) if drivers else None,
        )
        return doc

    def stop(self) -> None:
        """Stop every swtpm and remove their state."""
        for a in self.agents:
            a.tpm.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def running(self) -> list[str]:
        """The nodes whose swtpm process is running."""
        return [a.name for a in self.agents if a.tpm.running]
