"""Nodes: registration, inventory, state changes and the certifications the control plane issues."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.hardware.inventory import normalize_gpus
from proofplane.model import (
    Node,
    NodeState,
    missing_tags,
    validate_name,
    validate_tags,
    validate_topology,
)
from proofplane.schedule.reasons import CERTIFICATION_REVOKED, render
from proofplane.service import execution
from proofplane.service.attestation import manual_admission_refused
from proofplane.service.context import Store, Tx
from proofplane.service.lifecycle import change_node_state, workloads_on
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_text_cursor,
    paginate,
)
from proofplane.service.scheduling import ClusterView, evict, reschedule_pending
from proofplane.store.repo import load_node, load_nodes, node_from_row, node_row, node_select
from proofplane.store.tables import CertificationRow, GpuRow, NodeNetworkRow, NodeRow

T = TypeVar("T")

CERTIFIABLE_STATES = frozenset({NodeState.ADMITTED, NodeState.CORDONED})


def check_node(node: Node) -> Node:
    """Validate a node description (names, labels, GPU inventory); return it normalized."""
    validate_name(node.name, "node")
    for what, value in (("region", node.region), ("zone", node.zone)):
        validate_name(value, what)
    if node.rack is not None:
        validate_name(node.rack, "rack")
    topology = validate_topology(node.topology)
    rack = topology.get("rack")
    if rack is not None and node.rack is not None and rack != node.rack:
        raise ValidationFailed(
            f"rack {node.rack!r} and topology.rack {rack!r} disagree (give one, or the same)",
            code="invalid_topology",
            details={"rack": node.rack, "topology": topology},
        )
    if rack is not None:
        node = replace(node, rack=rack)
    node = replace(node, topology=topology)
    if node.certifications:
        raise ValidationFailed(
            "certifications are issued by the control plane, not declared by a node",
            code="certifications_not_allowed",
        )
    resources: tuple[tuple[str, int | None], ...] = (
        ("cpu_milli", node.cpu_milli),
        ("memory_mib", node.memory_mib),
    )
    for resource, amount in resources:
        if amount is not None and not 0 <= amount <= 2**31 - 1:
            raise ValidationFailed(
                f"{resource} must be between 0 and {2**31 - 1} (or absent: not tracked)",
                code="invalid_node_resources",
                details={resource: amount},
            )
    return replace(
        node, labels=validate_tags(node.labels, field="labels"), gpus=normalize_gpus(node.gpus)
    )


def register_node(store: Store, actor: Actor, node: Node) -> Node:
    """Add a node in state ``registered``: known, but not allowed to run anything yet."""
    authorize(actor, Permission.NODES_WRITE)
    node = check_node(node)
    with store.write(actor) as tx:
        row = insert_node(tx, node)
        return _out(tx.session, row)


def insert_node(tx: Tx, node: Node) -> NodeRow:
    if tx.session.scalar(select(NodeRow.id).where(NodeRow.name == node.name)):
        raise Conflict(f"node {node.name!r} already exists", details={"node": node.name})
    uuids = [g.uuid for g in node.gpus]
    taken = list(tx.session.scalars(select(GpuRow.uuid).where(GpuRow.uuid.in_(uuids))))
    if taken:
        raise Conflict("GPU UUIDs already belong to another node", details={"uuids": taken})
    row = NodeRow(
        name=node.name,
        region=node.region,
        zone=node.zone,
        rack=node.rack,
        labels=dict(node.labels),
        cpu_milli=node.cpu_milli,
        memory_mib=node.memory_mib,
        topology=dict(node.topology) or None,
        state=NodeState.REGISTERED.value,
        state_reason=None,
        created_at=tx.now,
        updated_at=tx.now,
        certifications=[],
        gpus=[
            GpuRow(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory_mb=g.memory_mb,
                mig_enabled=g.mig_enabled,
                mig_instances=[{"profile": i.profile, "start": i.start} for i in g.mig_instances],
                vbios_version=g.vbios_version,
                driver_version=g.driver_version,
            )
            for g in node.gpus
        ],
    )
    tx.session.add(row)
    tx.session.flush()
    tx.record(
        "node.register",
        "node",
        node.name,
        details={
            "region": node.region,
            "zone": node.zone,
            "rack": node.rack,
            "labels": dict(node.labels),
            **({"topology": dict(node.topology)} if node.topology else {}),
            "gpus": [
                {"index": g.index, "uuid": g.uuid, "model": g.model, "mig_enabled": g.mig_enabled}
                for g in node.gpus
            ],
        },
    )
    return row


def update_node(
    store: Store,
    actor: Actor,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    rack: str | None = None,
    topology: dict[str, str] | None = None,
) -> Node:
    """Change a node's descriptive fields (labels, rack, topology: the whole mapping is
    replaced). Trust-bearing fields have own calls."""
    authorize(actor, Permission.NODES_WRITE)
    if labels is not None:
        labels = validate_tags(labels, field="labels")
    if rack is not None:
        validate_name(rack, "rack")
    if topology is not None:
        topology = validate_topology(topology)
        named = topology.get("rack")
        if rack is not None and named is not None and named != rack:
            raise ValidationFailed(
                f"rack {rack!r} and topology.rack {named!r} disagree (give one, or the same)",
                code="invalid_topology",
                details={"rack": rack, "topology": topology},
            )
        if rack is None:
            rack = named
    with store.write(actor) as tx:
        row = node_row(tx.session, name)
        changes: dict[str, Any] = {}
        if labels is not None and labels != row.labels:
            changes["labels"] = {"before": row.labels, "after": labels}
            row.labels = labels
        if rack is not None and rack != row.rack:
            changes["rack"] = {"before": row.rack, "after": rack}
            row.rack = rack
        if topology is not None and topology != (row.topology or {}):
            changes["topology"] = {"before": row.topology or {}, "after": topology}
            row.topology = topology or None
        if changes:
            row.updated_at = tx.now
            tx.record("node.update", "node", name, details=changes)
        return _out(tx.session, row)


def set_node_state(
    store: Store, actor: Actor, name: str, state: NodeState, reason: str | None = None
) -> Node:
    """Move a node through its lifecycle. Leaving service evicts its work, which is re-placed
    only on nodes that still satisfy each workload's tags (or waits, with a reason)."""
    authorize(actor, Permission.NODES_WRITE)
    if state == NodeState.DECOMMISSIONED:
        # the lifecycle's last step does all of it: certifications, credentials, the EK
        from proofplane.service.decommission import decommission_node

        decommission_node(store, actor, name, reason or "decommissioned by an operator")
        return get_node(store, actor, name)
    with store.write(actor) as tx:
        row = node_row(tx.session, name)
        refused = manual_admission_refused(tx, row, state)
        if refused is not None:
            raise InvalidState(refused, code="attestation_required", details={"node": name})
        change_node_state(tx, row, state, reason)
        return _out(tx.session, row)


