"""Network segmentation inside the write transaction (issue 14): segment pools, workload
endpoints, each node's desired network state, and what placement needs to know about it.

The services that move capacity call in here from inside their transaction; nothing here opens
one. Three jobs:

* **Segments** (``allocate_segment``, ``release_segment``): a VXLAN VNI and an InfiniBand PKey
  from the pools of ``NetworkSettings``, lowest free, a released one cooling down before it is
  handed out again (``proofplane.network.segments``). Every tenant gets one at creation; a tenant
  whose profile says ``segment: per-workload`` also gets one per workload at submission,
  released when the workload ends.
* **Endpoints and desired state** (``touch`` → ``_finish``): a service that placed, evicted or
  ended workloads names them; just before the commit (``Tx.on_finish``) their endpoints are
  brought in line with their placements (a stable overlay IP and MAC per workload, per gang
  member, kept while the workload lives) and the desired state of the nodes this changes is
  recomputed with the pure ``NetworkIndex``: a node whose desired SHA-256 changed gets the next
  generation, and one ``network.desired`` event says which. The index is kept per store between
  transactions (``NetworkCache``, current at an event ``seq`` like the scheduler cache), so a
  placement costs what it changes. Another writer's placements, cancellations and evictions
  (another worker process, an API replica) are followed: the endpoints of the workloads its
  events name are read again and applied. When it changed anything else the index holds
  (segments, policies, node underlays, tenants), the index is rebuilt from the database
  (every node compared).
* **Readiness** (``load_readiness``): a node under network management (its agent has reported)
  that has not applied the generation that brought a segment gets no new work of that segment
  (``network_not_applied``); one whose ruleset differs from the expected one or whose self-check
  failed gets no new work at all.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from sqlalchemy import bindparam, delete, insert, or_, select, update
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key
from sqlalchemy.pool import Pool

from proofplane.access import Actor
from proofplane.config import NetworkSettings, network_from_env
from proofplane.errors import ProofplaneError
from proofplane.model import Outcome, WorkloadStatus
from proofplane.model.tenant import PER_WORKLOAD
from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeDesired,
    NodeNet,
    Segment,
    SubnetExhausted,
    allocate_ip,
    endpoint_mac,
)
from proofplane.network.policy import NetworkPolicy, parse_policy
from proofplane.network.segments import (
    SegmentKind,
    SegmentPoolExhausted,
    check_manual,
    format_pkey,
    next_free,
)
from proofplane.service import render_support
from proofplane.service.context import NewEvent, Store, Tx, events_after
from proofplane.store.tables import (
    EndpointRow,
    NodeNetworkRow,
    NodeRow,
    PlacementRow,
    SegmentRow,
    TenantRow,
    WorkloadRow,
)

log = logging.getLogger(__name__)

ACTIVE, RELEASED = "active", "released"
_KEY = "network"
_IN_CHUNK = 500  # ids per "IN (...)" query


def settings_of(tx: Tx) -> NetworkSettings:
    """The store's network settings, or ``PROOFPLANE_*``'s."""
    return tx.network_settings if tx.network_settings is not None else network_from_env()


def endpoint_key(tenant: str, workload: str, member: int = 0) -> str:
    """The endpoint's name in the desired state (``Endpoint.workload``): unique in the cluster
    (workload names are unique per tenant), one per gang member."""
    base = f"{tenant}/{workload}"
    return base if member == 0 else f"{base}#{member}"


def tenant_policy(tenant: str, profile_json: Mapping[str, Any]) -> NetworkPolicy:
    """A tenant's policy from its stored profile (kept canonical, so it parses as stored)."""
    data = profile_json.get("network_policy")
    return parse_policy(data, tenant=tenant, known_tenants=frozenset({tenant}))


def is_per_workload(profile_json: Mapping[str, Any]) -> bool:
    return profile_json.get("segment") == PER_WORKLOAD


# --- per-transaction state -----------------------------------------------------------------------


@dataclass
class _NetTx:
    touched: set[int] = field(default_factory=set)  # workload ids whose placement may have moved
    new_segments: list[Segment] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # VNIs released in this transaction
    policies: dict[str, NetworkPolicy] = field(default_factory=dict)
    rebuild: bool = False
    pools: _Pools | None = None
    used_ips: dict[int, set[str]] = field(default_factory=dict)
    index: NetworkIndex | None = None  # the index this transaction changed (kept on re-runs)
    listening: bool = False
    # workloads inserted in this transaction, not yet synced: no endpoint, and no segment but
    # the one ``allocate_segment`` gave them here (``own``), so neither is read back
    created: set[int] = field(default_factory=set)
    own: dict[int, SegmentRow] = field(default_factory=dict)
    # the network.endpoints and network.desired events of ``_finish``, written at its end in
    # one insert (in the order they were recorded)
    events: list[NewEvent] = field(default_factory=list)

    def idle(self) -> bool:
        return not (
            self.touched or self.new_segments or self.released or self.policies or self.rebuild
        )

    def reset(self) -> None:
        self.touched.clear()
        self.new_segments.clear()
        self.released.clear()
        self.policies.clear()
        self.rebuild = False


