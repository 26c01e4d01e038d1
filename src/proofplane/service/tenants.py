"""Tenants and their compliance profiles."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, ValidationFailed
from proofplane.model import ComplianceProfile, Quota, Tenant, validate_name, validate_tags
from proofplane.model.tenant import profile_to_json
from proofplane.service import execution
from proofplane.service.context import Store, Tx
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_text_cursor,
    paginate,
)
from proofplane.service.scheduling import ClusterView, reschedule_pending
from proofplane.store.repo import tenant_from_row, tenant_row
from proofplane.store.tables import TenantRow


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


def create_tenant(store: Store, actor: Actor, tenant: Tenant) -> Tenant:
    authorize(actor, Permission.TENANTS_WRITE, tenant=tenant.name)
    validate_name(tenant.name, "tenant")
    validate_profile(tenant.profile)
    with store.write(actor) as tx:
        return insert_tenant(tx, tenant)


def insert_tenant(tx: Tx, tenant: Tenant) -> Tenant:
    if tx.session.scalar(select(TenantRow.id).where(TenantRow.name == tenant.name)):
        raise Conflict(f"tenant {tenant.name!r} already exists", details={"tenant": tenant.name})
    row = TenantRow(
        name=tenant.name,
        description=tenant.description,
        profile=profile_to_json(tenant.profile),
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
    query = select(TenantRow).order_by(TenantRow.name).limit(limit + 1)
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
        view = ClusterView(tx.session)
        reschedule_pending(tx, view)
        execution.dispatch_new(tx, view)  # what the raised quota placed starts running now
        return tenant_from_row(row)
