"""Load a cluster file into an empty control plane, in one transaction (all or nothing)."""

from __future__ import annotations

from sqlalchemy import func, insert, select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, ProofplaneError, ValidationFailed
from proofplane.hardware.cluster_file import ClusterSpec, Underlay
from proofplane.model import Node, NodeState, validate_name
from proofplane.service import network
from proofplane.service.context import NewEvent, Store, Tx
from proofplane.service.lifecycle import change_node_state
from proofplane.service.nodes import check_node, insert_node, issue_certification
from proofplane.service.tenants import insert_tenant, validate_profile
from proofplane.service.workloads import (
    WorkloadSpec,
    check_gpu_request,
    check_topology,
    insert_workload,
)
from proofplane.store.tables import CertificationRow, GpuRow, NodeRow, WorkloadRow

_BULK_STATES = frozenset({NodeState.REGISTERED, NodeState.ADMITTED, NodeState.CORDONED})


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
            vni, pkey = spec.segments.get(tenant.name, (None, None))
            _in(f"tenants.{tenant.name}", lambda t=tenant, v=vni, p=pkey: insert_tenant(
                tx, t, vni=v, pkey=p))  # fmt: skip
        checked = [
            _in(f"nodes.{ns.node.name}", lambda n=ns.node: check_node(n)) for ns in spec.nodes
        ]
        if _bulk_ok(tx, spec, checked):
            _insert_nodes(tx, spec, checked)
        else:
            _insert_nodes_one_by_one(tx, spec, checked)
        _put_underlays(tx, spec)

        for w in spec.workloads:
            ws = WorkloadSpec(
                w.name,
                w.tenant,
                w.tags,
                w.isolation,
                w.gpus,
                w.priority,
                w.command,
                w.cpu_milli,
                w.memory_mib,
                w.restartable,
                w.topology,
            )
            optional = bool(w.cpu_milli or w.memory_mib)
            gpus = _in(
                f"workloads.{w.name}",
                lambda g=w.gpus, o=optional: check_gpu_request(g, gpu_optional=o),
            )
            validate_name(w.name, "workload")
            _in(f"workloads.{w.name}", lambda t=w.topology, g=gpus: check_topology(t, g))
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


def _put_underlays(tx: Tx, spec: ClusterSpec) -> None:
    """The nodes' underlay facts the file gives (issue 14; the demo's are simulated)."""
    wanted = {ns.node.name: ns.underlay for ns in spec.nodes if ns.underlay is not None}
    if not wanted:
        return
    rows = {r.name: r for r in tx.session.scalars(select(NodeRow).where(NodeRow.name.in_(wanted)))}
    for name, u in wanted.items():
        _in(f"nodes.{name}.network", lambda r=rows[name], u=u: _put_underlay(tx, r, u))


def _put_underlay(tx: Tx, row: NodeRow, u: Underlay) -> None:
    vtep, dev, guids = network.check_underlay(u.vtep, u.underlay_dev, list(u.hca_guids))
    source = "simulated" if u.simulated else "cluster-file"
    network.put_underlay(tx, row, vtep, dev, guids, simulated=u.simulated, source=source)


def _admitted_reason(spec: ClusterSpec) -> str:
    return f"simulated node from cluster file {spec.name!r}"


_CORDONED_REASON = "cordoned in cluster file"


def _insert_nodes_one_by_one(tx: Tx, spec: ClusterSpec, nodes: list[Node]) -> None:
    """The general path: each node through the node services (register, admit, certify,
    cordon), which also tell an execution engine and place pending work as nodes arrive."""
    for ns, node in zip(spec.nodes, nodes, strict=True):
        row = insert_node(tx, node)
        if ns.state is not NodeState.REGISTERED:
            change_node_state(tx, row, NodeState.ADMITTED, _admitted_reason(spec))
        for key, value in ns.certifications.items():
            _in(
                f"nodes.{node.name}.certifications",
                lambda r=row, k=key, v=value: issue_certification(tx, r, k, v),
            )
        if ns.state is NodeState.CORDONED:
            change_node_state(tx, row, NodeState.CORDONED, _CORDONED_REASON)