def _state(tx: Tx) -> _NetTx:
    st = tx.extras.get(_KEY)
    if st is None:
        st = tx.extras[_KEY] = _NetTx()
        tx.on_finish(_finish)
    assert isinstance(st, _NetTx)
    return st


def touch(tx: Tx, workload_ids: Iterable[int]) -> None:
    """These workloads' placements may have changed in this transaction (placed, evicted,
    ended): their endpoints and the nodes' desired state follow before the commit."""
    _state(tx).touched.update(workload_ids)


def created(tx: Tx, workload_id: int) -> None:
    """The workload was inserted in this transaction: it has no endpoints yet (nothing to read
    back when its placement is synced)."""
    _state(tx).created.add(workload_id)


def policy_changed(tx: Tx, tenant: str, policy: NetworkPolicy) -> None:
    _state(tx).policies[tenant] = policy


def rebuild(tx: Tx) -> None:
    """Something changed that the cached index cannot follow: recompute every node."""
    _state(tx).rebuild = True


# --- segment pools -------------------------------------------------------------------------------


class _Pools:
    """The identifiers in use and cooling down, read once per transaction and kept current as
    it allocates and releases (writers are serialized: nobody else allocates meanwhile)."""

    def __init__(self, tx: Tx, settings: NetworkSettings) -> None:
        self.settings = settings
        self.now = tx.now
        horizon = tx.now - settings.cooldown
        rows = tx.session.execute(
            select(SegmentRow.vni, SegmentRow.pkey, SegmentRow.state, SegmentRow.released_at).where(
                or_(SegmentRow.state == ACTIVE, SegmentRow.released_at > horizon)
            )
        )
        self.used: dict[str, set[int]] = {"vni": set(), "pkey": set()}
        self.cooling: dict[str, dict[int, datetime]] = {"vni": {}, "pkey": {}}
        for vni, pkey, state, released_at in rows:
            if state == ACTIVE:
                self.used["vni"].add(vni)
                self.used["pkey"].add(pkey)
            elif released_at is not None:
                for kind, value in (("vni", vni), ("pkey", pkey)):
                    before = self.cooling[kind].get(value)
                    if before is None or released_at > before:
                        self.cooling[kind][value] = released_at

    def pool(self, kind: str) -> tuple[int, int]:
        return self.settings.vni_pool if kind == "vni" else self.settings.pkey_pool

    def take(self, kind: SegmentKind, manual: int | None) -> int:
        lo, hi = self.pool(kind)
        used, cooling, cooldown = self.used[kind], self.cooling[kind], self.settings.cooldown
        if manual is not None:
            return check_manual(manual, lo, hi, used, cooling, self.now, cooldown, kind=kind)
        return next_free(lo, hi, used, cooling, self.now, cooldown, kind=kind)

    def hold(self, vni: int, pkey: int) -> None:
        self.used["vni"].add(vni)
        self.used["pkey"].add(pkey)

    def release(self, vni: int, pkey: int) -> None:
        for kind, value in (("vni", vni), ("pkey", pkey)):
            self.used[kind].discard(value)
            self.cooling[kind][value] = self.now


def _pools(tx: Tx) -> _Pools:
    st = _state(tx)
    if st.pools is None:
        st.pools = _Pools(tx, settings_of(tx))
    return st.pools


def segment_json(row: SegmentRow, cooldown: timedelta | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tenant": row.tenant,
        "workload": row.workload,
        "vni": row.vni,
        "pkey": format_pkey(row.pkey),
        "state": row.state,
        "manual": row.manual,
        "allocated_at": row.allocated_at.isoformat(),
        "released_at": row.released_at.isoformat() if row.released_at else None,
    }
    if row.released_at is not None and cooldown is not None:
        out["reusable_after"] = (row.released_at + cooldown).isoformat()
    return out


def allocate_segment(
    tx: Tx,
    tenant: str,
    *,
    workload: str | None = None,
    workload_id: int | None = None,
    vni: int | None = None,
    pkey: int | None = None,
) -> SegmentRow:
    """A new active segment for ``tenant`` (or for one of its workloads), recorded. A manual
    ``vni``/``pkey`` outside its pool is 422 ``invalid_segment``, one held or cooling down 409
    ``segment_in_use``; no free one is 409 ``segment_pool_exhausted`` (nothing is written: the
    caller's transaction rolls back; ``record_exhaustion`` then writes the event)."""
    pools = _pools(tx)
    try:
        v = pools.take("vni", vni)
        p = pools.take("pkey", pkey)
    except SegmentPoolExhausted as exc:
        d = exc.details if isinstance(exc.details, dict) else {}
        exc.details = {**d, "tenant": tenant, "workload": workload}
        raise
    row = SegmentRow(
        tenant=tenant,
        workload=workload,
        workload_id=workload_id,
        vni=v,
        pkey=p,
        state=ACTIVE,
        manual=vni is not None or pkey is not None,
        allocated_at=tx.now,
    )
    tx.session.add(row)
    tx.session.flush()
    pools.hold(v, p)
    if workload_id is not None:
        _state(tx).own[workload_id] = row
    key = endpoint_key(tenant, workload) if workload is not None else None
    _state(tx).new_segments.append(Segment(tenant, v, p, key))
    tx.record(
        "network.segment.allocate",
        "tenant",
        tenant,
        details={
            "tenant": tenant,
            "workload": workload,
            "vni": v,
            "pkey": format_pkey(p),
            "manual": row.manual,
        },
    )
    return row


