"""What ``workloads explain`` says of MIG layouts (issue 17 §2): the instances the scheduler
carved, or the idle GPU it re-laid, to place a workload; or, for a MIG request that waits,
that carving (or re-laying) would place it now but ``PROOFPLANE_MIG_AUTO_LAYOUT`` turns it off.

A placement's layout changes are read back from the audit record: the placing transaction
recorded one ``node.gpu.repartition`` per GPU it changed (``for_workload``, ``step``:
``carve``, ``reclaim`` or ``repartition``, ``before``/``after``), at the placement's own time,
on the node it placed on. No new state is kept for it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane.config import MIG_AUTO_LAYOUT_ENV, mig_auto_layout
from proofplane.model import GpuRequest, WorkloadStatus
from proofplane.schedule.engine import Repartition
from proofplane.schedule.policy import CARVE, IDLE, OFF, RECLAIM, build_scheduler, server_policy
from proofplane.schedule.reasons import DEFRAGMENTATION
from proofplane.service.scheduling import ClusterView, job_of, placement_scorer
from proofplane.store.repo import placement_from_row
from proofplane.store.tables import EventRow, WorkloadRow

REPARTITION_ACTION = "node.gpu.repartition"
#: the ``step`` values of ``node.gpu.repartition`` each mode turns off
DISABLED_STEPS: dict[str, frozenset[str]] = {
    CARVE: frozenset(),  # the trial below places as "on" does: it never reclaims
    RECLAIM: frozenset(),
    IDLE: frozenset({"carve", "reclaim"}),
    OFF: frozenset({"carve", "reclaim", "repartition"}),
}


def mig_layout(
    session: Session, row: WorkloadRow, view: ClusterView | None, unready: frozenset[str]
) -> dict[str, Any] | None:
    """The ``mig_layout`` field of an explanation, or None when no MIG layout changed for the
    workload's placement (and, waiting, none would place it). ``view``: the cluster as it
    stands now (None for a finished workload)."""
    mode = mig_auto_layout()
    if row.placement is not None:
        changes = placed_changes(session, row)
        if not changes:
            return None
        placement = placement_from_row(row.placement)
        return {
            "auto_layout": mode,
            "changes": changes,
            "instances": [
                {
                    "node": part.node,
                    "gpu_index": d.gpu_index,
                    "profile": d.mig_profile,
                    "start": d.mig_start,
                }
                for part in placement.parts
                for d in part.devices
                if d.mig_profile is not None
            ],  # fmt: skip
        }
    if view is None or row.status != WorkloadStatus.PENDING.value:
        return None
    return disabled_layout(row, view, unready, mode)


def placed_changes(session: Session, row: WorkloadRow) -> list[dict[str, Any]]:
    """The GPUs whose MIG layout the placing transaction changed for ``row``, in order."""
    assert row.placement is not None
    nodes = list(placement_from_row(row.placement).nodes)
    by = f"{row.tenant.name}/{row.name}"
    found = session.execute(
        select(EventRow.target_id, EventRow.details)
        .where(
            EventRow.target_type == "node",
            EventRow.target_id.in_(nodes),
            EventRow.action == REPARTITION_ACTION,
            EventRow.ts == row.placement.placed_at,
        )
        .order_by(EventRow.seq)
    )
    out = []
    for node, d in found:
        if d.get("for_workload") != by:
            continue
        before, after = list(d.get("before") or []), list(d.get("after") or [])
        out.append(
            {
                "node": node,
                "gpu_index": d.get("gpu_index"),
                "step": d.get("step"),
                "carved": [i for i in after if i not in before],
                "before": before,
                "after": after,
                "why": d.get("why"),
                # the GPU defragmentation freed for it (its work moved), not an idle one
                "freed_by_defragmentation": str(d.get("why") or "").startswith(DEFRAGMENTATION),
            }
        )
    return out


def disabled_layout(
    row: WorkloadRow, view: ClusterView, unready: frozenset[str], mode: str
) -> dict[str, Any] | None:
    """For a waiting single-node MIG request under ``PROOFPLANE_MIG_AUTO_LAYOUT`` ``idle`` or
    ``off``: the layout change the default (``on``) would place it with now, on a copy of the
    cluster (nothing changes), when that step is one ``mode`` turns off; else None."""
    g = GpuRequest.from_row(row)
    off = DISABLED_STEPS.get(mode, frozenset())
    if g.mig_profile is None or g.nodes > 1 or not off:
        return None
    now = view.scheduler
    trial = build_scheduler(
        server_policy(placement_scorer(), CARVE), now.nodes(), now.held.values(), now.quotas
    )
    out = trial.schedule(job_of(row), preempt=False, unready=unready)
    changes = [c for c in out.repartitions if c.step in off]
    if out.placement is None or not changes:
        return None
    what = "; ".join(_said(c) for c in changes)
    return {
        "auto_layout": mode,
        "disabled": sorted({c.step for c in changes}),
        "would_place_on": out.placement.node,
        "would": [
            {
                "node": c.node,
                "gpu_index": c.gpu_index,
                "step": c.step,
                "before": [f"{i.profile}@{i.start}" for i in c.before],
                "after": [f"{i.profile}@{i.start}" for i in c.after],
            }
            for c in changes
        ],  # fmt: skip
        "message": f"it would be placed now on {out.placement.node} by {what}, which "
        f"{MIG_AUTO_LAYOUT_ENV}={mode} turns off",
    }


def _said(c: Repartition) -> str:
    if c.step == "carve":
        new = [f"{i.profile}@{i.start}" for i in c.after if i not in c.before]
        return f"carving {', '.join(new)} on {c.node} GPU {c.gpu_index}"
    if c.step == "reclaim":
        return f"reclaiming idle instances of {c.node} GPU {c.gpu_index}"
    return f"re-laying idle {c.node} GPU {c.gpu_index}"
