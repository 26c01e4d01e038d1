"""Tenants and their compliance profiles."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, ValidationFailed
from proofplane.model import (
    ComplianceProfile,
    Quota,
    Tenant,
    WorkloadStatus,
    validate_name,
    validate_tags,
)
from proofplane.model.tenant import profile_to_json
from proofplane.service import execution, netstate, network
from proofplane.service.context import Store, Tx
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_text_cursor,
    paginate,
)
from proofplane.service.scheduling import ClusterView, reschedule_pending
from proofplane.store.repo import tenant_from_row, tenant_row
from proofplane.store.tables import SegmentRow, TenantRow, WorkloadRow


def validate_profile(profile: ComplianceProfile) -> ComplianceProfile:
    validate_tags(profile.required_tags, field="required_tags")
    bad = [rule for rule in profile.isolation_rules if "=" not in rule]
    if bad:
        raise ValidationFailed(
            "isolation_rules keys must be key=value tags",
            code="invalid_tag",
            details={"isolation_rules": bad},
        )
    validate_tags(
        dict(rule.split("=", 1) for rule in profile.isolation_rules), field="isolation_rules"
    )
    return profile


def create_tenant(
    store: Store,
    actor: Actor,
    tenant: Tenant,
    *,
    vni: int | None = None,
    pkey: int | None = None,
) -> Tenant:
    """Create a tenant and its network segment (a VXLAN VNI and an InfiniBand PKey from the
    pools, or ``vni``/``pkey`` as given), in one transaction. Pools exhausted: 409
    ``segment_pool_exhausted``, nothing created, the exhaustion recorded on its own."""
    authorize(actor, Permission.TENANTS_WRITE, tenant=tenant.name)
    validate_name(tenant.name, "tenant")
    validate_profile(tenant.profile)
    with netstate.exhaustion_recorded(store, actor, tenant.name, None), store.write(actor) as tx:
        return insert_tenant(tx, tenant, vni=vni, pkey=pkey)


def insert_tenant(
    tx: Tx, tenant: Tenant, *, vni: int | None = None, pkey: int | None = None
) -> Tenant:
    existing = tx.session.scalar(select(TenantRow).where(TenantRow.name == tenant.name))
    if existing is not None:
        if existing.deleted_at is not None:
            raise Conflict(
                f"tenant name {tenant.name!r} belonged to a deleted tenant and is not used again",
                code="tenant_name_retired",
                details={"tenant": tenant.name, "deleted_at": existing.deleted_at.isoformat()},
            )
        raise Conflict(f"tenant {tenant.name!r} already exists", details={"tenant": tenant.name})
    profile = replace(
        tenant.profile,
        network_policy=network.check_policy(tx.session, tenant.name, tenant.profile.network_policy),
    )
    row = TenantRow(
        name=tenant.name,
        description=tenant.description,
        profile=profile_to_json(profile),
        created_at=tx.now,
        updated_at=tx.now,
    )
    tx.session.add(row)
    tx.session.flush()
    tx.record(
        "tenant.create",
        "tenant",
        tenant.name,
        details={"profile": row.profile, "description": tenant.description},
    )
    netstate.allocate_segment(tx, tenant.name, vni=vni, pkey=pkey)
    if profile.network_policy is not None:  # the nodes' desired state knows it from the start
        netstate.policy_changed(tx, tenant.name, netstate.tenant_policy(tenant.name, row.profile))
    return tenant_from_row(row)


def update_tenant(
    store: Store,
    actor: Actor,
    name: str,
    *,
    description: str | None = None,
    profile: ComplianceProfile | None = None,
) -> Tenant:
    """Change a tenant's description or profile. A new profile applies to new submissions."""
    authorize(actor, Permission.TENANTS_WRITE, tenant=name)
    if profile is not None:
        validate_profile(profile)
    with store.write(actor) as tx:
        row = tenant_row(tx.session, name)
        before = tenant_from_row(row)
        if profile is not None:
            # A profile without a network policy keeps the tenant's (network.policy changes
            # it); one with a policy sets it, checked as network.policy checks it.
            policy = profile.network_policy
            if policy is None:
                policy = before.profile.network_policy
            elif policy != before.profile.network_policy:
                policy = network.check_policy(tx.session, name, policy)
                network.check_subnet(tx.session, name, policy)
            profile = replace(profile, network_policy=policy)
        after = replace(
            before,
            description=before.description if description is None else description,
            profile=before.profile if profile is None else profile,
        )
        if after == before:
            return before
        row.description = after.description
        row.profile = profile_to_json(after.profile)
        row.updated_at = tx.now
        if after.profile.network_policy != before.profile.network_policy:
            policy_json = {"network_policy": after.profile.network_policy}
            netstate.policy_changed(tx, name, netstate.tenant_policy(name, policy_json))
        tx.record(
            "tenant.update",
            "tenant",
            name,
            details={
                "before": {
                    "description": before.description,
                    "profile": profile_to_json(before.profile),
                },
                "after": {"description": after.description, "profile": row.profile},
            },
        )
        return tenant_from_row(row)


