"""Explanations: why a workload is where it is, or why it waits (rule 8: every "no" explains
itself).

``explain_job`` evaluates a job against every node as the cluster stands now, with the job's
own capacity counted as free (so a placed workload is judged as if it were being placed again):
each node is either rejected by the first filter that fails, in the pipeline's order
(``node_not_admitted``, ``missing_certification``, ``network_not_applied``, tenancy,
``gpu_model_unavailable``, ``insufficient_gpu_capacity``), or is a candidate with its
score: with a scoring plugin (``schedule.scoring``, the server's) its key, ranked as the plugin
places; without one the best-fit score (idle GPUs left on the node after placing: fewer is
better); ties broken by node name. The quota PreFilter is
reported on its own; a gang's topology request (``schedule.topology``) too: how it would be
packed now, whether one domain holds it, the domains its placement spans. Pure: it reads the
scheduler and leaves it as it found it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Set as AbstractSet
from typing import Any

from proofplane.model import NodeState, missing_tags
from proofplane.schedule.engine import Held, Job, Scheduler, member_request
from proofplane.schedule.quota import Cost
from proofplane.schedule.reasons import (
    INSUFFICIENT_GPU_CAPACITY,
    NETWORK_NOT_APPLIED,
    QUOTA_EXCEEDED,
)
from proofplane.schedule.reference import reference_place
from proofplane.schedule.topology import domains_of, place_gang

MAX_CANDIDATES = 5


def explain_job(
    scheduler: Scheduler,
    job: Job,
    placed_on: tuple[str, ...] = (),
    unready: AbstractSet[str] = frozenset(),
) -> dict[str, Any]:
    """Per-filter rejection counts, the best candidate nodes with their scores, and the quota
    check for ``job`` (see the module docstring). ``placed_on``: the nodes the job holds now,
    whose rank among the candidates is reported under ``placed_on``. ``unready``: nodes that
    have not applied the job's network segment (``Scheduler.schedule``'s)."""
    own: Held | None = scheduler.release(job.key)
    try:
        out = _explain(scheduler, job, unready)
        ranked = out.pop("_ranked")
        out["placed_on"] = [
            {"node": name, **ranked.get(name, {"rank": None, "idle_gpus_after": None})}
            for name in placed_on
        ]
        topo = job.request.topology
        if topo is not None and job.request.gpus.nodes > 1:
            out["topology"] = _topology(scheduler, job, placed_on)
        return out
    finally:
        if own is not None:
            scheduler.hold(own)


def _explain(scheduler: Scheduler, job: Job, unready: AbstractSet[str]) -> dict[str, Any]:
    req = member_request(job.request)
    snap = scheduler.snapshot
    allocs = snap.allocations
    filters: Counter[str] = Counter()
    candidates: list[tuple[int, str]] = []
    for node in snap.nodes():
        if (
            node.name in unready
            and node.state is NodeState.ADMITTED
            and not missing_tags(req.tags, node.certifications)
        ):
            filters[NETWORK_NOT_APPLIED] += 1
            continue
        on_node = [allocs[k] for k in snap.allocations_on(node.name)]
        d = reference_place(req, [node], on_node)
        if d.placement is None:
            code = next(iter(d.rejections), INSUFFICIENT_GPU_CAPACITY)
            filters[code] += 1
            continue
        busy = {dev.gpu_index for a in on_node for dev in a.placement.devices}
        taken = {dev.gpu_index for dev in d.placement.devices}
        idle_after = sum(1 for g in node.gpus if g.index not in busy and g.index not in taken)
        candidates.append((idle_after, node.name))
    scorer = snap.scorer
    keys: dict[str, object] = {}
    if scorer is not None:
        # the scoring plugin ranks the candidates as it places them: its key, then the name
        for _idle, name in candidates:
            keys[name] = snap.score_key(name, req)
        candidates.sort(key=lambda c: (keys[c[1]] is None, _sortable(keys[c[1]]), c[1]))
    else:
        candidates.sort()
    tenant = job.request.tenant
    quota = scheduler.quotas.get(tenant)
    used = scheduler.used(tenant)
    over = scheduler.quota_excess(tenant, job.request.gpus)
    out: dict[str, Any] = {
        "nodes_total": len(snap),
        "filters": dict(sorted(filters.items())),
        "candidates": [
            {"node": name, "idle_gpus_after": idle, "rank": rank}
            | ({"score_key": _jsonable(keys.get(name))} if scorer is not None else {})
            for rank, (idle, name) in enumerate(candidates[:MAX_CANDIDATES], start=1)
        ],
        "candidates_total": len(candidates),
        "_ranked": {
            name: {"rank": rank, "idle_gpus_after": idle}
            for rank, (idle, name) in enumerate(candidates, start=1)
        },
        "score": (
            f"{scorer.name}: the scoring plugin's key, smaller first (proofplane and fgd: minus "
            "trunc(100·σ(−ΔF/1000)), ΔF the growth of the node's expected fragmentation), then "
            "node name"
            if scorer is not None
            else "best fit: fewest idle GPUs left on the node after placing, then node name"
        ),
        "scorer": scorer.name if scorer is not None else None,
        "quota": {
            "limit": (
                {"gpus": quota.gpus, "mig_slices": quota.mig_slices} if quota is not None else None
            ),
            "used_without_this": _cost_json(used),
            "fits": over is None,
            "exceeded": over,
        },
        "pool": dict(sorted(job.request.tags.items())),
        "priority": job.priority,
    }
    if over is not None:
        out["filters"] = {QUOTA_EXCEEDED: len(snap), **out["filters"]}
    if job.request.gpus.nodes > 1:
        out["gang"] = {
            "nodes": job.request.gpus.nodes,
            "gpus_per_node": job.request.gpus.per_node,
            "enough_candidates": len(candidates) >= job.request.gpus.nodes,
        }
    return out


def _topology(scheduler: Scheduler, job: Job, placed_on: tuple[str, ...]) -> dict[str, Any]:
    """A gang's topology request judged now (``schedule.topology``): how it would be packed,
    whether one domain holds it, and the domains its placement spans."""
    topo = job.request.topology
    assert topo is not None
    found = place_gang(scheduler.snapshot, job.request)
    info = dict(found.info)
    info["satisfiable_now"] = found.placement is not None and info.get("domains_used") == 1
    info["would_place"] = found.message or None
    if placed_on:
        info["placed_domains"] = domains_of(scheduler.snapshot, placed_on, topo.level)
    return info


def _sortable(key: object) -> tuple[object, ...]:
    return key if isinstance(key, tuple) else (key,)


def _jsonable(key: object) -> object:
    return list(key) if isinstance(key, tuple) else key


def _cost_json(c: Cost) -> dict[str, float]:
    return {"gpus": c.gpu_milli / 1000, "mig_slices": c.mig_slices}