def release_segment(tx: Tx, row: SegmentRow, why: str) -> None:
    """Release an active segment: its VNI and PKey cool down before anyone gets them again."""
    if row.state != ACTIVE:
        return
    settings = settings_of(tx)
    row.state = RELEASED
    row.released_at = tx.now
    tx.session.flush()
    _pools(tx).release(row.vni, row.pkey)
    _state(tx).released.append(row.vni)
    tx.record(
        "network.segment.release",
        "tenant",
        row.tenant,
        details={
            "tenant": row.tenant,
            "workload": row.workload,
            "vni": row.vni,
            "pkey": format_pkey(row.pkey),
            "why": why,
            "reusable_after": (tx.now + settings.cooldown).isoformat(),
        },
    )


def exhaustion_details(
    exc: SegmentPoolExhausted, tenant: str | None = None, workload: str | None = None
) -> dict[str, Any]:
    d = exc.details if isinstance(exc.details, dict) else {}
    return {
        "tenant": d.get("tenant", tenant),
        "workload": d.get("workload", workload),
        "kind": d.get("kind"),
        "pool": d.get("pool"),
        "blocked": d.get("blocked"),
        "message": exc.message,
    }


@contextmanager
def exhaustion_recorded(
    store: Store, actor: Actor, tenant: str | None, workload: str | None
) -> Iterator[None]:
    """Around a use case's transaction: when it fails with ``segment_pool_exhausted`` (and so
    wrote nothing), record the exhaustion in a transaction of its own, then let the error go
    on (409). Inside a joined transaction (an approved change) the event joins it and goes
    with it."""
    try:
        yield
    except SegmentPoolExhausted as exc:
        details = exhaustion_details(exc, tenant, workload)
        target = details["tenant"] or "-"
        try:
            with store.write(actor) as tx:
                tx.record("network.segment.exhausted", "tenant", target, outcome=Outcome.FAILURE,
                          details=details)  # fmt: skip
        except ProofplaneError:  # the refusal is what the caller must see
            log.warning("network: could not record a pool exhaustion", exc_info=True)
        raise


# The statements a write's network sync runs, built once (statement and cache key: building
# them cost about as much as running them, issue 20).
# The tenant's own (shared) active segment's VNI.
_TENANT_VNI = select(SegmentRow.vni).where(
    SegmentRow.tenant == bindparam("tenant"),
    SegmentRow.state == ACTIVE,
    SegmentRow.workload_id.is_(None),
)


# --- endpoints -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ep:
    """An endpoint as this transaction leaves it: None for ``node`` while it waits."""

    key: str
    tenant: str
    vni: int
    ip: str
    mac: str
    node: str | None


def _parts_nodes(node: str | None, members: list[dict[str, Any]] | None) -> list[str]:
    if members:
        return [str(m["node"]) for m in members]
    return [node] if node is not None else []


_TOUCHED = (
    select(
        WorkloadRow.id,
        WorkloadRow.name,
        WorkloadRow.status,
        TenantRow.name,
        TenantRow.profile,
        NodeRow.name,
        PlacementRow.members,
    )
    .join(TenantRow, TenantRow.id == WorkloadRow.tenant_id)
    .outerjoin(PlacementRow, PlacementRow.workload_id == WorkloadRow.id)
    .outerjoin(NodeRow, NodeRow.id == PlacementRow.node_id)
    .where(WorkloadRow.id.in_(bindparam("ids", expanding=True)))
    .order_by(WorkloadRow.id)
)
# The endpoints are read and written as columns by Core statements (issue 20: the ORM's unit
# of work for them was the largest part of a placing transaction's network sync).
_EPT = EndpointRow.__table__
_ENDPOINTS_OF = select(
    _EPT.c.id, _EPT.c.workload_id, _EPT.c.member, _EPT.c.key, _EPT.c.tenant, _EPT.c.vni,
    _EPT.c.ip, _EPT.c.mac, _EPT.c.node,
).where(_EPT.c.workload_id.in_(bindparam("ids", expanding=True)))  # fmt: skip
_DELETE_ENDPOINTS = delete(_EPT).where(_EPT.c.id.in_(bindparam("ids", expanding=True)))
_MOVE_ENDPOINT = update(_EPT).where(_EPT.c.id == bindparam("m_id")).values(node=bindparam("m_node"))
_INSERT_ENDPOINT = insert(_EPT)
_OWN_SEGMENTS_OF = select(SegmentRow).where(
    SegmentRow.workload_id.in_(bindparam("ids", expanding=True)), SegmentRow.state == ACTIVE
)
_IPS_OF = select(EndpointRow.ip).where(EndpointRow.vni == bindparam("vni"))