def get_tenant(store: Store, actor: Actor, name: str) -> Tenant:
    authorize(actor, Permission.TENANTS_READ)
    authorize(actor, Permission.TENANTS_READ, tenant=name)
    with store.read() as session:
        return tenant_from_row(tenant_row(session, name))


def list_tenants(
    store: Store, actor: Actor, *, limit: int = 100, cursor: str | None = None
) -> Page[Tenant]:
    authorize(actor, Permission.TENANTS_READ)
    check_limit(limit)
    after = decode_text_cursor("tenants", cursor)
    query = (
        select(TenantRow)
        .where(TenantRow.deleted_at.is_(None))
        .order_by(TenantRow.name)
        .limit(limit + 1)
    )
    visible = actor.visible_tenants(Permission.TENANTS_READ)
    if visible is not None:
        query = query.where(TenantRow.name.in_(visible))
    if after is not None:
        query = query.where(TenantRow.name > after)
    with store.read() as session:
        rows = list(session.scalars(query))
        items = [tenant_from_row(r) for r in rows]
    return paginate("tenants", items, limit, rows[limit - 1].name if len(rows) > limit else None)


MAX_QUOTA = 1_000_000


def set_quota(store: Store, actor: Actor, name: str, quota: Quota) -> Tenant:
    """Set a tenant's GPU and MIG-slice quotas (None: no limit). Raising a quota offers the
    freed headroom to the tenant's waiting work at once; lowering one evicts nothing (running
    work keeps its capacity) but stops new placements beyond it (``quota_exceeded``)."""
    authorize(actor, Permission.QUOTAS_WRITE, tenant=name)
    for field_name, value in (("gpus", quota.gpus), ("mig_slices", quota.mig_slices)):
        if value is not None and not 0 <= value <= MAX_QUOTA:
            raise ValidationFailed(
                f"quota {field_name} must be between 0 and {MAX_QUOTA}, or null for no limit",
                code="invalid_quota",
                details={field_name: value},
            )
    with store.write(actor) as tx:
        row = tenant_row(tx.session, name)
        before = Quota(row.quota_gpus, row.quota_mig_slices)
        if before == quota:
            return tenant_from_row(row)
        row.quota_gpus = quota.gpus
        row.quota_mig_slices = quota.mig_slices
        row.updated_at = tx.now
        tx.session.flush()
        tx.record(
            "tenant.quota",
            "tenant",
            name,
            details={
                "before": {"gpus": before.gpus, "mig_slices": before.mig_slices},
                "after": {"gpus": quota.gpus, "mig_slices": quota.mig_slices},
            },
        )
        view = ClusterView(tx.session, from_cache=True)
        reschedule_pending(tx, view)
        execution.dispatch_new(tx, view)  # what the raised quota placed starts running now
        return tenant_from_row(row)


def delete_tenant(
    store: Store, actor: Actor, name: str, *, change_id: int | None = None
) -> dict[str, object]:
    """Delete a tenant that has no unfinished work (409 ``tenant_has_workloads`` otherwise):
    its segments are released into the cool-down (``PROOFPLANE_SEGMENT_COOLDOWN_DAYS``), its
    row stays with ``deleted_at`` (its name is never handed out again; its finished workloads
    and its events stay as they were). Governed (``tenant.delete``)."""
    authorize(actor, Permission.TENANTS_WRITE, tenant=name)
    with store.write(actor) as tx:
        row = tenant_row(tx.session, name)
        live = [
            w
            for w, status in tx.session.execute(
                select(WorkloadRow.name, WorkloadRow.status).where(WorkloadRow.tenant_id == row.id)
            )
            if not WorkloadStatus(status).is_terminal
        ]
        if live:
            raise Conflict(
                f"tenant {name!r} has {len(live)} unfinished workload(s): cancel them first",
                code="tenant_has_workloads",
                details={"tenant": name, "workloads": sorted(live)[:20], "count": len(live)},
            )
        row.deleted_at = tx.now
        row.updated_at = tx.now
        tx.session.flush()
        details: dict[str, object] = {"tenant": name}
        if change_id is not None:
            details["change_id"] = change_id
        tx.record("tenant.delete", "tenant", name, details=details)
        released = []
        for seg in tx.session.scalars(
            select(SegmentRow).where(SegmentRow.tenant == name, SegmentRow.state == netstate.ACTIVE)
        ):
            netstate.release_segment(tx, seg, f"tenant {name} deleted")
            released.append({"vni": seg.vni, "pkey": seg.pkey})
        return {"tenant": name, "deleted_at": tx.now.isoformat(), "released": released}
