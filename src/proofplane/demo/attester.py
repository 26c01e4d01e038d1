"""The demo cluster attests too (issue 5): `proofplane up` loads its nodes as registered and a
simulated attester per node (``proofplane.attest.simulate.SimulatedAttester``: software EK and
AK, a synthetic measured-boot log) enrolls, activates and attests through the real service
path, so every demo node is admitted by a passing verdict, not by the loader.

The simulated attester is accepted only because ``up`` runs the server in demo mode
(``PROOFPLANE_DEMO_ATTESTER=simulated``); its identities, evidence records, events and state
reasons say ``simulated``. One node (``DRIFT_NODE``) boots another kernel from its second round
on, so the demo shows a quarantine that moves work to compliant nodes.

A few nodes may instead be attested by real agents (``RealAgents``: ``up`` passes its swtpm
nodes, each a node agent against its own software TPM): they carry the ``node-class`` label of
their own enforcing policy, are not marked simulated, and re-attest with the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from proofplane.access import SYSTEM, Actor
from proofplane.attest.simulate import SimulatedAttester, boot_app_digest, demo_boot_log
from proofplane.hardware.cluster_file import ClusterSpec, NodeSpec
from proofplane.model import Node, NodeState
from proofplane.service import attestation as svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.nodes import grant_certification, set_node_state
from proofplane.service.workloads import WorkloadSpec, submit_workloads
from proofplane.workers.base import Worker

log = logging.getLogger(__name__)

DRIFT_NODE = "par-a100-01"  # boots an unapproved kernel from its second round on
DEMO_INTERVAL_S = 60.0  # how often the demo's nodes re-attest while the server runs
GOOD_KERNEL = b"vmlinuz-6.8.0-proofplane-demo (signed)"
DRIFTED_KERNEL = b"vmlinuz-6.8.0-proofplane-demo-debug (unsigned rebuild)"
BOOTLOADERS = (b"shimx64.efi 15.8", b"grubx64.efi 2.12")

DEMO_POLICY: dict[str, Any] = {
    "id": "demo-measured-boot",
    "node_class": "default",
    "require_eventlog": True,
    "require_secure_boot": True,
    "allowed_boot_apps": [boot_app_digest(b).hex() for b in BOOTLOADERS],
    "allowed_kernels": [hashlib.sha256(GOOD_KERNEL).hexdigest()],
    "require_inventory": False,
}


def inventory(node: Node, source: str = "simulated") -> dict[str, Any]:
    """The node's GPUs in the NVML-shaped form an agent sends (from the cluster file)."""
    return {
        "source": source,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "model": g.model,
                "memory_mb": g.memory_mb,
                "vbios_version": g.vbios_version,
                "driver_version": g.driver_version,
                "mig_enabled": g.mig_enabled,
            }
            for g in node.gpus
        ],
    }


@dataclasses.dataclass
class DemoNode:
    name: str
    attester: SimulatedAttester
    inventory: Mapping[str, Any]
    drifts: bool = False
    rounds: int = 0


class RealAgent(Protocol):
    """One demo node attested by a real node agent (not simulated)."""

    name: str

    def round(self) -> svc.AttestOutcome:
        """One attestation round of the agent (enrolling first when its AK is not bound)."""
        ...


class RealAgents(Protocol):
    """Demo nodes attested by real agents: their node class, the enforcing policy of that
    class, and the agents, which run only once the nodes are registered (``connect``)."""

    @property
    def node_class(self) -> str:
        """The ``node-class`` label the nodes get."""
        ...

    @property
    def nodes(self) -> tuple[str, ...]:
        """The names of the nodes these agents attest."""
        ...

    def policy(self, nodes: list[Node]) -> dict[str, Any]:
        """The policy (JSON form) of ``node_class`` that these nodes' evidence satisfies."""
        ...

    def connect(self, store: Store) -> list[RealAgent]:
        """The nodes' agents, speaking to the server on ``store``."""
        ...

    def stop(self) -> None:
        """Stop the agents and what they run on (their TPMs)."""
        ...


