"""Nodes: registration, inventory, state changes and the certifications the control plane issues."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy import bindparam, insert, inspect, select, update
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
    return _granting(
        store, actor, name, key, value, lambda session, n: _out(session, node_row(session, n))
    )


def certify(store: Store, actor: Actor, name: str, key: str, value: str) -> None:
    """``grant_certification`` but for its answer: the same checks, writes and events. An
    approved ``certification.grant`` change applies this; rendering the node is the direct
    call's answer, not part of the change."""
    _granting(store, actor, name, key, value, lambda _session, _name: None)


def _granting(
    store: Store,
    actor: Actor,
    name: str,
    key: str,
    value: str,
    answer: Callable[[Session, str], T],
) -> T:
    """Grant ``key=value`` on ``name`` and answer ``answer(session, name)`` (the direct call
    renders the node, read after the writes; a change's apply renders nothing)."""
    authorize(actor, Permission.CERTIFY)
    validate_tags({key: value}, field="certification")
    with store.write(actor) as tx:
        node = tx.session.connection().execute(_NODE_STATE_BY_NAME, {"name": name}).first()
        if node is None:
            raise NotFound(f"node {name!r} not found", details={"node": name})
        grant(tx, node.id, name, node.state, key, value)
        return answer(tx.session, name)


# Granting reads and writes with prebuilt Core statements: an approved certification.grant
# change applies it while holding the one write slot (issue 12), and loading the node and its
# certifications as ORM objects and flushing them cost most of that time.
_NODES = NodeRow.__table__
_CERTS = CertificationRow.__table__
_NODE_STATE_BY_NAME = select(_NODES.c.id, _NODES.c.state).where(_NODES.c.name == bindparam("name"))
_CERTS_OF = select(_CERTS.c.key, _CERTS.c.value).where(_CERTS.c.node_id == bindparam("node"))
_INSERT_CERT = insert(_CERTS)
_UPDATE_CERT = update(_CERTS).where(
    _CERTS.c.node_id == bindparam("node"), _CERTS.c.key == bindparam("cert_key")
)
_TOUCH_NODE = update(_NODES).where(_NODES.c.id == bindparam("node"))


def issue_certification(tx: Tx, row: NodeRow, key: str, value: str) -> None:
    """``grant`` for a node the transaction holds as an ORM row: the row's certifications, and
    any certification object already loaded (a replaced value), are read again on next use."""
    tx.session.flush()
    loaded = inspect(row).attrs.certifications.loaded_value
    grant(tx, row.id, row.name, row.state, key, value)
    for cert in loaded if isinstance(loaded, list) else ():
        tx.session.expire(cert)
    tx.session.expire(row, ["certifications", "updated_at"])


def grant(tx: Tx, node_id: int, name: str, state: str, key: str, value: str) -> None:
    """Certify the node ``key=value`` (an admitted or cordoned node): a new value replaces the
    old one, and work that relied on the old one leaves the node; the same value is a no-op."""
    if NodeState(state) not in CERTIFIABLE_STATES:
        raise InvalidState(
            f"node {name!r} is {state}: only admitted nodes can be certified",
            code="node_not_admitted",
            details={"node": name, "state": state},
        )
    conn = tx.session.connection()
    held: dict[str, str] = {k: v for k, v in conn.execute(_CERTS_OF, {"node": node_id})}
    before = held.get(key)
    if before == value:
        return
    issued = {"value": value, "issued_by": tx.actor.name, "issued_at": tx.now}
    if before is not None:
        conn.execute(_UPDATE_CERT, {"node": node_id, "cert_key": key, **issued})
    else:
        conn.execute(_INSERT_CERT, {"node_id": node_id, "key": key, **issued})
    conn.execute(_TOUCH_NODE, {"node": node_id, "updated_at": tx.now})
    held[key] = value
    tx.record(
        "node.certification.grant",
        "node",
        name,
        details={"key": key, "value": value, "previous": before},
    )
    # a new key takes nothing away: no workload on the node can lose a tag it had, so only a
    # changed value looks for work to evict; pending work may fit now either way
    _recheck_workloads(tx, node_id, name, held, evict_lost=before is not None)


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
        _recheck_workloads(tx, row.id, name, {c.key: c.value for c in row.certifications})
        return _out(tx.session, row)


def _recheck_workloads(
    tx: Tx, node_id: int, name: str, held: dict[str, str], *, evict_lost: bool = True
) -> None:
    """Evict (``evict_lost``) every workload on the node whose tags the node's certifications
    (``held``) no longer satisfy, then offer capacity to pending work. Placement, if any is
    needed, starts from the process's cached scheduler, caught up from the events (this
    transaction's certification event included): one node is read, not the cluster."""
    view = ClusterView(tx.session, from_cache=True)
    for wl in workloads_on(tx, node_id) if evict_lost else ():
        lost = missing_tags(wl.tags, held)
        if lost:
            evict(
                tx,
                wl,
                view,
                CERTIFICATION_REVOKED,
                render(CERTIFICATION_REVOKED, node=name, lost=lost),
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
