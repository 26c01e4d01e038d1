"""Idle GPUs (issue 15): each tenant's idle policy, and the pass that applies it.

A workload holding its devices is idle when the highest ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` of
the devices it holds alone (whole GPUs, its MIG instances) stays below the policy's threshold
over the policy's window, with readings covering the window (``meter.idle``). A GPU share
(time-sliced fraction) has no reading of its own and is never judged.

The tenant's policy (``tenants.idle_policy``; none set: ``notify`` with the defaults):

* ``notify``: a ``workload.idle`` event with the evidence (peak, window, readings), at most once
  per window while it stays idle;
* ``reclaim``: for a preemptible workload (priority at most ``preemptible_priority``, default
  0), an eviction with reason ``idle_reclaimed`` (``workload.evict``); workloads have no
  restart policy, so it then ends (``workload.cancel``, status cancelled, reason
  ``idle_reclaimed``) and its capacity goes to pending work. Others are notified.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import ValidationFailed
from proofplane.meter import idle as core
from proofplane.model import WorkloadStatus
from proofplane.schedule.reasons import IDLE_RECLAIMED, render
from proofplane.service import execution
from proofplane.service.context import Store
from proofplane.service.scheduling import ClusterView, evict, reschedule_pending
from proofplane.service.telemetry import utilisation_summary
from proofplane.store.repo import WORKLOAD_LOAD, tenant_row
from proofplane.store.tables import EventRow, PlacementRow, TenantRow, WorkloadRow

ACTIONS = ("notify", "reclaim")


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    action: str = "notify"
    window_s: float = core.WINDOW.total_seconds()
    threshold: float = core.THRESHOLD
    preemptible_priority: int = 0

    @property
    def window(self) -> timedelta:
        return timedelta(seconds=self.window_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "window_s": self.window_s,
            "threshold": self.threshold,
            "preemptible_priority": self.preemptible_priority,
        }


DEFAULT = IdlePolicy()


def parse_policy(data: Any) -> IdlePolicy:
    """A policy from its JSON form; ``invalid_idle_policy`` (422) when it is not one."""
    if not isinstance(data, dict):
        raise _bad("an idle policy is an object")
    unknown = set(data) - {"action", "window_s", "threshold", "preemptible_priority"}
    if unknown:
        raise _bad(f"unknown key(s) {sorted(unknown)}")
    action = data.get("action", DEFAULT.action)
    if action not in ACTIONS:
        raise _bad("action must be notify or reclaim")
    window = data.get("window_s", DEFAULT.window_s)
    if type(window) not in (int, float) or not 60 <= window <= 7 * 86400:
        raise _bad("window_s must be 60..604800 seconds")
    threshold = data.get("threshold", DEFAULT.threshold)
    if type(threshold) not in (int, float) or not 0 < threshold <= 1:
        raise _bad("threshold must be a ratio in (0, 1]")
    prio = data.get("preemptible_priority", DEFAULT.preemptible_priority)
    if type(prio) is not int or not -(2**31) <= prio < 2**31:
        raise _bad("preemptible_priority must be a whole number")
    return IdlePolicy(action, float(window), float(threshold), prio)


def _bad(message: str) -> ValidationFailed:
    return ValidationFailed(message, code="invalid_idle_policy")


def set_idle_policy(store: Store, actor: Actor, tenant: str, policy: Any) -> dict[str, Any]:
    """Set ``tenant``'s idle policy (``tenants:write`` on the tenant): ``tenant.idle_policy``."""
    authorize(actor, Permission.TENANTS_WRITE, tenant=tenant)
    parsed = parse_policy(policy)
    with store.write(actor) as tx:
        row = tenant_row(tx.session, tenant)
        before = row.idle_policy
        row.idle_policy = parsed.as_dict()
        row.updated_at = tx.now
        tx.session.flush()
        tx.record("tenant.idle_policy", "tenant", tenant,
                  details={"from": before, "to": parsed.as_dict()})  # fmt: skip
    return {"tenant": tenant, "idle_policy": parsed.as_dict()}


def get_idle_policy(store: Store, actor: Actor, tenant: str) -> dict[str, Any]:
    authorize(actor, Permission.TENANTS_READ, tenant=tenant)
    with store.read() as session:
        row = tenant_row(session, tenant)
        policy = parse_policy(row.idle_policy) if row.idle_policy else DEFAULT
        return {"tenant": tenant, "idle_policy": policy.as_dict(), "default": not row.idle_policy}


