"""Load a cluster file into an empty control plane, in one transaction (all or nothing)."""

from __future__ import annotations

from sqlalchemy import func, select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, ProofplaneError, ValidationFailed
from proofplane.hardware.cluster_file import ClusterSpec
from proofplane.model import NodeState, validate_name
from proofplane.service.context import Store
from proofplane.service.nodes import change_node_state, check_node, insert_node, issue_certification
from proofplane.service.tenants import insert_tenant, validate_profile
from proofplane.service.workloads import WorkloadSpec, check_gpu_request, insert_workload
from proofplane.store.tables import NodeRow


def load_cluster(store: Store, actor: Actor, spec: ClusterSpec) -> dict[str, int]:
    """Create the file's tenants and nodes, admit and certify nodes as the file says (simulated
    hardware has no TPM to attest; the events say so), then submit its workloads."""
    authorize(actor, Permission.NODES_WRITE)
    with store.write(actor) as tx:
        if tx.session.scalar(select(func.count()).select_from(NodeRow)):
            raise Conflict(
                "the control plane already has nodes; load a cluster into an empty one",
                code="cluster_not_empty",
            )
        for tenant in spec.tenants:
            _in(f"tenants.{tenant.name}", lambda t=tenant: validate_profile(t.profile))
            validate_name(tenant.name, "tenant")
            insert_tenant(tx, tenant)
        for ns in spec.nodes:
            node = _in(f"nodes.{ns.node.name}", lambda n=ns.node: check_node(n))
            row = insert_node(tx, node)
            if ns.state is not NodeState.REGISTERED:
                change_node_state(
                    tx, row, NodeState.ADMITTED, f"simulated node from cluster file {spec.name!r}"
                )
            for key, value in ns.certifications.items():
                _in(
                    f"nodes.{node.name}.certifications",
                    lambda r=row, k=key, v=value: issue_certification(tx, r, k, v),
                )
            if ns.state is NodeState.CORDONED:
                change_node_state(tx, row, NodeState.CORDONED, "cordoned in cluster file")
        for w in spec.workloads:
            ws = WorkloadSpec(w.name, w.tenant, w.tags, w.isolation, w.gpus, w.priority, w.command)
            gpus = _in(f"workloads.{w.name}", lambda g=w.gpus: check_gpu_request(g))
            validate_name(w.name, "workload")
            _in(f"workloads.{w.name}", lambda s=ws, g=gpus: insert_workload(tx, s, g))
        tx.record(
            "cluster.load",
            "cluster",
            spec.name,
            details={
                "tenants": len(spec.tenants),
                "nodes": len(spec.nodes),
                "workloads": len(spec.workloads),
            },
        )
    return {
        "tenants": len(spec.tenants),
        "nodes": len(spec.nodes),
        "workloads": len(spec.workloads),
    }


def _in(where: str, fn):  # noqa: ANN001 - small local helper
    """Run ``fn``; prefix any validation error with the place in the file it came from."""
    try:
        return fn()
    except ProofplaneError as exc:
        if isinstance(exc, ValidationFailed | Conflict):
            exc.message = f"{where}: {exc.message}"
            exc.args = (exc.message,)
        raise