def _sync_endpoints(tx: Tx, st: _NetTx) -> tuple[dict[str, _Ep | None], bool]:
    """Bring the touched workloads' endpoints in line with their placements. Returns every
    endpoint key they had or have now → its state (None: gone), and whether anything was
    written."""
    ids = sorted(st.touched)
    session = tx.session
    out: dict[str, _Ep | None] = {}
    if not ids:
        return out, False
    session.flush()
    rows: list[Any] = []
    existing: dict[int, dict[int, Any]] = {}
    own_segments: dict[int | None, SegmentRow] = {}
    for at in range(0, len(ids), _IN_CHUNK):
        chunk = ids[at : at + _IN_CHUNK]
        rows.extend(session.connection().execute(_TOUCHED, {"ids": chunk}).all())
        stored = [i for i in chunk if i not in st.created]  # the others have none stored
        if not stored:
            continue
        for ep in session.connection().execute(_ENDPOINTS_OF, {"ids": stored}):
            existing.setdefault(ep.workload_id, {})[ep.member] = ep
        for seg in session.scalars(_OWN_SEGMENTS_OF, {"ids": stored}):
            own_segments[seg.workload_id] = seg
    for wid in st.created.intersection(ids):
        own = st.own.get(wid)
        if own is not None and own.state == ACTIVE:
            own_segments[wid] = own
    st.created.difference_update(ids)  # synced: from now on they may have endpoints
    allocated: dict[str, list[dict[str, Any]]] = {}
    released: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, list[dict[str, Any]]] = {}
    tenant_vni: dict[str, int | None] = {}
    policies: dict[str, NetworkPolicy] = {}
    wrote = False
    # First what ended: its addresses are free (and deleted) before any is handed out again in
    # this transaction.
    gone: list[int] = []
    moved: list[dict[str, Any]] = []
    new: list[dict[str, Any]] = []
    ended = [r for r in rows if WorkloadStatus(r[2]).is_terminal]
    for wid, name, status, tenant, _profile, _node, _members in ended:
        for ep in existing.get(wid, {}).values():
            out[ep.key] = None
            released.setdefault(tenant, []).append(
                {"workload": name, "member": ep.member, "vni": ep.vni, "ip": ep.ip,
                 "mac": ep.mac}
            )  # fmt: skip
            st.used_ips.get(ep.vni, set()).discard(ep.ip)
            gone.append(ep.id)
            wrote = True
        own = own_segments.get(wid)
        if own is not None:
            release_segment(tx, own, f"workload {name} {status}")
    if gone:  # deleted before any address is handed out again in this transaction
        session.connection().execute(_DELETE_ENDPOINTS, {"ids": gone})
    session.flush()
    for wid, name, status, tenant, profile, node, members in rows:
        if WorkloadStatus(status).is_terminal:
            continue
        eps = existing.get(wid, {})
        nodes = _parts_nodes(node, members) if status in _HOLDING else []
        for member, ep in eps.items():
            where = nodes[member] if member < len(nodes) else None
            if ep.node != where:
                moved.append({"m_id": ep.id, "m_node": where})
                wrote = True
            out[ep.key] = _Ep(ep.key, ep.tenant, ep.vni, ep.ip, ep.mac, where)
        for member, where in enumerate(nodes):
            if member in eps:
                continue
            key = endpoint_key(tenant, name, member)
            own = own_segments.get(wid)
            vni: int | None
            if own is not None:
                vni = own.vni
            else:
                if tenant not in tenant_vni:
                    tenant_vni[tenant] = _ensure_tenant_vni(tx, tenant)
                vni = tenant_vni[tenant]
            if vni is None:
                failed.setdefault(tenant, []).append(
                    {"workload": name, "member": member, "why": "segment_pool_exhausted"}
                )
                continue
            if tenant not in policies:
                policies[tenant] = tenant_policy(tenant, profile)
            used = _used_ips(tx, st, vni)
            try:
                ip = allocate_ip(policies[tenant].subnet, used)
            except SubnetExhausted as exc:
                failed.setdefault(tenant, []).append(
                    {"workload": name, "member": member, "why": exc.code,
                     "subnet": policies[tenant].subnet}
                )  # fmt: skip
                continue
            used.add(ip)
            mac = endpoint_mac(tenant, key)
            new.append({"workload_id": wid, "member": member, "key": key, "tenant": tenant,
                        "vni": vni, "ip": ip, "mac": mac, "node": where,
                        "created_at": tx.now})  # fmt: skip
            wrote = True
            out[key] = _Ep(key, tenant, vni, ip, mac, where)
            allocated.setdefault(tenant, []).append(
                {"workload": name, "member": member, "vni": vni, "ip": ip, "mac": mac}
            )
    connection = session.connection()
    if moved:
        connection.execute(_MOVE_ENDPOINT, moved)
    if new:
        connection.execute(_INSERT_ENDPOINT, new)
    for tenant in sorted(set(allocated) | set(released)):
        details: dict[str, Any] = {"tenant": tenant}
        if tenant in allocated:
            details["allocated"] = allocated[tenant]
        if tenant in released:
            details["released"] = released[tenant]
        st.events.append(NewEvent("network.endpoints", "tenant", tenant, details))
    for tenant, items in sorted(failed.items()):
        st.events.append(NewEvent(
            "network.endpoints",
            "tenant",
            tenant,
            {"tenant": tenant, "unassigned": items,
             "message": "placed without a network endpoint: no segment or no free "
             "address in the tenant's subnet"},
            Outcome.FAILURE,
        ))  # fmt: skip
    return out, wrote


