"""Roles and what they may do: the one table the README documents and ``authorize`` enforces.

Global roles act on every tenant. Scoped roles act only on the tenants the identity is bound
to; another tenant's objects do not exist for them (404, never 403, so tenants cannot probe
each other).
"""

from __future__ import annotations

from enum import StrEnum


class Permission(StrEnum):
    NODES_READ = "nodes:read"
    NODES_WRITE = "nodes:write"  # register, update, state changes (cordon, quarantine, fail)
    CERTIFY = "nodes:certify"  # grant and revoke certifications
    AGENT_CREDENTIALS = "nodes:agent-credentials"  # issue node-agent credentials
    TENANTS_READ = "tenants:read"
    TENANTS_WRITE = "tenants:write"  # create tenants, change compliance profiles
    WORKLOADS_READ = "workloads:read"
    WORKLOADS_WRITE = "workloads:write"  # submit, cancel
    EVENTS_READ = "events:read"
    USERS_READ = "users:read"
    USERS_WRITE = "users:write"  # create users, change roles/tenants, unlock, disable
    TOKENS_READ_ALL = "tokens:read-all"  # list every identity's tokens
    TOKENS_REVOKE_ALL = "tokens:revoke-all"  # revoke any identity's tokens
    QUOTAS_WRITE = "tenants:quotas"  # set a tenant's GPU / MIG-slice quotas
    AUDIT_READ = "audit:read"  # audit entries, checkpoints, proofs, bundles
    AUDIT_CHECKPOINT = "audit:checkpoint"  # sign a checkpoint now
    SINKS_READ = "sinks:read"  # SIEM export sinks and their cursors
    SINKS_WRITE = "sinks:write"  # configure SIEM export sinks
    ATTEST_POLICY_WRITE = "attest:policy-write"  # set node attestation policies (admin only)
    KEYS_READ = "keys:read"  # the KMS key inventory: versions, what each protects, use counts
    KEYS_WRITE = "keys:write"  # create, rotate, rewrap, disable, enable KMS keys (admin only)
    CHANGES_READ = "changes:read"  # change requests, their approvals, the change register
    CHANGES_APPROVE = "changes:approve"  # approve or deny change requests (rules say whose)
    METRICS_READ = "metrics:read"  # scrape /metrics: fleet usage per tenant and pool, health


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    DEVELOPER = "developer"
    TENANT_ADMIN = "tenant-admin"
    AUDITOR = "auditor"
    # reads everything, approves or denies changes; applies nothing, changes nothing else
    SECURITY_OFFICER = "security-officer"
    # a Prometheus server's identity: scrapes /metrics and nothing else (least privilege: the
    # bearer token sits in a scrape configuration, so it must not be an operator's)
    MONITORING = "monitoring"


P = Permission
ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.ADMIN: frozenset(Permission),
    Role.OPERATOR: frozenset(
        {
            P.NODES_READ,
            P.NODES_WRITE,
            P.AGENT_CREDENTIALS,
            P.TENANTS_READ,
            P.WORKLOADS_READ,
            P.EVENTS_READ,
            P.AUDIT_READ,
            P.AUDIT_CHECKPOINT,
            P.SINKS_READ,
            P.SINKS_WRITE,
            P.KEYS_READ,
            P.CHANGES_READ,
            P.METRICS_READ,
        }
    ),
    Role.DEVELOPER: frozenset({P.NODES_READ, P.TENANTS_READ, P.WORKLOADS_READ, P.WORKLOADS_WRITE}),
    Role.TENANT_ADMIN: frozenset(
        {
            P.NODES_READ,
            P.TENANTS_READ,
            P.WORKLOADS_READ,
            P.WORKLOADS_WRITE,
            P.USERS_READ,
            P.USERS_WRITE,
            P.QUOTAS_WRITE,
            P.CHANGES_READ,
            P.CHANGES_APPROVE,  # only changes scoped to its own tenants (govern.changes)
        }
    ),
    Role.AUDITOR: frozenset(
        {
            P.NODES_READ,
            P.TENANTS_READ,
            P.WORKLOADS_READ,
            P.EVENTS_READ,
            P.USERS_READ,
            P.TOKENS_READ_ALL,
            P.AUDIT_READ,
            P.SINKS_READ,
            P.KEYS_READ,
            P.CHANGES_READ,
            P.METRICS_READ,
        }
    ),
    Role.SECURITY_OFFICER: frozenset(
        {
            P.NODES_READ,
            P.TENANTS_READ,
            P.WORKLOADS_READ,
            P.EVENTS_READ,
            P.USERS_READ,
            P.TOKENS_READ_ALL,
            P.AUDIT_READ,
            P.SINKS_READ,
            P.KEYS_READ,
            P.CHANGES_READ,
            P.CHANGES_APPROVE,
            P.METRICS_READ,
        }
    ),
    Role.MONITORING: frozenset({P.METRICS_READ}),
}
GLOBAL_ROLES = frozenset(
    {Role.ADMIN, Role.OPERATOR, Role.AUDITOR, Role.SECURITY_OFFICER, Role.MONITORING}
)
SCOPED_ROLES = frozenset({Role.DEVELOPER, Role.TENANT_ADMIN})
# Roles whose holders must log in with a second factor (TOTP). ``monitoring`` is a machine's
# role (an API token in a scrape configuration, never a password login in practice) whose one
# permission reads aggregate metrics.
MFA_REQUIRED = frozenset(
    {Role.ADMIN, Role.OPERATOR, Role.TENANT_ADMIN, Role.AUDITOR, Role.SECURITY_OFFICER}
)
# What a tenant-admin may hand out, and only within their own tenants.
DELEGABLE_BY_TENANT_ADMIN = frozenset({Role.DEVELOPER, Role.TENANT_ADMIN})
