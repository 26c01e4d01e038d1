"""Network segmentation per tenant (issue 14): the use cases.

Segments, endpoints and each node's desired state are kept by ``service.netstate`` inside the
transactions that move work; this module is what the API and the CLI ask for:

* reads: a tenant's segments, every segment (a list page), a node's desired state in each
  format (JSON, ``ip``/``bridge`` batches, nftables, OpenSM partitions), every node's network
  status with its drift, the segmentation map as evidence (JSON or CSV);
* writes: a node's underlay facts (its agent or an operator), the agent's report of what it
  applied (drift and readiness follow from it), a tenant's network policy (governed
  ``network.policy``).

A GET never writes: a node's desired state is recomputed from the database for the request
(the node and the peers of its segments only) and equals what the last write stored a hash of.
"""

from __future__ import annotations

import csv
import io
import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.config import network_from_env
from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeDesired,
    NodeNet,
    Segment,
    desired_to_json,
    normalize_guid,
)
from proofplane.network.policy import parse_policy, policy_sha256, policy_to_json
from proofplane.network.segments import format_pkey
from proofplane.service import execution, netstate, render_support
from proofplane.service.context import Store, Tx
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_cursor,
    decode_text_cursor,
    paginate,
)
from proofplane.service.scheduling import ClusterView, reschedule_pending
from proofplane.store.repo import node_row, tenant_row
from proofplane.store.tables import (
    EndpointRow,
    NodeNetworkRow,
    NodeRow,
    PlacementRow,
    SegmentRow,
    TenantRow,
    placement_nodes,
)