_HOLDING = frozenset({WorkloadStatus.PLACED.value, WorkloadStatus.RUNNING.value})


def _ensure_tenant_vni(tx: Tx, tenant: str) -> int | None:
    """The tenant's segment VNI; a tenant from before segments existed gets one now. None when
    the pools are exhausted (the placement stands; the workload has no endpoint, and the
    event says so)."""
    vni = tx.session.connection().execute(_TENANT_VNI, {"tenant": tenant}).scalar()
    if vni is not None:  # read as a column (issue 20: every placing transaction reads it)
        return int(vni)
    try:  # the pools are checked before anything is written: a refusal leaves nothing behind
        return allocate_segment(tx, tenant).vni
    except SegmentPoolExhausted as exc:
        tx.record(
            "network.segment.exhausted",
            "tenant",
            tenant,
            outcome=Outcome.FAILURE,
            details=exhaustion_details(exc, tenant),
        )
        return None


def _used_ips(tx: Tx, st: _NetTx, vni: int) -> set[str]:
    used = st.used_ips.get(vni)
    if used is None:
        found = tx.session.connection().execute(_IPS_OF, {"vni": vni}).scalars()
        used = st.used_ips[vni] = set(found)
    return used


# --- desired state -------------------------------------------------------------------------------

# Events after which a cached index may still be reused: only these can change what it holds
# (everything else (tokens, attestation rounds, SIEM cursors, a workload waiting) cannot).
_IGNORED_WORKLOAD_ACTIONS = frozenset({"workload.submit", "workload.pending", "workload.dispatch"})
CATCH_UP_MAX = 2000


# Another writer's events that only restate what following its workloads' endpoints brings
# (``network.endpoints``: the endpoints it changed; ``network.desired``: the node generations
# it derived from them, which this index derives alike).
_FOLLOWED_NETWORK_ACTIONS = frozenset({"network.endpoints", "network.desired"})


def _workload_of_key(key: str) -> str:
    """The workload name in an endpoint key (``endpoint_key``: ``tenant/workload[#member]``)."""
    return key.split("/", 1)[1].split("#", 1)[0]


def _follow(session: Session, index: NetworkIndex, names: set[str]) -> frozenset[str]:
    """Bring the endpoints of the workloads named ``names`` (in any tenant) in ``index`` in
    line with the database; the nodes whose desired state that changes."""
    stored = [
        Endpoint(key, tenant, node, vni, ip, mac)
        for key, tenant, node, vni, ip, mac in session.execute(
            _ENDPOINTS_NAMED, {"names": sorted(names)}
        )
    ]
    gone = [k for k in index.endpoints if _workload_of_key(k) in names]
    affected = set(index.remove(gone))
    here = [e for e in stored if e.node is not None and e.node in index.nodes
            and e.vni in index.segments]  # fmt: skip
    affected |= place_endpoints(index, here)
    return frozenset(affected)


# What following another writer reads, built once.
_ENDPOINTS_NAMED = (
    select(EndpointRow.key, EndpointRow.tenant, EndpointRow.node, EndpointRow.vni,
           EndpointRow.ip, EndpointRow.mac)
    .join(WorkloadRow, WorkloadRow.id == EndpointRow.workload_id)
    .where(WorkloadRow.name.in_(bindparam("names", expanding=True)))
)  # fmt: skip


def _relevant(action: str) -> bool:
    if action.startswith("workload."):
        return action not in _IGNORED_WORKLOAD_ACTIONS
    return action.startswith(("network.", "tenant.", "node.network.", "cluster."))