def _bulk_ok(tx: Tx, spec: ClusterSpec, nodes: list[Node]) -> bool:
    """Whether the bulk path writes exactly what the general path would: no engine to tell,
    no workload that arriving capacity could place, only the states a file can ask for,
    certifications only on admitted nodes, and nothing the general path would refuse as a
    duplicate (it then refuses it, with its own message)."""
    if tx.backend is not None or tx.session.scalar(select(func.count()).select_from(WorkloadRow)):
        return False
    if any(ns.state not in _BULK_STATES for ns in spec.nodes):
        return False
    if any(ns.state is NodeState.REGISTERED and ns.certifications for ns in spec.nodes):
        return False
    uuids = [g.uuid for n in nodes for g in n.gpus]
    return len({n.name for n in nodes}) == len(nodes) and len(set(uuids)) == len(uuids)


def _insert_nodes(tx: Tx, spec: ClusterSpec, nodes: list[Node]) -> None:
    """The file's nodes in a few bulk inserts, with the same rows and the same events, in the
    same order, as ``_insert_nodes_one_by_one`` (see ``_bulk_ok`` for when it applies): a
    5,000-node cluster loads in seconds instead of minutes."""
    session, now, actor = tx.session, tx.now, tx.actor.name
    final = {
        NodeState.REGISTERED: (NodeState.REGISTERED.value, None),
        NodeState.ADMITTED: (NodeState.ADMITTED.value, _admitted_reason(spec)),
        NodeState.CORDONED: (NodeState.CORDONED.value, _CORDONED_REASON),
    }
    node_table = NodeRow.__table__
    result = session.execute(
        insert(node_table).returning(node_table.c.id, sort_by_parameter_order=True),
        [
            {
                "name": n.name,
                "region": n.region,
                "zone": n.zone,
                "rack": n.rack,
                "labels": dict(n.labels),
                "cpu_milli": n.cpu_milli,
                "memory_mib": n.memory_mib,
                "topology": dict(n.topology) or None,
                "state": final[ns.state][0],
                "state_reason": final[ns.state][1],
                "created_at": now,
                "updated_at": now,
            }
            for ns, n in zip(spec.nodes, nodes, strict=True)
        ],
    )
    ids = result.scalars().all()
    gpus = [
        {
            "node_id": node_id,
            "index": g.index,
            "uuid": g.uuid,
            "model": g.model,
            "memory_mb": g.memory_mb,
            "mig_enabled": g.mig_enabled,
            "mig_instances": [{"profile": i.profile, "start": i.start} for i in g.mig_instances],
            "vbios_version": g.vbios_version,
            "driver_version": g.driver_version,
        }
        for node_id, n in zip(ids, nodes, strict=True)
        for g in n.gpus
    ]
    if gpus:
        session.execute(insert(GpuRow.__table__), gpus)
    certs = [
        {"node_id": node_id, "key": k, "value": v, "issued_by": actor, "issued_at": now}
        for node_id, ns in zip(ids, spec.nodes, strict=True)
        for k, v in ns.certifications.items()
    ]
    if certs:
        session.execute(insert(CertificationRow.__table__), certs)
    events: list[NewEvent] = []
    admitted = NodeState.ADMITTED.value
    for ns, n in zip(spec.nodes, nodes, strict=True):
        events.append(NewEvent("node.register", "node", n.name, register_details(n)))
        if ns.state is NodeState.REGISTERED:
            continue
        events.append(
            NewEvent(
                "node.state",
                "node",
                n.name,
                {
                    "from": NodeState.REGISTERED.value,
                    "to": admitted,
                    "reason": final[NodeState.ADMITTED][1],
                },
            )
        )
        for key, value in ns.certifications.items():
            events.append(
                NewEvent(
                    "node.certification.grant",
                    "node",
                    n.name,
                    {"key": key, "value": value, "previous": None},
                )
            )
        if ns.state is NodeState.CORDONED:
            events.append(
                NewEvent(
                    "node.state",
                    "node",
                    n.name,
                    {"from": admitted, "to": NodeState.CORDONED.value, "reason": _CORDONED_REASON},
                )
            )
    tx.record_many(events)


def register_details(node: Node) -> dict[str, object]:
    """What the ``node.register`` event says (as ``service.nodes.insert_node`` writes it)."""
    return {
        "region": node.region,
        "zone": node.zone,
        "rack": node.rack,
        "labels": dict(node.labels),
        **({"topology": dict(node.topology)} if node.topology else {}),
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "model": g.model, "mig_enabled": g.mig_enabled}
            for g in node.gpus
        ],
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