def check_idle(store: Store, actor: Actor, now: datetime) -> list[dict[str, Any]]:
    """One pass: judge every placed workload under its tenant's policy, notify or reclaim.
    Returns what it did, one dict per workload acted on."""
    with store.read() as session:
        policies = {
            name: parse_policy(p) if p else DEFAULT
            for name, p in session.execute(select(TenantRow.name, TenantRow.idle_policy))
        }
        held = session.execute(
            select(WorkloadRow.name, TenantRow.name, WorkloadRow.priority, PlacementRow.placed_at)
            .join(TenantRow, TenantRow.id == WorkloadRow.tenant_id)
            .join(PlacementRow, PlacementRow.workload_id == WorkloadRow.id)
            .where(WorkloadRow.status.in_([WorkloadStatus.PLACED.value,
                                           WorkloadStatus.RUNNING.value]))
        ).all()  # fmt: skip
    if not held:
        return []
    windows = {policies.get(t, DEFAULT).window for _w, t, _p, _s in held}
    summaries = {w: utilisation_summary(store, now - w, now) for w in windows}
    longest = max(windows)
    with store.read() as session:
        notified: dict[tuple[str, str], datetime] = {}
        for target, ts, details in session.execute(
            select(EventRow.target_id, EventRow.ts, EventRow.details).where(
                EventRow.action == "workload.idle", EventRow.ts >= now - longest
            )
        ):
            key = (str((details or {}).get("tenant")), target)
            notified[key] = max(ts, notified.get(key, ts))
    done: list[dict[str, Any]] = []
    for workload, tenant, priority, placed_at in held:
        policy = policies.get(tenant, DEFAULT)
        summary = summaries[policy.window].get((tenant, workload))
        verdict = core.judge_summary(summary, now=now, held_since=placed_at,
                                     window=policy.window, threshold=policy.threshold)  # fmt: skip
        if not verdict.idle:
            continue
        evidence = {
            "tenant": tenant,
            "peak": verdict.peak,
            "readings": verdict.readings,
            "window_s": policy.window_s,
            "threshold": policy.threshold,
            "field": "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
            "policy": policy.action,
        }
        if policy.action == "reclaim" and priority <= policy.preemptible_priority:
            if _reclaim(store, actor, now, workload, tenant, placed_at, evidence, policy):
                done.append({"workload": workload, "action": "reclaimed", **evidence})
            continue
        last = notified.get((tenant, workload))
        if last is not None and last >= max(placed_at, now - policy.window):
            continue  # told once this window already
        with store.write(actor, now) as tx:
            tx.record("workload.idle", "workload", workload, details=evidence)
        done.append({"workload": workload, "action": "notified", **evidence})
    return done


def _reclaim(
    store: Store,
    actor: Actor,
    now: datetime,
    workload: str,
    tenant: str,
    placed_at: datetime,
    evidence: dict[str, Any],
    policy: IdlePolicy,
) -> bool:
    """Evict (``idle_reclaimed``) and end the workload, if it still holds the same placement."""
    with store.write(actor, now) as tx:
        row = tx.session.scalar(
            select(WorkloadRow)
            .join(TenantRow, TenantRow.id == WorkloadRow.tenant_id)
            .where(WorkloadRow.name == workload, TenantRow.name == tenant)
            .options(*WORKLOAD_LOAD)
        )
        if row is None or row.placement is None or row.placement.placed_at != placed_at:
            return False  # it moved or ended meanwhile: judged again next pass
        view = ClusterView(tx.session, from_cache=True)
        message = render(IDLE_RECLAIMED, peak=evidence["peak"], threshold=policy.threshold,
                         minutes=policy.window_s / 60, tenant=tenant)  # fmt: skip
        status = row.status
        evict(tx, row, view, IDLE_RECLAIMED, message)  # stops its engine job too
        row.status = WorkloadStatus.CANCELLED.value
        row.reason = IDLE_RECLAIMED
        row.reason_details = {"message": message, **evidence}
        row.updated_at = tx.now
        tx.session.flush()
        tx.record("workload.cancel", "workload", workload, details={
            **evidence, "from_status": WorkloadStatus.PENDING.value, "evicted_from": status,
            "reason": IDLE_RECLAIMED,
        })  # fmt: skip
        reschedule_pending(tx, view)
        execution.dispatch_new(tx, view)
    return True