class NetworkCache:
    """The ``NetworkIndex`` one database's last network-changing transaction left behind and
    the event ``seq`` it is current at. A transaction reuses it when nothing written since can
    have changed it (its events are checked, as the scheduler cache does), and owns it until it
    ends: committed, the cache is current at the transaction's last event; rolled back, it is
    dropped (it may hold changes that never happened)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.index: NetworkIndex | None = None
        self.loads = 0
        self.hits = 0

    def usable(self, session: Session, base: int) -> tuple[NetworkIndex, frozenset[str]] | None:
        """The cached index brought to event ``base`` and the nodes that changed on the way
        (another writer's placements, followed), or None when it must be rebuilt."""
        if self.index is None or self.version is None or self.version > base:
            return None
        if self.version == base:
            return self.index, frozenset()
        events = events_after(session, self.version, CATCH_UP_MAX, upto=base)
        if len(events) > CATCH_UP_MAX:
            return None
        names: set[str] = set()
        for _seq, target_type, target_id, action in events:
            if not _relevant(action) or action in _FOLLOWED_NETWORK_ACTIONS:
                continue
            if action.startswith("workload.") and target_type == "workload":
                names.add(target_id)
                continue
            return None  # segments, policies, underlays, tenants: rebuild
        if not names:
            return self.index, frozenset()
        try:
            affected = _follow(session, self.index, names)
        except ProofplaneError:
            log.warning("network: could not follow another writer; recomputing", exc_info=True)
            self.drop()
            return None
        return self.index, affected

    def drop(self) -> None:
        self.index, self.version = None, None


_CACHES: weakref.WeakKeyDictionary[Pool, NetworkCache] = weakref.WeakKeyDictionary()


def network_cache(engine: Engine) -> NetworkCache:
    """The network index cache of one database engine (one per ``Store``)."""
    cache = _CACHES.get(engine.pool)
    if cache is None:
        cache = _CACHES[engine.pool] = NetworkCache()
    return cache


def _cache_for(session: Session) -> NetworkCache:
    bind = session.get_bind()
    return network_cache(bind if isinstance(bind, Engine) else bind.engine)


def expected_ruleset_sha256(d: NodeDesired) -> str | None:
    """The SHA-256 of the nftables ruleset the node's agent must be running for ``d``."""
    return render_support.expected_ruleset_sha256(d)


def load_index(session: Session) -> NetworkIndex:
    """Every node with underlay facts, every active segment, the tenants' policies and every
    endpoint on such a node, from the database (what the cached index is kept equal to)."""
    nodes = [
        NodeNet(name, vtep, dev, tuple(guids or ()))
        for name, vtep, dev, guids in session.execute(
            select(NodeRow.name, NodeNetworkRow.vtep, NodeNetworkRow.underlay_dev,
                   NodeNetworkRow.hca_guids).join(NodeRow, NodeRow.id == NodeNetworkRow.node_id)
        )
    ]  # fmt: skip
    segments = [
        Segment(t, v, p, endpoint_key(t, w) if w is not None else None)
        for t, v, p, w in session.execute(
            select(SegmentRow.tenant, SegmentRow.vni, SegmentRow.pkey, SegmentRow.workload).where(
                SegmentRow.state == ACTIVE
            )
        )
    ]
    policies = {
        name: tenant_policy(name, profile)
        for name, profile in session.execute(
            select(TenantRow.name, TenantRow.profile).where(TenantRow.deleted_at.is_(None))
        )
        if (profile or {}).get("network_policy") is not None
    }
    index = NetworkIndex(nodes, segments, policies)
    names = set(index.nodes)
    for key, tenant, node, vni, ip, mac in session.execute(
        select(EndpointRow.key, EndpointRow.tenant, EndpointRow.node, EndpointRow.vni,
               EndpointRow.ip, EndpointRow.mac).where(EndpointRow.node.is_not(None))
    ):  # fmt: skip
        if node in names and vni in index.segments:
            place_endpoints(index, [Endpoint(key, tenant, node, vni, ip, mac)])
    return index


def place_endpoints(index: NetworkIndex, endpoints: list[Endpoint]) -> frozenset[str]:
    """``index.place``, one endpoint at a time: one the index refuses is left out (logged), the
    others still count; a placement never fails over its network state."""
    affected: set[str] = set()
    for ep in endpoints:
        try:
            affected |= index.place([ep])
        except ProofplaneError as exc:
            log.warning("network: endpoint %s left out of the desired state: %s", ep, exc.message)
    return frozenset(affected)


def _apply(index: NetworkIndex, st: _NetTx, changes: Mapping[str, _Ep | None]) -> set[str]:
    """This transaction's changes, applied to the index; the nodes they affect."""
    affected: set[str] = set()
    for seg in st.new_segments:
        index.add_segment(seg)
    for tenant, policy in st.policies.items():
        affected |= index.set_policy(tenant, policy)
    gone = [k for k, e in changes.items() if e is None or e.node not in index.nodes]
    affected |= index.remove(gone)
    here = [
        Endpoint(e.key, e.tenant, e.node, e.vni, e.ip, e.mac)
        for e in changes.values()
        if e is not None
        and e.node is not None
        and e.node in index.nodes
        and e.vni in index.segments
    ]
    affected |= place_endpoints(index, here)
    for vni in st.released:
        if vni in index.segments and not index.nodes_of(vni):
            index.remove_segment(vni)
    return affected


def _sync_desired(tx: Tx, st: _NetTx, changes: Mapping[str, _Ep | None]) -> None:
    session = tx.session
    cache = _cache_for(session)
    index = st.index
    followed: frozenset[str] = frozenset()
    found = None
    checked = False
    if index is None and not st.rebuild and cache.index is not None and cache.index.nodes:
        # A cached index with nodes that is current (at the newest event before this
        # transaction's): those nodes have underlay facts, there is a desired state to keep.
        found, checked = cache.usable(session, _base_seq(tx)), True
    if index is None and found is None:
        if session.scalar(select(NodeNetworkRow.node_id).limit(1)) is None:
            return  # no node has underlay facts: there is no desired state to keep
        if not st.rebuild and not checked:
            found = cache.usable(session, _base_seq(tx))
    if found is not None:
        index, followed = found
        cache.hits += 1
    affected: set[str] | None = None
    if index is not None and not st.rebuild:
        try:
            affected = _apply(index, st, changes) | followed
        except ProofplaneError:
            log.warning("network: the cached index could not follow; recomputing", exc_info=True)
            affected = None
    if affected is None:
        cache.loads += 1
        if index is cache.index:
            cache.drop()
        index = load_index(session)
        affected = set(index.nodes)
    assert index is not None
    _bump(tx, st, index, affected)
    st.index = index
    if not st.listening:
        st.listening = True
        _listen(tx, cache, st)


def _base_seq(tx: Tx) -> int:
    """The newest event before this transaction wrote any (what a reusable cache is at)."""
    return tx.base_seq if tx.base_seq is not None else tx.newest_seq()


def _listen(tx: Tx, cache: NetworkCache, st: _NetTx) -> None:
    session = tx.session
    pending: list[int | None] = [None]

    def before_commit(_s: Session) -> None:
        pending[0] = tx.last_seq

    def after_commit(_s: Session) -> None:
        if st.index is not None and pending[0] is not None:
            cache.index, cache.version = st.index, pending[0]

    def after_rollback(_s: Session) -> None:
        if cache.index is st.index:
            cache.drop()

    sa_event.listen(session, "before_commit", before_commit)
    sa_event.listen(session, "after_commit", after_commit)
    sa_event.listen(session, "after_rollback", after_rollback)


_NN = NodeNetworkRow.__table__.c
# What a new generation is computed from, per node, as columns (no ORM row: issue 20); the
# columns ``note_drift`` reads are among them.
_NODE_NETWORK_OF = (
    select(
        _NN.node_id, NodeRow.__table__.c.name, _NN.desired_generation, _NN.desired_sha256,
        _NN.segment_since, _NN.reported_at, _NN.applied_generation, _NN.applied_sha256,
        _NN.ruleset_sha256, _NN.self_check,
    )
    .join_from(NodeNetworkRow.__table__, NodeRow.__table__,
               NodeRow.__table__.c.id == _NN.node_id)
    .where(NodeRow.__table__.c.name.in_(bindparam("names", expanding=True)))
)  # fmt: skip
_NETWORK_TABLE = NodeNetworkRow.__table__
# A new generation's columns, for every bumped node in one executemany UPDATE: Core, not the
# ORM's flush (whose unit of work cost more than the statement), the loaded rows told the
# values they now hold (``set_committed_value``: nothing left for a flush to write).
_GENERATION_COLUMNS = (
    "segment_since", "desired_generation", "desired_sha256", "expected_ruleset_sha256", "drift",
    "updated_at",
)  # fmt: skip
_BUMP_ROWS = (
    update(_NETWORK_TABLE)
    .where(_NETWORK_TABLE.c.node_id == bindparam("b_node_id"))
    .values({c: bindparam(f"b_{c}") for c in _GENERATION_COLUMNS})
)


def _bump(tx: Tx, st: _NetTx, index: NetworkIndex, affected: Iterable[str]) -> None:
    """Give each affected node whose desired SHA-256 changed the next generation (and record
    which segments each generation brought); one ``network.desired`` event for them all.
    Everything is computed before the first row changes: a refusal leaves no node half-done."""
    names = sorted(n for n in affected if n in index.nodes)
    session = tx.session
    session.flush()  # nothing of these rows pending: the values read below are the stored ones
    updates: list[tuple[Any, NodeDesired, str | None]] = []
    for at in range(0, len(names), _IN_CHUNK):
        rows = session.connection().execute(_NODE_NETWORK_OF, {"names": names[at : at + _IN_CHUNK]})
        for row in rows:
            d = index.desired(row.name)
            if d.sha256 != row.desired_sha256:
                updates.append((row, d, expected_ruleset_sha256(d)))
    changed: dict[str, dict[str, Any]] = {}
    params: list[dict[str, Any]] = []
    for row, d, ruleset in updates:
        generation = row.desired_generation + 1
        since = dict(row.segment_since or {})
        values: dict[str, Any] = {
            "segment_since": {str(s.vni): int(since.get(str(s.vni), generation))
                              for s in d.segments},
            "desired_generation": generation,
            "desired_sha256": d.sha256,
            "expected_ruleset_sha256": ruleset,
            "updated_at": tx.now,
        }  # fmt: skip
        # the drift from the new desired state and the node's last report
        values["drift"] = note_drift(SimpleNamespace(**{**row._asdict(), **values}))
        loaded = session.identity_map.get(identity_key(NodeNetworkRow, row.node_id))
        if loaded is not None:  # a row this transaction holds as an object: told, not stale
            for column, value in values.items():
                set_committed_value(loaded, column, value)
        params.append({"b_node_id": row.node_id, **{f"b_{c}": v for c, v in values.items()}})
        changed[d.node] = {
            "generation": generation,
            "sha256": d.sha256,
            "segments": [s.vni for s in d.segments],
        }
    if changed:
        session.connection().execute(_BUMP_ROWS, params)
        st.events.append(NewEvent("network.desired", "network", "desired", {"nodes": changed}))


def _finish(tx: Tx) -> None:
    st = _state(tx)
    if st.idle():
        return
    st.events.clear()
    changes, _ = _sync_endpoints(tx, st)
    try:
        _sync_desired(tx, st, changes)  # writes nothing before it has computed everything
    except ProofplaneError as exc:
        # The work this transaction placed stands; the nodes keep their last desired state
        # until the next change recomputes it, and the audit log says why.
        log.exception("network: the desired state could not be recomputed")
        _cache_for(tx.session).drop()
        st.index = None
        failure = {"error": exc.code, "message": exc.message}
        st.events.append(
            NewEvent("network.desired", "network", "desired", failure, Outcome.FAILURE)
        )
    tx.record_many(st.events)  # the endpoints' events, then the desired state's
    st.events.clear()
    st.reset()


# --- readiness for placement ---------------------------------------------------------------------


def drift_reasons(row: Any) -> list[str]:
    """Why a node's network is not as desired ([] for one in line, or not yet reporting):
    ``generation_lag`` (it applied an older generation), ``sha256_mismatch`` (what it applied is
    not the desired state), ``ruleset_mismatch`` (at the current state, its ruleset is not the
    expected one), ``self_check_failed``."""
    if row.reported_at is None:
        return []
    out = []
    applied = row.applied_generation or 0
    if applied < row.desired_generation:
        out.append("generation_lag")
    elif row.applied_sha256 != row.desired_sha256:
        out.append("sha256_mismatch")
    elif row.expected_ruleset_sha256 is not None and row.ruleset_sha256 != (
        row.expected_ruleset_sha256
    ):
        out.append("ruleset_mismatch")
    if not (row.self_check or {}).get("ok", False):
        out.append("self_check_failed")
    return out


def note_drift(row: Any) -> bool | None:
    """The ``drift`` column's value for the row as it stands (None: never reported). ``row``
    here and in ``drift_reasons``: a ``NodeNetworkRow``, or anything with its columns by name
    (a Core row, a namespace)."""
    return None if row.reported_at is None else bool(drift_reasons(row))


BLOCKS_ALL = frozenset({"ruleset_mismatch", "self_check_failed"})


@dataclass(frozen=True, slots=True)
class Readiness:
    """Which managed nodes may not take new work of which segment (see the module docstring)."""

    blocked_all: frozenset[str]
    by_vni: Mapping[int, frozenset[str]]
    tenant_vni: Mapping[str, int]
    workload_vni: Mapping[int, int]
    per_workload: frozenset[str] = frozenset()  # tenants whose new work gets its own segment

    def unready(self, tenant: str, workload_id: Any) -> frozenset[str]:
        vni = self.workload_vni.get(workload_id) if isinstance(workload_id, int) else None
        if vni is None and tenant in self.per_workload:
            return self.blocked_all  # a segment allocated since: no node carries it yet
        if vni is None:
            vni = self.tenant_vni.get(tenant)
        blocked = self.by_vni.get(vni, frozenset()) if vni is not None else frozenset()
        return self.blocked_all | blocked


# The reporting nodes that may block anything, as columns (no ORM row). Only a drifted node
# can: a segment brought at a generation the node has not applied is a generation lag, and a
# ruleset mismatch or a failed self-check is drift too, while a node in line with its desired
# state blocks nothing. The ``drift`` column is kept equal to ``note_drift`` by every write of
# what it derives from (a report, a new desired generation), so a placement reads the few
# nodes behind their desired state, not every node under network management (issue 20).
_DRIFTED = (
    select(
        NodeRow.__table__.c.name, _NN.reported_at, _NN.applied_generation,
        _NN.desired_generation, _NN.applied_sha256, _NN.desired_sha256,
        _NN.expected_ruleset_sha256, _NN.ruleset_sha256, _NN.self_check, _NN.segment_since,
    )
    .join_from(NodeNetworkRow.__table__, NodeRow.__table__,
               NodeRow.__table__.c.id == _NN.node_id)
    .where(_NN.reported_at.is_not(None), _NN.drift.is_(True))
)  # fmt: skip


def load_readiness(session: Session) -> Readiness | None:
    """The readiness of the nodes under network management; None when none may block anything
    (the common case: then placement filters nothing)."""
    session.flush()  # this transaction's reports and generations, as a query would see them
    rows = session.connection().execute(_DRIFTED).all()
    if not rows:
        return None
    blocked_all: set[str] = set()
    by_vni: dict[int, set[str]] = {}
    for row in rows:  # a Row has the columns drift_reasons reads, by name
        name = row.name
        if BLOCKS_ALL & set(drift_reasons(row)):
            blocked_all.add(name)
        applied = row.applied_generation or 0
        for text, since in (row.segment_since or {}).items():
            if int(since) > applied:
                by_vni.setdefault(int(text), set()).add(name)
    tenant_vni: dict[str, int] = {}
    workload_vni: dict[int, int] = {}
    for tenant, wid, seg_vni in session.execute(
        select(SegmentRow.tenant, SegmentRow.workload_id, SegmentRow.vni).where(
            SegmentRow.state == ACTIVE
        )
    ):
        if wid is None:
            tenant_vni[tenant] = seg_vni
        else:
            workload_vni[wid] = seg_vni
    per_workload = frozenset(
        name
        for name, profile in session.execute(
            select(TenantRow.name, TenantRow.profile).where(TenantRow.deleted_at.is_(None))
        )
        if is_per_workload(profile or {})
    )
    return Readiness(
        frozenset(blocked_all),
        {v: frozenset(n) for v, n in by_vni.items()},
        tenant_vni,
        workload_vni,
        per_workload,
    )