def grant_certification(store: Store, actor: Actor, name: str, key: str, value: str) -> Node:
    """Issue ``key=value`` to an admitted (or cordoned) node. Re-granting the same value is a
    no-op; a new value replaces the old one and evicts work that relied on the old one.
    Answers the node as it now stands."""
    return _granting(store, actor, name, key, value, _out)


def certify(store: Store, actor: Actor, name: str, key: str, value: str) -> None:
    """``grant_certification`` but for its answer: the same checks, writes and events. An
    approved ``certification.grant`` change applies this; rendering the node is the direct
    call's answer, not part of the change."""
    _granting(store, actor, name, key, value, lambda _session, _row: None)


def _granting(
    store: Store,
    actor: Actor,
    name: str,
    key: str,
    value: str,
    answer: Callable[[Session, NodeRow], T],
) -> T:
    authorize(actor, Permission.CERTIFY)
    validate_tags({key: value}, field="certification")
    with store.write(actor) as tx:
        # the GPUs are loaded only if the answer renders them (the direct call's)
        row = node_row(tx.session, name, gpus=False)
        issue_certification(tx, row, key, value)
        return answer(tx.session, row)


def issue_certification(tx: Tx, row: NodeRow, key: str, value: str) -> None:
    if NodeState(row.state) not in CERTIFIABLE_STATES:
        raise InvalidState(
            f"node {row.name!r} is {row.state}: only admitted nodes can be certified",
            code="node_not_admitted",
            details={"node": row.name, "state": row.state},
        )
    existing = next((c for c in row.certifications if c.key == key), None)
    if existing is not None and existing.value == value:
        return
    before = existing.value if existing is not None else None
    if existing is not None:
        existing.value = value
        existing.issued_by = tx.actor.name
        existing.issued_at = tx.now
    else:
        row.certifications.append(
            CertificationRow(key=key, value=value, issued_by=tx.actor.name, issued_at=tx.now)
        )
    row.updated_at = tx.now
    tx.session.flush()
    tx.record(
        "node.certification.grant",
        "node",
        row.name,
        details={"key": key, "value": value, "previous": before},
    )
    _recheck_workloads(tx, row)