ACTIVE, RELEASED = netstate.ACTIVE, netstate.RELEASED
SEGMENT_STATES = ("active", "released", "all")
FORMATS = render_support.FORMATS
MAX_GUIDS = 64
_IFNAME = re.compile(r"[A-Za-z0-9_.@-]{1,15}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


# --- policies ------------------------------------------------------------------------------------


def check_policy(session: Session, tenant: str, data: Any) -> dict[str, Any] | None:
    """A tenant's network policy, validated against the tenants that exist and made canonical
    (None stays None: the default policy). 422 ``invalid_network_policy`` / ``unknown_tenant``,
    403 ``cross_tenant_rule``."""
    if data is None:
        return None
    known = set(session.scalars(select(TenantRow.name).where(TenantRow.deleted_at.is_(None)))) | {
        tenant
    }
    return policy_to_json(parse_policy(data, tenant=tenant, known_tenants=frozenset(known)))


def check_subnet(session: Session, tenant: str, policy: dict[str, Any] | None) -> None:
    """A new subnet must still hold every address the tenant's workloads have (409
    ``subnet_in_use``): addresses are stable for a workload's life."""
    subnet = ipaddress.ip_network(netstate.tenant_policy(tenant, {"network_policy": policy}).subnet)
    outside = [
        ip
        for ip in session.scalars(select(EndpointRow.ip).where(EndpointRow.tenant == tenant))
        if ipaddress.ip_address(ip) not in subnet
    ]
    if outside:
        raise Conflict(
            f"tenant {tenant!r} has {len(outside)} workload address(es) outside {subnet}: a "
            "workload keeps its address while it lives; change the subnet when they have ended",
            code="subnet_in_use",
            details={"tenant": tenant, "subnet": str(subnet), "outside": sorted(outside)[:20]},
        )


def policy_view(tenant: str, profile: dict[str, Any]) -> dict[str, Any]:
    policy = netstate.tenant_policy(tenant, profile)
    return {
        "tenant": tenant,
        "policy": policy_to_json(policy),
        "policy_sha256": policy_sha256(policy),
        "default": profile.get("network_policy") is None,
    }


def set_network_policy(
    store: Store, actor: Actor, tenant: str, policy: Any, *, change_id: int | None = None
) -> dict[str, Any]:
    """Set (None: back to the default) a tenant's network policy; the nodes running its work
    get a new desired state in the same transaction. Governed (``network.policy``)."""
    authorize(actor, Permission.TENANTS_WRITE, tenant=tenant)
    with store.write(actor) as tx:
        row = tenant_row(tx.session, tenant)
        canonical = check_policy(tx.session, tenant, policy)
        before = (row.profile or {}).get("network_policy")
        if canonical == before:
            return policy_view(tenant, row.profile)
        check_subnet(tx.session, tenant, canonical)
        row.profile = {**row.profile, "network_policy": canonical}
        row.updated_at = tx.now
        tx.session.flush()
        after = netstate.tenant_policy(tenant, row.profile)
        details: dict[str, Any] = {
            "tenant": tenant,
            "before": before,
            "after": canonical,
            "before_sha256": policy_sha256(
                netstate.tenant_policy(tenant, {"network_policy": before})
            ),
            "after_sha256": policy_sha256(after),
        }
        if change_id is not None:
            details["change_id"] = change_id
        tx.record("tenant.network_policy", "tenant", tenant, details=details)
        netstate.policy_changed(tx, tenant, after)
        return policy_view(tenant, row.profile)


def check_policy_change(store: Store, tenant: str, policy: Any) -> None:
    """What ``set_network_policy`` would refuse, checked when a change request is made."""
    with store.read() as session:
        tenant_row(session, tenant)
        canonical = check_policy(session, tenant, policy)
        check_subnet(session, tenant, canonical)


# --- segments ------------------------------------------------------------------------------------


def _nodes_by_vni(session: Session, vnis: Iterable[int]) -> dict[int, list[str]]:
    wanted = sorted(set(vnis))
    out: dict[int, set[str]] = {}
    for at in range(0, len(wanted), 500):
        for vni, node in session.execute(
            select(EndpointRow.vni, EndpointRow.node)
            .where(EndpointRow.vni.in_(wanted[at : at + 500]), EndpointRow.node.is_not(None))
            .distinct()
        ):
            if node is not None:
                out.setdefault(vni, set()).add(node)
    return {vni: sorted(nodes) for vni, nodes in out.items()}


def _segment_item(
    row: SegmentRow, nodes: dict[int, list[str]], cooldown: Any = None
) -> dict[str, Any]:
    out = netstate.segment_json(row, cooldown)
    out["nodes"] = nodes.get(row.vni, []) if row.state == ACTIVE else []
    return out


def list_segments(
    store: Store,
    actor: Actor,
    *,
    state: str = ACTIVE,
    tenant: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[dict[str, Any]]:
    """Segments in allocation order (the tenants the caller can see), active ones by default
    (``released``: the ones cooling down and older; ``all``)."""
    authorize(actor, Permission.TENANTS_READ)
    if tenant is not None:
        authorize(actor, Permission.TENANTS_READ, tenant=tenant)
    if state not in SEGMENT_STATES:
        raise ValidationFailed(
            f"state is one of {', '.join(SEGMENT_STATES)}", details={"state": state}
        )
    check_limit(limit)
    after = decode_cursor("segments", cursor, int)
    query = select(SegmentRow).order_by(SegmentRow.id).limit(limit + 1)
    if state != "all":
        query = query.where(SegmentRow.state == state)
    if tenant is not None:
        query = query.where(SegmentRow.tenant == tenant)
    visible = actor.visible_tenants(Permission.TENANTS_READ)
    if visible is not None:
        query = query.where(SegmentRow.tenant.in_(visible))
    if after is not None:
        query = query.where(SegmentRow.id > after)
    settings = network_from_env() if store.network is None else store.network
    with store.read() as session:
        rows = list(session.scalars(query))
        nodes = _nodes_by_vni(session, (r.vni for r in rows[:limit] if r.state == ACTIVE))
        items = [_segment_item(r, nodes, settings.cooldown) for r in rows]
    return paginate("segments", items, limit, rows[limit - 1].id if len(rows) > limit else None)


def tenant_segments(store: Store, actor: Actor, name: str) -> dict[str, Any]:
    """A tenant's segments (active, and released ones still cooling down), its endpoints,
    where they run, and its effective policy."""
    authorize(actor, Permission.TENANTS_READ)
    authorize(actor, Permission.TENANTS_READ, tenant=name)
    settings = network_from_env() if store.network is None else store.network
    with store.read() as session:
        row = tenant_row(session, name)
        horizon = datetime.now(UTC) - settings.cooldown
        segs = list(
            session.scalars(
                select(SegmentRow)
                .where(SegmentRow.tenant == name)
                .where((SegmentRow.state == ACTIVE) | (SegmentRow.released_at > horizon))
                .order_by(SegmentRow.id)
            )
        )
        eps = list(
            session.scalars(
                select(EndpointRow).where(EndpointRow.tenant == name).order_by(EndpointRow.key)
            )
        )
        nodes = _nodes_by_vni(session, (s.vni for s in segs if s.state == ACTIVE))
        profile = dict(row.profile or {})
    by_vni: dict[int, list[dict[str, Any]]] = {}
    for e in eps:
        by_vni.setdefault(e.vni, []).append(
            {"workload": e.key.split("/", 1)[1].split("#", 1)[0], "member": e.member,
             "ip": e.ip, "mac": e.mac, "node": e.node}
        )  # fmt: skip
    active = []
    for s in segs:
        if s.state != ACTIVE:
            continue
        item = _segment_item(s, nodes)
        item["endpoints"] = by_vni.get(s.vni, [])
        active.append(item)
    return {
        **policy_view(name, profile),
        "segment_mode": profile.get("segment") or "per-tenant",
        "segments": active,
        "cooling": [netstate.segment_json(s, settings.cooldown) for s in segs
                    if s.state != ACTIVE],
    }  # fmt: skip


# --- a node's desired state ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeNetwork:
    """A node's desired network state as served: the state, its generation, the ruleset hash
    its agent must report, and the index it was computed from (the node and its peers)."""

    desired: NodeDesired
    generation: int
    expected_ruleset_sha256: str | None
    index: NetworkIndex
    simulated: bool

    def to_json(self) -> dict[str, Any]:
        out = desired_to_json(self.desired)
        out["generation"] = self.generation
        out["ruleset_sha256"] = self.expected_ruleset_sha256
        out["simulated"] = self.simulated
        return out

    def render(self, fmt: str) -> str:
        return render_support.render_text(self.desired, fmt, self.index, self.generation)


def _authorize_agent_or(actor: Actor, name: str, permission: Permission) -> None:
    """A node's agent acts for its own node only (another node does not exist for it); anyone
    else needs ``permission``."""
    from proofplane.service.attestation import agent_node

    own = agent_node(actor)
    if own is not None:
        if own != name:
            raise NotFound(f"node {name!r} not found", details={"node": name})
        return
    authorize(actor, permission)


def _underlay(session: Session, name: str) -> tuple[NodeRow, NodeNetworkRow]:
    node = node_row(session, name)
    nn = session.get(NodeNetworkRow, node.id)
    if nn is None:
        raise InvalidState(
            f"node {name!r} has no network underlay yet: register it (PUT "
            f"/api/v1/nodes/{name}/network/underlay, or the cluster file's network)",
            code="network_underlay_unknown",
            details={"node": name},
        )
    return node, nn


def desired_of(session: Session, name: str) -> tuple[NodeDesired, NetworkIndex]:
    """The node's desired state from the database: the node, the segments it carries, every
    endpoint of those segments and the underlay of the nodes holding them (what the full index
    holds for this node, and no more)."""
    vnis = sorted(
        set(session.scalars(select(EndpointRow.vni).where(EndpointRow.node == name).distinct()))
    )
    eps: list[Any] = []
    for at in range(0, len(vnis), 500):
        eps.extend(
            session.execute(
                select(EndpointRow.key, EndpointRow.tenant, EndpointRow.node, EndpointRow.vni,
                       EndpointRow.ip, EndpointRow.mac)
                .where(EndpointRow.vni.in_(vnis[at : at + 500]), EndpointRow.node.is_not(None))
            ).all()
        )  # fmt: skip
    names = sorted({name} | {e[2] for e in eps})
    nodes: list[NodeNet] = []
    for at in range(0, len(names), 500):
        nodes.extend(
            NodeNet(n, vtep, dev, tuple(guids or ()))
            for n, vtep, dev, guids in session.execute(
                select(NodeRow.name, NodeNetworkRow.vtep, NodeNetworkRow.underlay_dev,
                       NodeNetworkRow.hca_guids)
                .join(NodeRow, NodeRow.id == NodeNetworkRow.node_id)
                .where(NodeRow.name.in_(names[at : at + 500]))
            )
        )  # fmt: skip
    segments = [
        Segment(t, v, p, netstate.endpoint_key(t, w) if w is not None else None)
        for t, v, p, w in session.execute(
            select(SegmentRow.tenant, SegmentRow.vni, SegmentRow.pkey, SegmentRow.workload).where(
                SegmentRow.state == ACTIVE, SegmentRow.vni.in_(vnis)
            )
        )
    ]
    tenants = sorted({s.tenant for s in segments})
    policies = {
        t: netstate.tenant_policy(t, profile)
        for t, profile in session.execute(
            select(TenantRow.name, TenantRow.profile).where(TenantRow.name.in_(tenants))
        )
        if (profile or {}).get("network_policy") is not None
    }
    index = NetworkIndex(nodes, segments, policies)
    known = set(index.nodes)
    netstate.place_endpoints(
        index,
        [Endpoint(*e) for e in eps if e[2] in known and e[3] in index.segments],
    )
    return index.desired(name), index


def node_network(store: Store, actor: Actor, name: str) -> NodeNetwork:
    """The node's desired network state (its own agent, or ``audit:read``: it names every
    tenant on the node). 409 ``network_underlay_unknown`` before the node has underlay facts."""
    _authorize_agent_or(actor, name, Permission.AUDIT_READ)
    with store.read() as session:
        _node, nn = _underlay(session, name)
        desired, index = desired_of(session, name)
        return NodeNetwork(
            desired, nn.desired_generation, nn.expected_ruleset_sha256, index, nn.simulated
        )


# --- underlay, reports and drift -----------------------------------------------------------------


def status_json(name: str, nn: NodeNetworkRow) -> dict[str, Any]:
    reasons = netstate.drift_reasons(nn)
    managed = nn.reported_at is not None
    return {
        "node": name,
        "vtep": nn.vtep,
        "underlay_dev": nn.underlay_dev,
        "hca_guids": list(nn.hca_guids or ()),
        "simulated": nn.simulated,
        "source": nn.source,
        "desired_generation": nn.desired_generation,
        "desired_sha256": nn.desired_sha256,
        "expected_ruleset_sha256": nn.expected_ruleset_sha256,
        "segments": sorted(int(v) for v in (nn.segment_since or {})),
        "applied_generation": nn.applied_generation,
        "applied_sha256": nn.applied_sha256,
        "ruleset_sha256": nn.ruleset_sha256,
        "reported_at": nn.reported_at.isoformat() if nn.reported_at else None,
        "self_check": nn.self_check,
        "managed": managed,
        "network_drift": bool(reasons) if managed else None,
        "drift": reasons,
    }


def check_underlay(vtep: Any, underlay_dev: Any, hca_guids: Any) -> tuple[str, str, list[str]]:
    try:
        addr = ipaddress.ip_address(vtep) if isinstance(vtep, str) else None
    except ValueError:
        addr = None
    if not isinstance(addr, ipaddress.IPv4Address) or addr.is_unspecified or addr.is_multicast:
        raise ValidationFailed(
            f"vtep must be the node's unicast IPv4 address on the underlay, not {vtep!r}",
            code="invalid_underlay",
            details={"vtep": vtep},
        )
    if (
        not isinstance(underlay_dev, str)
        or not _IFNAME.fullmatch(underlay_dev)
        or underlay_dev in (".", "..")
    ):
        raise ValidationFailed(
            "underlay_dev must be a Linux interface name (1..15 of A-Z a-z 0-9 _ . @ -)",
            code="invalid_underlay",
            details={"underlay_dev": underlay_dev},
        )
    if not isinstance(hca_guids, list | tuple) or len(hca_guids) > MAX_GUIDS:
        raise ValidationFailed(
            f"hca_guids is a list of at most {MAX_GUIDS} port GUIDs",
            code="invalid_underlay",
            details={"hca_guids": str(hca_guids)[:200]},
        )
    guids = sorted({normalize_guid(g) for g in hca_guids})
    return str(addr), underlay_dev, guids


def put_underlay(
    tx: Tx,
    node: NodeRow,
    vtep: str,
    underlay_dev: str,
    hca_guids: list[str],
    *,
    simulated: bool,
    source: str,
) -> bool:
    """Set a node's underlay facts inside ``tx`` (checked by the caller); True if they
    changed. 409 ``vtep_in_use`` for another node's VTEP."""
    other = tx.session.scalar(
        select(NodeRow.name)
        .join(NodeNetworkRow, NodeRow.id == NodeNetworkRow.node_id)
        .where(NodeNetworkRow.vtep == vtep, NodeNetworkRow.node_id != node.id)
    )
    if other is not None:
        raise Conflict(
            f"VTEP {vtep} is node {other!r}'s",
            code="vtep_in_use",
            details={"vtep": vtep, "node": other},
        )
    nn = tx.session.get(NodeNetworkRow, node.id)
    before = None
    if nn is None:
        nn = NodeNetworkRow(
            node_id=node.id,
            desired_generation=0,
            segment_since={},
            updated_at=tx.now,
            vtep=vtep,
            underlay_dev=underlay_dev,
            hca_guids=hca_guids,
            simulated=simulated,
            source=source,
        )
        tx.session.add(nn)
    else:
        before = {"vtep": nn.vtep, "underlay_dev": nn.underlay_dev,
                  "hca_guids": list(nn.hca_guids or ()), "simulated": nn.simulated}  # fmt: skip
        after = {"vtep": vtep, "underlay_dev": underlay_dev, "hca_guids": hca_guids,
                 "simulated": simulated}  # fmt: skip
        if before == after:
            return False
        nn.vtep, nn.underlay_dev, nn.hca_guids = vtep, underlay_dev, hca_guids
        nn.simulated, nn.source, nn.updated_at = simulated, source, tx.now
    tx.session.flush()
    tx.record(
        "node.network.underlay",
        "node",
        node.name,
        details={
            "vtep": vtep,
            "underlay_dev": underlay_dev,
            "hca_guids": hca_guids,
            "simulated": simulated,
            "source": source,
            "before": before,
        },
    )
    # the node's endpoints (and its peers) come into the desired state; work placed on it before
    # it had underlay facts (or before segments existed) gets its endpoints now
    placed = tx.session.scalars(
        select(PlacementRow.workload_id)
        .join(placement_nodes, placement_nodes.c.placement_id == PlacementRow.id)
        .where(placement_nodes.c.node_id == node.id)
    )
    netstate.touch(tx, placed)
    netstate.rebuild(tx)
    return True


def set_underlay(
    store: Store,
    actor: Actor,
    name: str,
    *,
    vtep: Any,
    underlay_dev: Any = "ul0",
    hca_guids: Any = (),
) -> dict[str, Any]:
    """Register or change a node's underlay facts (its agent, or ``nodes:write``)."""
    _authorize_agent_or(actor, name, Permission.NODES_WRITE)
    addr, dev, guids = check_underlay(vtep, underlay_dev, list(hca_guids or ()))
    source = "agent" if netstate_agent(actor) else "api"
    with store.write(actor) as tx:
        node = node_row(tx.session, name)
        put_underlay(tx, node, addr, dev, guids, simulated=False, source=source)
    with store.read() as session:
        return status_json(name, _underlay(session, name)[1])


def netstate_agent(actor: Actor) -> bool:
    from proofplane.service.attestation import agent_node

    return agent_node(actor) is not None


def node_status(store: Store, actor: Actor, name: str) -> dict[str, Any]:
    """One node's network status (its agent, or ``audit:read``)."""
    _authorize_agent_or(actor, name, Permission.AUDIT_READ)
    with store.read() as session:
        _node, nn = _underlay(session, name)
        return status_json(name, nn)


def list_node_status(
    store: Store,
    actor: Actor,
    *,
    drift_only: bool = False,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[dict[str, Any]]:
    """Every node with underlay facts, by name: generations, hashes, its last report, drift."""
    authorize(actor, Permission.AUDIT_READ)
    check_limit(limit)
    after = decode_text_cursor("network-nodes", cursor)
    query = (
        select(NodeNetworkRow, NodeRow.name)
        .join(NodeRow, NodeRow.id == NodeNetworkRow.node_id)
        .order_by(NodeRow.name)
    )
    if after is not None:
        query = query.where(NodeRow.name > after)
    items: list[dict[str, Any]] = []
    last: str | None = None
    with store.read() as session:
        if not drift_only:
            rows = session.execute(query.limit(limit + 1)).all()
            items = [status_json(n, nn) for nn, n in rows]
            last = rows[limit - 1][1] if len(rows) > limit else None
        else:  # drift is computed, not stored: filter while reading, in name order
            for nn, n in session.execute(query.where(NodeNetworkRow.reported_at.is_not(None))):
                item = status_json(n, nn)
                if item["network_drift"]:
                    items.append(item)
                    if len(items) > limit:
                        last = items[limit - 1]["node"]
                        break
    return paginate("network-nodes", items, limit, last)


MAX_GENERATION = 2**62
MAX_SELF_CHECK = 64 << 10


def _check_report(body: Any) -> tuple[int, str, str | None, dict[str, Any]]:
    if not isinstance(body, dict):
        raise ValidationFailed("a report is an object", code="invalid_report")
    gen = body.get("applied_generation")
    if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen <= MAX_GENERATION:
        raise ValidationFailed(
            "applied_generation is a whole number >= 0",
            code="invalid_report",
            details={"applied_generation": str(gen)[:40]},
        )
    sha = body.get("applied_sha256")
    ruleset = body.get("ruleset_sha256")
    for field, value, optional in (
        ("applied_sha256", sha, False),
        ("ruleset_sha256", ruleset, True),
    ):
        if value is None and optional:
            continue
        if not isinstance(value, str) or not _HEX64.fullmatch(value):
            raise ValidationFailed(
                f"{field} is a SHA-256 in lowercase hex",
                code="invalid_report",
                details={field: str(value)[:80]},
            )
    assert isinstance(sha, str) and (ruleset is None or isinstance(ruleset, str))
    check = body.get("self_check")
    if not isinstance(check, dict) or not isinstance(check.get("ok"), bool):
        raise ValidationFailed(
            'self_check is an object with "ok": true|false',
            code="invalid_report",
        )
    try:
        size = len(json.dumps(check, allow_nan=False))
    except (TypeError, ValueError):
        size = -1
    if not 0 < size <= MAX_SELF_CHECK:
        raise ValidationFailed(
            f"self_check is JSON of at most {MAX_SELF_CHECK} bytes (list what failed, not "
            "everything)",
            code="invalid_report",
        )
    return gen, sha, ruleset, check


def report(store: Store, actor: Actor, name: str, body: Any) -> dict[str, Any]:
    """The node's agent says which desired state it applied and how its self-check went. The
    node is then under network management: drift is computed against this report, and work
    that waited for the node to apply its segment is offered the node again."""
    _authorize_agent_or(actor, name, Permission.NODES_WRITE)
    gen, sha, ruleset, check = _check_report(body)
    with store.write(actor) as tx:
        _node, nn = _underlay(tx.session, name)
        before_applied = nn.applied_generation
        before_blocks = netstate.BLOCKS_ALL & set(netstate.drift_reasons(nn))
        nn.applied_generation = gen
        nn.applied_sha256 = sha
        nn.ruleset_sha256 = ruleset
        nn.self_check = check
        nn.reported_at = tx.now
        nn.drift = netstate.note_drift(nn)
        tx.session.flush()
        reasons = netstate.drift_reasons(nn)
        tx.record(
            "node.network.report",
            "node",
            name,
            details={
                "applied_generation": gen,
                "applied_sha256": sha,
                "ruleset_sha256": ruleset,
                "self_check_ok": check["ok"],
                "desired_generation": nn.desired_generation,
                "network_drift": bool(reasons),
                "drift": reasons,
            },
        )
        freed = (before_applied or 0) < gen or bool(
            before_blocks - (netstate.BLOCKS_ALL & set(reasons))
        )
        if freed:  # work that waited for this node's network may be placed now
            view = ClusterView(tx.session, from_cache=True)
            reschedule_pending(tx, view)
            execution.dispatch_new(tx, view)
        return status_json(name, nn)


# --- the segmentation map (evidence) -------------------------------------------------------------

CSV_COLUMNS = (
    "tenant",
    "segment_mode",
    "workload",
    "vni",
    "pkey",
    "nodes",
    "pkey_members",
    "policy_sha256",
    "last_isolation_check_at",
    "last_isolation_check_ok",
)


def segmentation_map(store: Store, actor: Actor) -> dict[str, Any]:
    """Per tenant: its segments (VNI, PKey with its full members: the HCA port GUIDs of the
    nodes holding it), the nodes, its policy's hash, and the last isolation check of those
    nodes (the newest agent report among them, and whether every one of them reported a
    passing self-check with no drift). ``audit:read``."""
    authorize(actor, Permission.AUDIT_READ)
    now = datetime.now(UTC)
    with store.read() as session:
        tenants = list(
            session.execute(
                select(TenantRow.name, TenantRow.profile)
                .where(TenantRow.deleted_at.is_(None))
                .order_by(TenantRow.name)
            )
        )
        segs = list(
            session.scalars(
                select(SegmentRow).where(SegmentRow.state == ACTIVE).order_by(SegmentRow.id)
            )
        )
        nodes_of = _nodes_by_vni(session, (s.vni for s in segs))
        underlay = {
            n: nn
            for nn, n in session.execute(
                select(NodeNetworkRow, NodeRow.name).join(
                    NodeRow, NodeRow.id == NodeNetworkRow.node_id
                )
            )
        }
        out = []
        by_tenant: dict[str, list[SegmentRow]] = {}
        for s in segs:
            by_tenant.setdefault(s.tenant, []).append(s)
        for name, profile in tenants:
            policy = netstate.tenant_policy(name, profile or {})
            all_nodes: set[str] = set()
            items = []
            for s in by_tenant.get(name, []):
                nodes = nodes_of.get(s.vni, [])
                all_nodes.update(nodes)
                members = [
                    {"node": n, "guid": g, "membership": "full"}
                    for n in nodes
                    if n in underlay
                    for g in (underlay[n].hca_guids or ())
                ]
                items.append(
                    {
                        "workload": s.workload,
                        "vni": s.vni,
                        "pkey": format_pkey(s.pkey),
                        "pkey_members": members,
                        "nodes": nodes,
                        "allocated_at": s.allocated_at.isoformat(),
                    }
                )
            out.append(
                {
                    "tenant": name,
                    "segment_mode": (profile or {}).get("segment") or "per-tenant",
                    "policy_sha256": policy_sha256(policy),
                    "default_policy": (profile or {}).get("network_policy") is None,
                    "segments": items,
                    "nodes": sorted(all_nodes),
                    "last_isolation_check": _last_check(sorted(all_nodes), underlay),
                }
            )
    return {"generated_at": now.isoformat(), "tenants": out}


def _last_check(nodes: list[str], underlay: dict[str, NodeNetworkRow]) -> dict[str, Any] | None:
    reported = [underlay[n] for n in nodes if n in underlay and underlay[n].reported_at]
    if not reported:
        return None
    newest = max(nn.reported_at for nn in reported if nn.reported_at is not None)
    failing = sorted(n for n in nodes if n not in underlay or netstate.drift_reasons(underlay[n])
                     or underlay[n].reported_at is None)  # fmt: skip
    return {
        "at": newest.isoformat(),
        "ok": not failing,
        "nodes_reported": len(reported),
        "nodes": len(nodes),
        "failing": failing,
    }


def segmentation_csv(data: dict[str, Any]) -> str:
    """The map as CSV: one row per segment (a tenant without any: one row with empty cells)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for t in data["tenants"]:
        check = t["last_isolation_check"] or {}
        common = (t["policy_sha256"], check.get("at", ""),
                  "" if not check else str(check["ok"]).lower())  # fmt: skip
        segs = t["segments"] or [None]
        for s in segs:
            if s is None:
                writer.writerow([t["tenant"], t["segment_mode"], "", "", "", "", "", *common])
                continue
            members = ";".join(f"{m['guid']}={m['membership']}@{m['node']}"
                               for m in s["pkey_members"])  # fmt: skip
            writer.writerow([t["tenant"], t["segment_mode"], s["workload"] or "", s["vni"],
                             s["pkey"], ";".join(s["nodes"]), members, *common])  # fmt: skip
    return buf.getvalue()