class DemoAttester(Worker):
    """The simulated agents of the demo's nodes, run in-process against the service layer,
    and the real agents of the few nodes that have one (``agents``; ``real`` owns them).
    Once started, every node re-attests every ``interval_s`` (one node's failed round is
    logged and stops no other node's)."""

    def __init__(
        self,
        store: Store,
        nodes: list[DemoNode],
        agents: list[RealAgent] | None = None,
        real: RealAgents | None = None,
    ) -> None:
        super().__init__("demo-attester", DEMO_INTERVAL_S)
        self.store = store
        self.nodes = nodes
        self.agents = agents or []
        self.real = real

    def enroll_all(self) -> None:
        """Enroll and activate every node (MakeCredential answered by the software EK)."""
        for n in self.nodes:
            actor = Actor(f"node:{n.name}")
            a = n.attester
            challenge = svc.enroll(
                self.store, actor, n.name, a.ek_public, a.ak_public,
                simulated=True, allow_simulated=True,
            )  # fmt: skip
            svc.activate(self.store, actor, n.name, a.activate(challenge.credential))

    def round(self, n: DemoNode) -> svc.AttestOutcome:
        """One attestation round; the drifting node reboots into another kernel on round 2."""
        n.rounds += 1
        if n.rounds == 1 or (n.drifts and n.rounds == 2):
            kernel = DRIFTED_KERNEL if n.drifts and n.rounds >= 2 else GOOD_KERNEL
            n.attester.boot(demo_boot_log(kernel, bootloaders=BOOTLOADERS))
        actor = Actor(f"node:{n.name}")
        issued = svc.issue_nonce(self.store, actor, n.name)
        ev = n.attester.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank, n.inventory)
        return svc.submit_evidence(
            self.store, actor, n.name, issued.nonce, ev, allow_simulated=True
        )

    def round_all(self) -> list[svc.AttestOutcome]:
        return [self.round(n) for n in self.nodes] + [a.round() for a in self.agents]

    def run_once(self) -> None:
        """One round of every node, each on its own (the background loop's pass)."""
        for n in self.nodes:
            try:
                self.round(n)
            except Exception:  # one node's failure must not stop the others' rounds
                log.exception("simulated attestation round of %s failed", n.name)
        for a in self.agents:
            try:
                a.round()
            except Exception:
                log.exception("attestation round of %s's agent failed", a.name)

    def start(self, interval_s: float = DEMO_INTERVAL_S) -> None:
        """Re-attest every ``interval_s`` seconds on a daemon thread."""
        self.interval_s = interval_s
        super().start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop re-attesting; then the real agents and their TPMs stop."""
        try:
            super().stop(timeout_s)
        finally:
            if self.real is not None:
                self.real.stop()


def load_attested_demo(
    store: Store,
    spec: ClusterSpec,
    *,
    drift_node: str | None = DRIFT_NODE,
    real: RealAgents | None = None,
) -> tuple[dict[str, int], DemoAttester]:
    """Load ``spec`` so that its nodes are admitted by attestation: nodes register, the demo
    policy is set (enforcing), each node enrolls and passes a first round, then the file's
    certifications and cordons are applied and its workloads submitted; a second round
    follows, in which ``drift_node`` fails and is quarantined (its work moves). ``real``'s
    nodes get its node class (label ``node-class``) and policy and attest through their real
    agents; the others through simulated attesters. The returned attester keeps re-attesting
    while it runs (``start``/``stop``; ``stop`` also stops ``real``)."""
    real_names = set(real.nodes) if real is not None else set()

    def labelled(node: Node) -> Node:
        if real is None or node.name not in real_names:
            return node
        return dataclasses.replace(
            node, labels={**node.labels, svc.NODE_CLASS_LABEL: real.node_class}
        )

    registered = dataclasses.replace(
        spec,
        nodes=tuple(
            NodeSpec(labelled(ns.node), NodeState.REGISTERED, {}, ns.underlay) for ns in spec.nodes
        ),
        workloads=(),
    )
    counts = load_cluster(store, SYSTEM, registered)
    counts["workloads"] = len(spec.workloads)
    svc.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    agents: list[RealAgent] = []
    if real is not None:
        own = [ns.node for ns in spec.nodes if ns.node.name in real_names]
        svc.set_policy(store, SYSTEM, real.policy(own), enforce=True)
        agents = real.connect(store)
    attested = [
        ns
        for ns in spec.nodes
        if ns.state is not NodeState.REGISTERED and ns.node.name not in real_names
    ]
    with ThreadPoolExecutor(2) as pool:  # RSA key generation dominates the demo's start
        attesters = list(pool.map(lambda _: SimulatedAttester.create(), attested))
    nodes = [
        DemoNode(ns.node.name, a, inventory(ns.node), drifts=ns.node.name == drift_node)
        for ns, a in zip(attested, attesters, strict=True)
    ]
    attester = DemoAttester(store, nodes, agents, real)
    attester.enroll_all()
    attester.round_all()
    for ns in spec.nodes:
        for key, value in ns.certifications.items():
            grant_certification(store, SYSTEM, ns.node.name, key, value)
        if ns.state is NodeState.CORDONED:
            set_node_state(store, SYSTEM, ns.node.name, NodeState.CORDONED,
                           "cordoned in cluster file")  # fmt: skip
    if spec.workloads:
        submit_workloads(
            store,
            SYSTEM,
            [
                WorkloadSpec(w.name, w.tenant, w.tags, w.isolation, w.gpus, w.priority, w.command)
                for w in spec.workloads
            ],
        )
    attester.round_all()
    return counts, attester