def revoke_certification(store: Store, actor: Actor, name: str, key: str) -> Node:
    """Withdraw a certification; work that needed it leaves the node at once."""
    authorize(actor, Permission.CERTIFY)
    with store.write(actor) as tx:
        row = node_row(tx.session, name)
        existing = next((c for c in row.certifications if c.key == key), None)
        if existing is None:
            raise NotFound(
                f"node {name!r} holds no certification {key!r}",
                details={"node": name, "key": key},
            )
        row.certifications.remove(existing)
        row.updated_at = tx.now
        tx.session.flush()
        tx.record(
            "node.certification.revoke",
            "node",
            name,
            details={"key": key, "value": existing.value},
        )
        _recheck_workloads(tx, row)
        return _out(tx.session, row)


def _recheck_workloads(tx: Tx, row: NodeRow) -> None:
    """Evict every workload on the node whose tags the node no longer satisfies. Placement,
    if any is needed, starts from the process's cached scheduler, caught up from the events
    (this transaction's certification event included): one node is read, not the cluster."""
    held = {c.key: c.value for c in row.certifications}
    view = ClusterView(tx.session, from_cache=True)
    for wl in workloads_on(tx, row):
        lost = missing_tags(wl.tags, held)
        if lost:
            evict(
                tx,
                wl,
                view,
                CERTIFICATION_REVOKED,
                render(CERTIFICATION_REVOKED, node=row.name, lost=lost),
            )
    reschedule_pending(tx, view)
    execution.dispatch_new(tx, view)


def get_node(store: Store, actor: Actor, name: str) -> Node:
    authorize(actor, Permission.NODES_READ)
    with store.read() as session:
        return load_node(session, name)


def _out(session: Session, row: NodeRow) -> Node:
    """The node as a write answers it, with its network drift (issue 14)."""
    nn = session.get(NodeNetworkRow, row.id)
    return replace(node_from_row(row), network_drift=None if nn is None else nn.drift)


def list_nodes(
    store: Store,
    actor: Actor,
    *,
    state: NodeState | None = None,
    region: str | None = None,
    zone: str | None = None,
    certification: dict[str, str] | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[Node]:
    """Nodes by name, filtered; ``certification`` keeps nodes holding all the given pairs."""
    authorize(actor, Permission.NODES_READ)
    check_limit(limit)
    after = decode_text_cursor("nodes", cursor)
    query = node_select().order_by(NodeRow.name)
    if after is not None:
        query = query.where(NodeRow.name > after)
    if state is not None:
        query = query.where(NodeRow.state == state.value)
    if region is not None:
        query = query.where(NodeRow.region == region)
    if zone is not None:
        query = query.where(NodeRow.zone == zone)
    for key, value in (certification or {}).items():
        query = query.where(
            NodeRow.certifications.any(
                (CertificationRow.key == key) & (CertificationRow.value == value)
            )
        )
    with store.read() as session:
        items = load_nodes(session, query.limit(limit + 1))
    return paginate("nodes", items, limit, items[limit - 1].name if len(items) > limit else None)
