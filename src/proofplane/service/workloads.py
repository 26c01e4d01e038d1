"""Workloads: submit (validate against the tenant's profile, then place), inspect, cancel."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Select, and_, bindparam, delete, insert, or_, select, update
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, InvalidState, NotFound, ProofplaneError, ValidationFailed
from proofplane.hardware.skus import SKUS, canonical_model, get_sku
from proofplane.model import (
    TOPOLOGY_LEVELS,
    GpuRequest,
    IsolationLevel,
    Outcome,
    Placement,
    Tenant,
    TopologyMode,
    TopologyRequest,
    Workload,
    WorkloadStatus,
    validate_name,
    validate_tags,
)
from proofplane.model.tenant import PER_WORKLOAD
from proofplane.model.workload import (
    MAX_BATCH,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_COMMAND_CHARS,
    MAX_CPU_MILLI,
    MAX_MEMORY_MIB,
    MAX_SKU_CHARS,
)
from proofplane.schedule.engine import Job
from proofplane.schedule.explain import explain_job
from proofplane.schedule.reasons import CANCELLED, DEFRAGMENTATION, render
from proofplane.schedule.values import MODEL_SEPARATOR, Request
from proofplane.service import execution, jobs, mig_explain, netstate
from proofplane.service.context import NewEvent, Store, Tx
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_text_cursor,
    paginate,
)
from proofplane.service.scheduling import (
    ClusterView,
    apply_outcome,
    decide,
    decision_details,
    decision_fields,
    job_of,
    pending_jobs,
    placement_json,
    reschedule_pending,
    schedule,
)
from proofplane.store.repo import (
    WORKLOAD_LOAD,
    WorkloadColumns,
    devices_to_json,
    load_workload_targets,
    load_workloads,
    members_to_json,
    only_named,
    tenant_from_row,
    tenant_row,
    workload_from_row,
    workload_on_node,
    workload_row,
    workload_select,
    workload_target_select,
)
from proofplane.store.tables import (
    PlacementRow,
    TenantRow,
    WorkloadRow,
    placement_nodes,
)

WL = WorkloadColumns
MAX_GPUS = 64  # per node
MAX_GANG_NODES = 64
_IN_CHUNK = 500  # names per "IN (...)" query: well under every database's bound-parameter limit


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What a user submits. ``isolation`` None means "what the GPU request implies"."""

    name: str
    tenant: str
    tags: dict[str, str] = field(default_factory=dict)
    isolation: IsolationLevel | None = None
    gpus: GpuRequest = field(default_factory=GpuRequest)
    priority: int = 0
    command: tuple[str, ...] = ()
    cpu_milli: int = 0  # issue 17: CPU (milli-cores) and memory (MiB) besides the GPUs
    memory_mib: int = 0
    restartable: bool = False  # issue 17 §3: defragmentation may move it while it runs
    topology: TopologyRequest | None = None  # issue 17 §4: a gang's packing request


_SHAPE_FOR = {
    IsolationLevel.SHARED: "a share_milli fraction",
    IsolationLevel.MIG: "a mig_profile",
    IsolationLevel.EXCLUSIVE_GPU: "whole GPUs (count, no mig_profile or share_milli)",
    IsolationLevel.DEDICATED_NODE: "whole GPUs (count, no mig_profile or share_milli)",
}


def topology_request(level: str, mode: str = "required") -> TopologyRequest:
    """A gang's topology request from its words (the API's, a cluster file's): ``level`` one
    of ``TOPOLOGY_LEVELS``, ``mode`` ``required`` (the default) or ``preferred``."""
    if level not in TOPOLOGY_LEVELS:
        raise ValidationFailed(
            f"topology.level must be one of {', '.join(TOPOLOGY_LEVELS)}",
            code="invalid_topology_level",
            details={"level": level, "known": list(TOPOLOGY_LEVELS)},
        )
    modes = [m.value for m in TopologyMode]
    if mode not in modes:
        raise ValidationFailed(
            f"topology.mode must be one of {', '.join(modes)}",
            code="invalid_topology_mode",
            details={"mode": mode, "known": modes},
        )
    return TopologyRequest(level, TopologyMode(mode))


def check_topology(topology: TopologyRequest | None, gpus: GpuRequest) -> None:
    """A topology request is a gang's (``gpus.nodes`` > 1): on a one-node workload it would
    mean nothing, so it is refused rather than silently ignored."""
    if topology is None:
        return
    topology_request(topology.level, str(topology.mode))
    if gpus.nodes <= 1:
        raise ValidationFailed(
            "topology applies to gangs only (gpus.nodes > 1): a one-node workload sits in "
            "one domain at every level",
            code="topology_requires_gang",
            details={"nodes": gpus.nodes},
        )


def check_resources(cpu_milli: int, memory_mib: int) -> None:
    """The CPU and memory a workload asks for (issue 17): 0 (none) up to what a column holds."""
    for what, value, top in (
        ("cpu_milli", cpu_milli, MAX_CPU_MILLI),
        ("memory_mib", memory_mib, MAX_MEMORY_MIB),
    ):
        if not 0 <= value <= top:
            raise ValidationFailed(
                f"{what} must be between 0 and {top}",
                code="invalid_resource_request",
                details={what: value},
            )


def check_gpu_request(g: GpuRequest, *, gpu_optional: bool = False) -> GpuRequest:
    """Validate one GPU request shape; returns it with the model name made canonical.
    ``gpu_optional``: the workload asks CPU or memory, so it may ask no GPU (count 0)."""
    if gpu_optional and g.count == 0 and g.mig_profile is None and g.share_milli is None:
        if g.nodes != 1:
            raise ValidationFailed(
                "a workload without GPUs runs on one node (gpus.nodes 1)",
                code="invalid_gpu_request",
                details={"nodes": g.nodes},
            )
        return replace(g, model=None)
    if g.mig_profile is not None and g.share_milli is not None:
        raise ValidationFailed(
            "ask for either a mig_profile or a share_milli, not both", code="invalid_gpu_request"
        )
    if not 1 <= g.nodes <= MAX_GANG_NODES:
        raise ValidationFailed(
            f"gpus.nodes must be between 1 and {MAX_GANG_NODES}",
            code="invalid_gpu_request",
            details={"nodes": g.nodes},
        )
    if g.nodes > 1:
        if g.mig_profile is not None or g.share_milli is not None:
            raise ValidationFailed(
                "a gang over several nodes takes whole GPUs (no mig_profile or share_milli)",
                code="invalid_gpu_request",
                details={"nodes": g.nodes},
            )
        if g.count < g.nodes or g.count % g.nodes:
            raise ValidationFailed(
                "gpus.count of a gang is its total: a multiple of gpus.nodes, the same number "
                "of GPUs on every node",
                code="invalid_gpu_request",
                details={"count": g.count, "nodes": g.nodes},
            )
    if not 1 <= g.per_node <= MAX_GPUS:
        raise ValidationFailed(
            f"gpus.count must be between 1 and {MAX_GPUS}" + (" per node" if g.nodes > 1 else ""),
            code="invalid_gpu_request",
            details={"count": g.count},
        )
    model = None
    if g.model is not None:
        # a SKU, a plain (non-MIG) model, or alternatives "A|B" (issue 17: the trace's
        # gpu_spec); a MIG profile needs a SKU
        alternatives = [m for m in g.model.split(MODEL_SEPARATOR) if m]
        if not alternatives or len(g.model) > MAX_SKU_CHARS:
            raise ValidationFailed(
                f"gpus.model must name a GPU model (or alternatives 'A|B', at most "
                f"{MAX_SKU_CHARS} characters)",
                code="unknown_gpu_model",
                details={"model": g.model},
            )
        if g.mig_profile is not None:
            model = MODEL_SEPARATOR.join(get_sku(m).name for m in alternatives)
        else:
            model = MODEL_SEPARATOR.join(canonical_model(m) for m in alternatives)
    if g.share_milli is not None:
        if not 1 <= g.share_milli <= 999:
            raise ValidationFailed(
                "gpus.share_milli is a fraction of one GPU in thousandths: 1 to 999 "
                "(ask for count=1 without share_milli for a whole GPU)",
                code="invalid_gpu_request",
                details={"share_milli": g.share_milli},
            )
        if g.count != 1:
            raise ValidationFailed(
                "a shared GPU request takes exactly one GPU (count=1)",
                code="invalid_gpu_request",
                details={"count": g.count},
            )
    if g.mig_profile is not None:
        skus = [get_sku(m) for m in model.split(MODEL_SEPARATOR)] if model else list(SKUS.values())
        if not any(s.profile(g.mig_profile) for s in skus):
            known = sorted({p.name for s in skus for p in s.mig_profiles})
            raise ValidationFailed(
                f"unknown MIG profile {g.mig_profile!r}" + (f" for {model}" if model else ""),
                code="unknown_mig_profile",
                details={"mig_profile": g.mig_profile, "known": known},
            )
    return replace(g, model=model)


def resolve(spec: WorkloadSpec, tenant: Tenant) -> tuple[dict[str, str], IsolationLevel, str]:
    """Apply the tenant's compliance profile: required tags are added, isolation is raised to
    its floor. Returns (tags, isolation, note) or refuses what the profile cannot allow."""
    tags = validate_tags(spec.tags)
    clash = {k: v for k, v in tenant.profile.required_tags.items() if tags.get(k, v) != v}
    if clash:
        raise ValidationFailed(
            f"tenant {tenant.name!r} requires {clash}; the workload asks otherwise",
            code="tag_conflict",
            details={"required": clash, "given": {k: tags[k] for k in clash}},
        )
    tags = dict(sorted({**tags, **tenant.profile.required_tags}.items()))
    natural = spec.gpus.natural_isolation
    asked = spec.isolation or natural
    floor = tenant.profile.minimum_for(tags)
    isolation = asked.at_least(floor)
    compatible = {natural} | (
        {IsolationLevel.DEDICATED_NODE} if natural is IsolationLevel.EXCLUSIVE_GPU else set()
    )
    if isolation not in compatible:
        why = (
            f"tenant {tenant.name!r} requires at least {floor.value} isolation"
            if isolation != asked
            else f"isolation {asked.value} was asked"
        )
        raise ValidationFailed(
            f"{why}, which needs {_SHAPE_FOR[isolation]}; the GPU request does not fit it",
            code="isolation_conflict",
            details={
                "isolation": isolation.value,
                "requested": asked.value,
                "tenant_minimum": floor.value,
            },
        )
    note = f"raised from {asked.value} by tenant profile" if isolation != asked else ""
    return tags, isolation, note


def submit_workload(store: Store, actor: Actor, spec: WorkloadSpec) -> Workload:
    """Accept a workload and try to place it at once; if it cannot be placed it stays pending
    with a reason. Every check runs before anything is written."""
    authorize(actor, Permission.WORKLOADS_WRITE)
    authorize(actor, Permission.WORKLOADS_WRITE, tenant=spec.tenant)
    gpus = _check_spec(spec)
    with netstate.exhaustion_recorded(store, actor, spec.tenant, spec.name):
        return store.write_grouped(
            actor, None, _submit_in_group, (spec, gpus), catch_up=True, apply_many=_submit_many
        )


_SUBMIT_VIEW = "workloads.submit_view"  # Tx.extras: (view, the newest seq it has seen)
_CANCEL_VIEW = "workloads.cancel_view"


def _kept_view(tx: Tx, key: str) -> ClusterView | None:
    """The view the previous write of a group left under ``key``, when nothing else has
    written since (it is current), else None."""
    kept = tx.extras.get(key)
    return kept[0] if kept is not None and kept[1] == tx.last_seq else None


def _keep_view(tx: Tx, key: str, view: ClusterView) -> None:
    tx.extras[key] = (view, tx.last_seq)


def _submit_in_group(tx: Tx, item: tuple[WorkloadSpec, GpuRequest]) -> Workload:
    """One submit of those committed together (``Store.write_grouped``, issue 20): the group's
    submits place through one view, taken before the first of them writes and kept current by
    each placement (as ``insert_workloads`` does), so the second one loads no cluster."""
    spec, gpus = item
    view = _kept_view(tx, _SUBMIT_VIEW) or ClusterView.cached(tx)
    # The batch's path for one: a plain outcome written by Core statements, its two events in
    # one insert (issue 20: the ORM's insert and flushes were a quarter of a submit).
    (workload,) = insert_workloads(tx, [(spec, gpus)], view=view, indexed=False)
    _keep_view(tx, _SUBMIT_VIEW, view)
    return workload


def _submit_many(tx: Tx, items: list[tuple[WorkloadSpec, GpuRequest]]) -> list[Workload]:
    """Several submits of a group at once (one actor's): ``insert_workloads`` for all of them,
    one tenant read, one name check, one insert, the events in one insert, the same rows and
    events as ``_submit_in_group`` once for each. A name twice among them, or any item a check
    refuses, refuses them all before anything is written (the group then submits each alone,
    and only that one fails)."""
    seen: set[tuple[str, str]] = set()
    for spec, _gpus in items:
        key = (spec.tenant, spec.name)
        if key in seen:
            raise Conflict(
                f"workload {spec.name!r} is submitted twice at once in tenant {spec.tenant!r}",
                details={"workload": spec.name, "tenant": spec.tenant},
            )
        seen.add(key)
    view = _kept_view(tx, _SUBMIT_VIEW) or ClusterView.cached(tx)
    out = insert_workloads(tx, items, view=view)
    _keep_view(tx, _SUBMIT_VIEW, view)
    return out


def _check_spec(spec: WorkloadSpec) -> GpuRequest:
    validate_name(spec.name, "workload")
    check_resources(spec.cpu_milli, spec.memory_mib)
    gpus = check_gpu_request(spec.gpus, gpu_optional=bool(spec.cpu_milli or spec.memory_mib))
    check_topology(spec.topology, gpus)
    _check_command(spec.command)
    return gpus


def _check_command(command: Sequence[str]) -> None:
    """The command's bounds (``model.workload``): it is kept in the event log for good."""
    if len(command) > MAX_COMMAND_ARGS:
        raise ValidationFailed(
            f"command has more than {MAX_COMMAND_ARGS} arguments",
            code="validation_failed",
            details={"limit": MAX_COMMAND_ARGS},
        )
    longest = max((len(arg) for arg in command), default=0)
    if longest > MAX_COMMAND_ARG_CHARS:
        raise ValidationFailed(
            f"a command argument has more than {MAX_COMMAND_ARG_CHARS} characters",
            code="validation_failed",
            details={"limit": MAX_COMMAND_ARG_CHARS},
        )
    total = sum(len(arg) for arg in command)
    if total > MAX_COMMAND_CHARS:
        raise ValidationFailed(
            f"the command's arguments have more than {MAX_COMMAND_CHARS} characters together",
            code="validation_failed",
            details={"limit": MAX_COMMAND_CHARS, "total": total},
        )


@contextmanager
def batch_item(index: int) -> Iterator[None]:
    """Name the batch item an error is about: ``items[3]: …`` and ``details.index``."""
    try:
        yield
    except ProofplaneError as exc:
        exc.message = f"items[{index}]: {exc.message}"
        exc.args = (exc.message,)
        d = exc.details
        exc.details = (
            {"index": index, **d} if isinstance(d, dict) else {"index": index, "details": d}
        )
        raise


def submit_workloads(store: Store, actor: Actor, specs: Sequence[WorkloadSpec]) -> list[Workload]:
    """Accept many workloads in one transaction, all or nothing, and place them in order.

    The same checks, decisions and events as ``submit_workload`` once per spec, in the given
    order (a later item sees the capacity the earlier ones took); any refused item (its index
    in the error: ``items[i]: …``, ``details.index``) refuses the batch and nothing is
    written. A tenant the actor cannot see reads as a missing one (404), as for one submit.
    (tenant, name) pairs must be unique within the batch."""
    authorize(actor, Permission.WORKLOADS_WRITE)
    if len(specs) > MAX_BATCH:
        raise ValidationFailed(
            f"a batch holds at most {MAX_BATCH} workloads, not {len(specs)}",
            code="batch_too_large",
            details={"items": len(specs), "max": MAX_BATCH},
        )
    items: list[tuple[WorkloadSpec, GpuRequest]] = []
    first: dict[tuple[str, str], int] = {}
    for i, spec in enumerate(specs):
        with batch_item(i):
            authorize(actor, Permission.WORKLOADS_WRITE, tenant=spec.tenant)
            gpus = _check_spec(spec)
            earlier = first.setdefault((spec.tenant, spec.name), i)
            if earlier != i:
                raise Conflict(
                    f"workload {spec.name!r} of tenant {spec.tenant!r} is also items[{earlier}]",
                    code="duplicate_in_batch",
                    details={"workload": spec.name, "tenant": spec.tenant, "first": earlier},
                )
        items.append((spec, gpus))
    if not items:
        return []
    with netstate.exhaustion_recorded(store, actor, None, None), store.write(actor) as tx:
        return insert_workloads(tx, items)


def insert_workloads(
    tx: Tx,
    items: Sequence[tuple[WorkloadSpec, GpuRequest]],
    *,
    view: ClusterView | None = None,
    indexed: bool = True,
) -> list[Workload]:
    """``insert_workload`` for many checked specs in one transaction, with the persistence
    batched: one tenant query, one name-conflict query per 500 names, one flush for the
    rows, the events of the plain outcomes (placed without preemption or repartitioning, or
    pending) through ``Tx.record_many``, their placements and placement-node links as bulk
    inserts. Any other outcome (preemption, repartitioning, an execution engine to dispatch
    to) first writes what is buffered, then takes the one-workload path, so the events keep
    the order and content that one ``insert_workload`` per spec would write (the network
    bookkeeping aside: endpoints and desired state are settled once, at the end of the
    transaction, by ``service.netstate``).

    ``view``: the transaction's view, current with everything it wrote (a group's earlier
    write left it); None: taken here, before anything is written. ``indexed``: a refused item
    names its index (``batch_item``); one submit's errors do not."""
    if view is None:
        view = ClusterView.cached(tx)  # before anything is written (see ClusterView.cached)
    session = tx.session
    names = sorted({spec.tenant for spec, _ in items})
    trows = {r.name: r for r in session.scalars(_TENANTS_NAMED, {"names": names})}
    tenants = {name: tenant_from_row(r) for name, r in trows.items()}
    by_id = {r.id: name for name, r in trows.items()}
    wanted = {(spec.tenant, spec.name) for spec, _ in items}
    taken: set[tuple[str, str]] = set()
    wl_names = sorted({spec.name for spec, _ in items})
    for at in range(0, len(wl_names), _IN_CHUNK):
        chunk = {"names": wl_names[at : at + _IN_CHUNK], "tenant_ids": list(by_id)}
        for tenant_id, name in session.execute(_NAMES_TAKEN, chunk):
            if (by_id[tenant_id], name) in wanted:
                taken.add((by_id[tenant_id], name))
    item = batch_item if indexed else lambda _i: nullcontext()
    values: list[dict[str, Any]] = []
    notes: list[str] = []
    for i, (spec, gpus) in enumerate(items):
        with item(i):
            tenant = tenants.get(spec.tenant)
            if tenant is None:
                raise NotFound(f"tenant {spec.tenant!r} not found", details={"tenant": spec.tenant})
            tags, isolation, note = resolve(spec, tenant)
            if (spec.tenant, spec.name) in taken:
                raise Conflict(
                    f"workload {spec.name!r} already exists in tenant {spec.tenant!r}",
                    details={"workload": spec.name, "tenant": spec.tenant},
                )
        values.append(
            _row_values(
                tx, spec, gpus, trows[spec.tenant].id, tags, isolation, tenant.profile.co_residency
            )
        )
        notes.append(note)
    # Core, not ORM objects: one INSERT … RETURNING for the ids, in order. The rows are not in
    # the session; a path that needs one as an object loads it (``session.get``).
    ids: list[int] = list(session.execute(_INSERT_WORKLOADS, values).scalars())
    for wid in ids:
        netstate.created(tx, wid)  # nor endpoints: nothing to read back when they are synced

    events: list[NewEvent] = []
    placed: list[tuple[int, Placement]] = []
    updates: list[dict[str, Any]] = []  # status/reason of the plain outcomes, one executemany
    known: dict[int, tuple[Placement | None, dict[str, Any]]] = {}  # valid while `exact`
    exact = True

    def write_buffered() -> None:
        if updates:
            session.execute(_SET_OUTCOME, updates)
            updates.clear()
        if events:
            tx.record_many(events)
            events.clear()
        if placed:
            _insert_placements(tx, view, placed)
            placed.clear()

    # With an engine, only a workload with a command is dispatched (``dispatch_new``): one
    # without takes the bulk path too, and whatever an earlier flow left undispatched is
    # dispatched once, after the loop.
    engine = tx.backend is not None
    for i, (wid, v, note, (spec, gpus)) in enumerate(zip(ids, values, notes, items, strict=True)):
        name = v["name"]
        fields = decision_fields(spec.tenant, v["tags"], v["isolation"], gpus, v["co_residency"])
        details = {**fields, "priority": spec.priority, "command": v["command"]}
        if spec.restartable:
            details["restartable"] = True
        if spec.topology is not None:
            details["topology"] = spec.topology.to_json()
        if note:
            details["isolation_note"] = note
        events.append(NewEvent("workload.submit", "workload", name, details))
        if netstate.is_per_workload(trows[spec.tenant].profile):
            write_buffered()  # its segment's event after its submission, as one by one
            with item(i):
                netstate.allocate_segment(tx, spec.tenant, workload=name, workload_id=wid)
        request = Request(
            name,
            spec.tenant,
            v["tags"],
            IsolationLevel(v["isolation"]),
            gpus,
            v["co_residency"],
            spec.cpu_milli,
            spec.memory_mib,
            spec.topology,
        )
        outcome = decide(tx, view, Job(wid, request, spec.priority), gpus)
        plain = not (engine and v["command"])
        if plain and not outcome.preempted and not outcome.repartitions and not outcome.moves:
            if outcome.placement is not None:
                change = {"b_id": wid, "b_status": WorkloadStatus.PLACED.value,
                          "b_reason": None, "b_details": None}  # fmt: skip
                events.append(
                    NewEvent(
                        "workload.place",
                        "workload",
                        name,
                        {**fields, **placement_json(outcome.placement), **outcome.details},
                    )
                )
                placed.append((wid, outcome.placement))
            else:  # a new row: the pending reason is always news
                reason_details = {
                    "message": outcome.message,
                    "rejections": outcome.rejections,
                    **outcome.details,
                }
                change = {"b_id": wid, "b_status": WorkloadStatus.PENDING.value,
                          "b_reason": outcome.reason, "b_details": reason_details}  # fmt: skip
                events.append(
                    NewEvent(
                        "workload.pending",
                        "workload",
                        name,
                        {**fields, "reason": outcome.reason, **reason_details},
                        Outcome.FAILURE,
                    )
                )
            updates.append(change)
            known[wid] = (outcome.placement, change)
            continue
        write_buffered()
        exact = False  # a preemption may have moved any row: read them back at the end
        row = session.get(WorkloadRow, wid)
        assert row is not None  # inserted above, in this transaction
        apply_outcome(tx, row, view, outcome)
        execution.dispatch_new(tx, view)
    write_buffered()
    if engine and exact:
        before = tx.last_seq
        execution.dispatch_new(tx, view)
        # what it dispatched (or, a job refused, placed from the capacity freed) was written
        # behind the values kept above: read the rows back
        exact = tx.last_seq == before
    if exact:
        return [
            _workload_of(spec, v, *known[wid])
            for wid, v, (spec, _g) in zip(ids, values, items, strict=True)
        ]
    session.flush()
    loaded = {
        r.id: r
        for r in session.scalars(
            select(WorkloadRow)
            .where(WorkloadRow.id.in_(ids))
            .options(*WORKLOAD_LOAD)
            .execution_options(populate_existing=True)
        )
    }
    return [workload_from_row(loaded[wid]) for wid in ids]


# Built once (statement and cache key): every submit runs them.
_TENANTS_NAMED = select(TenantRow).where(
    TenantRow.name.in_(bindparam("names", expanding=True)), TenantRow.deleted_at.is_(None)
)
_NAMES_TAKEN = select(WorkloadRow.tenant_id, WorkloadRow.name).where(
    WorkloadRow.name.in_(bindparam("names", expanding=True)),
    WorkloadRow.tenant_id.in_(bindparam("tenant_ids", expanding=True)),
)
_WL = WorkloadRow.__table__
_INSERT_WORKLOADS = insert(_WL).returning(_WL.c.id, sort_by_parameter_order=True)
_SET_OUTCOME = (
    update(_WL)
    .where(_WL.c.id == bindparam("b_id"))
    .values(status=bindparam("b_status"), reason=bindparam("b_reason"),
            reason_details=bindparam("b_details"))
)  # fmt: skip


def _row_values(
    tx: Tx,
    spec: WorkloadSpec,
    gpus: GpuRequest,
    tenant_id: int,
    tags: dict[str, str],
    isolation: IsolationLevel,
    co_residency: bool,
) -> dict[str, Any]:
    """The columns of a new workload row: pending, no reason yet."""
    return {
        "name": spec.name,
        "tenant_id": tenant_id,
        "tags": tags,
        "isolation": isolation.value,
        **gpus.to_row(),
        "priority": spec.priority,
        "command": list(spec.command),
        "status": WorkloadStatus.PENDING.value,
        "reason": None,
        "reason_details": None,
        "created_at": tx.now,
        "updated_at": tx.now,
        "co_residency": co_residency,
        "cpu_milli": spec.cpu_milli,
        "memory_mib": spec.memory_mib,
        "restartable": spec.restartable,
        "topology": spec.topology.to_json() if spec.topology is not None else None,
    }


def _insert_placements(tx: Tx, view: ClusterView, placed: list[tuple[int, Placement]]) -> None:
    """The placements and their node links in two bulk inserts (no ORM objects: linking a
    placement to its nodes must not load the node rows)."""
    ids = view.node_rows.ids
    netstate.touch(tx, (wid for wid, _p in placed))
    table = PlacementRow.__table__
    params = [
        {
            "workload_id": wid,
            "node_id": ids[p.node],
            "devices": devices_to_json(p.devices),
            "members": members_to_json(p),
            "placed_at": tx.now,
        }
        for wid, p in placed
    ]
    result = tx.session.execute(
        insert(table).returning(table.c.id, sort_by_parameter_order=True), params
    )
    links = [
        {"placement_id": pid, "node_id": ids[n]}
        for pid, (_wid, p) in zip(result.scalars().all(), placed, strict=True)
        for n in dict.fromkeys(p.nodes)
    ]
    tx.session.execute(insert(placement_nodes), links)


def _workload_of(
    spec: WorkloadSpec, v: dict[str, Any], placement: Placement | None, change: dict[str, Any]
) -> Workload:
    """The workload a batch item became, from what this transaction wrote (not read back)."""
    return Workload(
        name=v["name"],
        tenant=spec.tenant,
        tags=dict(v["tags"]),
        isolation=IsolationLevel(v["isolation"]),
        gpus=GpuRequest.from_row(v),
        priority=v["priority"],
        command=tuple(v["command"]),
        status=WorkloadStatus(change["b_status"]),
        reason=change["b_reason"],
        reason_details=change["b_details"],
        placement=placement,
        created_at=v["created_at"],
        updated_at=v["updated_at"],
        co_residency=v["co_residency"],
        cpu_milli=v["cpu_milli"],
        memory_mib=v["memory_mib"],
        restartable=v["restartable"],
        topology=TopologyRequest.from_json(v["topology"]),
    )


# Built once (statement and cache key): every submit runs it.
_NAME_TAKEN = select(WorkloadRow.id).where(
    WorkloadRow.name == bindparam("name"), WorkloadRow.tenant_id == bindparam("tenant_id")
)


def insert_workload(
    tx: Tx, spec: WorkloadSpec, gpus: GpuRequest, *, view: ClusterView | None = None
) -> WorkloadRow:
    """Insert one checked spec and place it (``view``: the transaction's view, current with
    everything it wrote; None: taken here, before this writes)."""
    _check_command(spec.command)  # again: a cluster file's workloads come this way only
    # The view first: a cached scheduler is current only before this transaction writes.
    view = ClusterView.cached(tx) if view is None else view
    trow = tenant_row(tx.session, spec.tenant)
    tenant = tenant_from_row(trow)
    tags, isolation, note = resolve(spec, tenant)
    if tx.session.scalar(_NAME_TAKEN, {"name": spec.name, "tenant_id": trow.id}):
        raise Conflict(
            f"workload {spec.name!r} already exists in tenant {spec.tenant!r}",
            details={"workload": spec.name, "tenant": spec.tenant},
        )
    v = _row_values(tx, spec, gpus, trow.id, tags, isolation, tenant.profile.co_residency)
    del v["tenant_id"]
    row = WorkloadRow(tenant=trow, placement=None, **v)  # new: no placement to load back
    tx.session.add(row)
    tx.session.flush()
    netstate.created(tx, row.id)  # nor endpoints
    details = {**decision_details(row), "priority": spec.priority, "command": list(spec.command)}
    if spec.restartable:
        details["restartable"] = True
    if spec.topology is not None:
        details["topology"] = spec.topology.to_json()
    if note:
        details["isolation_note"] = note
    tx.record("workload.submit", "workload", spec.name, details=details)
    if tenant.profile.segment == PER_WORKLOAD:  # its own segment (issue 14)
        netstate.allocate_segment(tx, spec.tenant, workload=spec.name, workload_id=row.id)
    schedule(tx, row, view)
    execution.dispatch_new(tx, view)  # the row, and victims of a preemption placed elsewhere
    return row


def cancel_workload(
    store: Store, actor: Actor, name: str, reason: str | None = None, *, tenant: str | None = None
) -> Workload:
    """Stop a workload and release its capacity, which pending work may then take. Cancels
    that queue while another holds the write lock are committed together (``_cancel_in_group``,
    issue 20)."""
    authorize(actor, Permission.WORKLOADS_WRITE)
    visible = actor.visible_tenants(Permission.WORKLOADS_WRITE)
    item = (name, reason, tenant, visible)
    return store.write_grouped(
        actor, None, _cancel_in_group, item, catch_up=True, apply_many=_cancel_many
    )


def _cancel_in_group(tx: Tx, item: tuple[str, str | None, str | None, Any]) -> Workload:
    """One cancel of those committed together. The capacity it frees is offered to pending work
    through the view the group's previous cancel left current (its own release applied to it),
    so the second cancel of a group loads no cluster; else through the process's cached
    scheduler: taken before this cancel writes when it is current, and told of the release here
    (nothing read back); when it is behind (another process wrote), taken after, caught up on
    those writes and this cancel's at once.

    The workload is read and changed by Core statements, no ORM object built (issue 20: the
    ORM's load and flush were a fifth of a cancel); the ORM does it when the transaction
    already holds the workload or its placement as objects, or when the workload has a command
    and the transaction an engine, whose job the cancel stops (``_cancel_row``)."""
    name, reason, tenant, visible = item
    actor = tx.actor
    view = _kept_view(tx, _CANCEL_VIEW) or ClusterView.cached_if_current(tx)
    session = tx.session
    session.flush()  # what this transaction changed is what the read below sees
    query, params = _named(True, name, tenant, visible)
    found = load_workload_targets(session, query, params)
    wid, pid, workload = only_named(found, name, lambda f: f[2].tenant)
    _refuse_ended(workload)
    node = workload.placement.node if workload.placement is not None else None
    message = reason or render(CANCELLED, actor=actor.name)
    # Only a workload with a command is ever dispatched: one without has no engine job to stop.
    engine_job = tx.backend is not None and bool(workload.command)
    if engine_job or _held_as_objects(session, wid, pid):
        cancelled = _cancel_row(tx, workload_row(session, name, tenant=workload.tenant), message)
    else:
        netstate.touch(tx, [wid])  # its endpoints (and its own segment) end with it
        connection = session.connection()
        if pid is not None:  # its node links go with it (ON DELETE CASCADE)
            connection.execute(_DELETE_PLACEMENTS, {"pids": [pid]})
        values = _cancel_values(tx, wid, message)
        connection.execute(_CANCEL_ROW, values)
        cancelled = _cancelled(tx, workload, values)
    tx.record_many([_cancel_event(workload, reason)])
    if node is not None:
        if view is not None:
            view.scheduler.release(wid)
        else:
            # placed from the cached scheduler caught up from the events: no cluster load
            view = ClusterView(tx.session, from_cache=True)
        reschedule_pending(tx, view)  # pending work may take the capacity
        execution.dispatch_new(tx, view)
    if view is not None:  # a pending workload's cancel frees no capacity: still current
        _keep_view(tx, _CANCEL_VIEW, view)
    return cancelled


def _cancel_many(tx: Tx, items: list[tuple[str, str | None, str | None, Any]]) -> list[Workload]:
    """Several cancels of a group at once (one actor's, issue 20): the workloads read in one
    query, their placements deleted in one statement, their rows changed in one executemany,
    their events in one insert; the same rows, events and answers as ``_cancel_in_group``
    once for each. Every check runs first: a workload not found, ambiguous or already ended,
    or one named twice, refuses them all before anything is written (the group then cancels
    each alone, and only that one fails).

    The capacity each frees is offered to pending work in its turn, as one cancel after the
    other does: the pending work is read once, and after each release decided again in the
    view (no statement); only when one of them is placed or waits for another reason are the
    cancel events so far written, that change after them, and the pending work read again.
    Engine dispatch runs once the run is written (and after each such change). A workload
    with an engine job to stop, one the transaction holds as an ORM object, or a pending one
    cancelled with one that frees capacity (one at a time, the release may place it before
    its own cancel) sends the run to ``_cancel_in_group``, one at a time."""
    session = tx.session
    session.flush()  # what this transaction changed is what the read below sees
    # one actor's, each with the tenants of the credential it came with
    scopes = {visible for *_, visible in items}
    query, params = _named_many(
        sorted({name for name, *_ in items}),
        None if None in scopes else frozenset().union(*scopes),
    )
    rows = load_workload_targets(session, query, params)
    targets: list[tuple[int, int | None, Workload, str | None]] = []
    for name, reason, tenant, visible in items:
        found = [
            f
            for f in rows
            if f[2].name == name
            and tenant in (None, f[2].tenant)
            and (visible is None or f[2].tenant in visible)
        ]
        wid, pid, workload = only_named(found, name, lambda f: f[2].tenant)
        _refuse_ended(workload)
        if any(t[0] == wid for t in targets):
            raise Conflict(
                f"workload {name!r} is cancelled twice at once",
                details={"workload": name, "tenant": workload.tenant},
            )
        targets.append((wid, pid, workload, reason))
    frees = any(t[2].placement is not None for t in targets)
    if (
        any(tx.backend is not None and bool(t[2].command) for t in targets)
        or any(_held_as_objects(session, t[0], t[1]) for t in targets)
        # a pending one among them might take what another frees before its own cancel
        or (frees and any(t[2].status is WorkloadStatus.PENDING for t in targets))
    ):
        return [_cancel_in_group(tx, item) for item in items]
    view = _kept_view(tx, _CANCEL_VIEW) or (
        # caught up before this writes, each release told to it below
        ClusterView.cached(tx) if frees else ClusterView.cached_if_current(tx)
    )
    netstate.touch(tx, [t[0] for t in targets])  # their endpoints (and own segments) end
    connection = session.connection()
    values = [
        _cancel_values(tx, wid, reason or render(CANCELLED, actor=tx.actor.name))
        for wid, _pid, _w, reason in targets
    ]
    pids = [t[1] for t in targets if t[1] is not None]
    if pids:  # their node links go with them (ON DELETE CASCADE)
        connection.execute(_DELETE_PLACEMENTS, {"pids": pids})
    connection.execute(_CANCEL_ROW, values)
    buffered: list[NewEvent] = []

    def write_events() -> None:
        tx.record_many(buffered)
        buffered.clear()

    jobs = pending_jobs(session) if frees else []
    for wid, _pid, w, reason in targets:
        buffered.append(_cancel_event(w, reason))
        if w.placement is None or view is None:
            continue
        view.scheduler.release(wid)
        if jobs and reschedule_pending(tx, view, jobs=jobs, before_change=write_events):
            execution.dispatch_new(tx, view)
            jobs = pending_jobs(session)
    write_events()
    if frees:
        execution.dispatch_new(tx, view)
    if view is not None:
        _keep_view(tx, _CANCEL_VIEW, view)
    return [_cancelled(tx, t[2], v) for t, v in zip(targets, values, strict=True)]


def _refuse_ended(workload: Workload) -> None:
    """A cancel's check: a workload that already ended is not cancelled again (409)."""
    status = workload.status
    if status.is_terminal:
        raise InvalidState(
            f"workload {workload.name!r} is already {status.value}",
            details={"workload": workload.name, "status": status.value},
        )


def _cancel_values(tx: Tx, wid: int, message: str) -> dict[str, Any]:
    """``_CANCEL_ROW``'s parameters for workload row ``wid``."""
    return {"wid": wid, "status": WorkloadStatus.CANCELLED.value, "reason": CANCELLED,
            "details": {"message": message}, "now": tx.now}  # fmt: skip


def _cancelled(tx: Tx, workload: Workload, values: dict[str, Any]) -> Workload:
    """The answer to a cancel written with ``values`` (what a read gives afterwards)."""
    return replace(
        workload,
        status=WorkloadStatus.CANCELLED,
        reason=CANCELLED,
        reason_details=values["details"],
        placement=None,
        updated_at=tx.now,
    )


def _cancel_event(workload: Workload, reason: str | None) -> NewEvent:
    """A cancel's ``workload.cancel`` event, from the workload as it was."""
    node = workload.placement.node if workload.placement is not None else None
    details = {"tenant": workload.tenant, "from_status": workload.status.value, "node": node,
               "reason": reason}  # fmt: skip
    return NewEvent("workload.cancel", "workload", workload.name, details)


def _named_many(
    names: list[str], visible: frozenset[str] | None
) -> tuple[Select[Any], dict[str, Any]]:
    """``_named`` for several names at once: a ``workload_target_select()`` of the workloads
    called any of ``names`` among the ``visible`` tenants (None: all), ordered by tenant, and
    its parameters; each of its two shapes built once."""
    query = _NAMED_MANY.get(visible is not None)
    if query is None:
        query = workload_target_select().where(WL.name.in_(bindparam("names", expanding=True)))
        if visible is not None:
            query = query.where(WL.tenant.in_(bindparam("visible", expanding=True)))
        query = _NAMED_MANY.setdefault(visible is not None, query.order_by(WL.tenant))
    params: dict[str, Any] = {"names": names}
    if visible is not None:
        params["visible"] = sorted(visible)
    return query, params


_NAMED_MANY: dict[bool, Select[Any]] = {}


_DELETE_PLACEMENTS = delete(PlacementRow.__table__).where(
    PlacementRow.__table__.c.id.in_(bindparam("pids", expanding=True))
)
_CANCEL_ROW = (
    update(WorkloadRow.__table__)
    .where(WorkloadRow.__table__.c.id == bindparam("wid"))
    .values(
        status=bindparam("status"),
        reason=bindparam("reason"),
        reason_details=bindparam("details"),
        updated_at=bindparam("now"),
    )
)


def _held_as_objects(session: Session, wid: int, pid: int | None) -> bool:
    """Whether ``session`` holds the workload row ``wid`` or its placement ``pid`` as ORM
    objects, which statements behind its back would leave stale."""
    identity = session.identity_map
    if identity.get(WorkloadRow.__mapper__.identity_key_from_primary_key((wid,))) is not None:
        return True
    if pid is None:
        return False
    key = PlacementRow.__mapper__.identity_key_from_primary_key((pid,))
    return identity.get(key) is not None


def _cancel_row(tx: Tx, row: WorkloadRow, message: str) -> Workload:
    """The cancel's change through the ORM: its engine job stopped, its placement deleted."""
    jobs.cancel_engine_job(tx, row)
    netstate.touch(tx, [row.id])  # its endpoints (and its own segment) end with it
    row.placement = None
    row.status = WorkloadStatus.CANCELLED.value
    row.reason = CANCELLED
    row.reason_details = {"message": message}
    row.updated_at = tx.now
    tx.session.flush()
    return workload_from_row(row)


def get_workload(store: Store, actor: Actor, name: str, *, tenant: str | None = None) -> Workload:
    """The workload called ``name`` among those the caller can see (in ``tenant`` when
    given); a name several visible tenants use needs ``tenant`` (409 ``ambiguous_name``)."""
    authorize(actor, Permission.WORKLOADS_READ)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    query, params = _named(False, name, tenant, visible)
    with store.read() as session:
        found = load_workloads(session, query, params)
    return only_named(found, name, lambda w: w.tenant)


def _named(
    targets: bool, name: str, tenant: str | None, visible: frozenset[str] | None
) -> tuple[Select[Any], dict[str, Any]]:
    """A ``workload_select()`` (``targets``: ``workload_target_select()``) of the workloads
    called ``name`` among the ``visible`` tenants (None: all), in ``tenant`` when given,
    ordered by tenant, and its parameters. Each of its eight shapes is built once (issue 20:
    building the statement and its cache key cost more than running it, in every cancel)."""
    shape = (targets, tenant is not None, visible is not None)
    query = _NAMED.get(shape)
    if query is None:
        query = (workload_target_select() if targets else workload_select()).where(
            WL.name == bindparam("name")
        )
        if tenant is not None:
            query = query.where(WL.tenant == bindparam("tenant"))
        if visible is not None:
            query = query.where(WL.tenant.in_(bindparam("visible", expanding=True)))
        query = _NAMED.setdefault(shape, query.order_by(WL.tenant))
    params: dict[str, Any] = {"name": name}
    if tenant is not None:
        params["tenant"] = tenant
    if visible is not None:
        params["visible"] = sorted(visible)
    return query, params


_NAMED: dict[tuple[bool, bool, bool], Select[Any]] = {}


# A workload's key in a list: its name, then its tenant's (names are unique per tenant only).
# The cursor carries both as one string, "name/tenant" ("/" is in no name).
_KEY_SEP = "/"


def list_workloads(
    store: Store,
    actor: Actor,
    *,
    tenant: str | None = None,
    status: WorkloadStatus | None = None,
    node: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[Workload]:
    """Workloads by name (then tenant), filtered; keyset pages: a workload submitted between
    two pages neither shifts nor repeats what the next page holds."""
    authorize(actor, Permission.WORKLOADS_READ)
    if tenant is not None:
        authorize(actor, Permission.WORKLOADS_READ, tenant=tenant)
    check_limit(limit)
    after = decode_text_cursor("workloads", cursor)
    query = workload_select().order_by(WL.name, WL.tenant)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    if visible is not None:
        query = query.where(WL.tenant.in_(visible))
    if after is not None:
        assert isinstance(after, str)
        after_name, sep, after_tenant = after.partition(_KEY_SEP)
        if sep:
            query = query.where(
                or_(
                    WL.name > after_name,
                    and_(WL.name == after_name, WL.tenant > after_tenant),
                )
            )
        else:  # a cursor of an older release: the name alone
            query = query.where(WL.name > after_name)
    if tenant is not None:
        query = query.where(WL.tenant == tenant)
    if status is not None:
        query = query.where(WL.status == status.value)
    if node is not None:
        query = query.where(workload_on_node(node))
    with store.read() as session:
        items = load_workloads(session, query.limit(limit + 1))
    last = items[limit - 1] if len(items) > limit else None
    key = f"{last.name}{_KEY_SEP}{last.tenant}" if last is not None else None
    return paginate("workloads", items, limit, key)


def explain_workload(
    store: Store, actor: Actor, name: str, *, tenant: str | None = None
) -> dict[str, Any]:
    """Why a workload is where it is, or why it waits: its status and reason, then every node
    judged as the cluster stands now (``schedule.explain``), and one human sentence."""
    authorize(actor, Permission.WORKLOADS_READ)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    with store.read() as session:
        row = workload_row(session, name, tenant=tenant, visible=visible)
        wl = workload_from_row(row)
        analysis: dict[str, Any] = {}
        view: ClusterView | None = None
        unready: frozenset[str] = frozenset()
        if not wl.status.is_terminal:
            placed_on = wl.placement.nodes if wl.placement else ()
            view = ClusterView(session)
            unready = view.unready(wl.tenant, row.id)
            analysis = explain_job(view.scheduler, job_of(row), placed_on, unready)
        layout = mig_explain.mig_layout(session, row, view, unready)
    return {
        "workload": wl.name,
        "tenant": wl.tenant,
        "status": wl.status.value,
        "reason": wl.reason,
        "message": (wl.reason_details or {}).get("message"),
        "placement": wl.placement,
        "summary": _summary(wl, analysis),
        "analysis": analysis or None,
        "defrag": _defragmentation(wl),
        "mig_layout": layout,
    }


def _defragmentation(wl: Workload) -> dict[str, Any] | None:
    """What defragmentation (issue 17 §3) did for or to it, or why it could not help it."""
    d = wl.reason_details or {}
    if d.get("moved_by") == DEFRAGMENTATION:
        return {"moved": True, "for_workload": d.get("for_workload"), "from": d.get("from")}
    found = d.get("defrag")
    return dict(found) if isinstance(found, dict) else None


def _counts(filters: dict[str, int]) -> str:
    return ", ".join(f"{code} on {n}" for code, n in filters.items()) or "none"


def _summary(wl: Workload, a: dict[str, Any]) -> str:
    if wl.status.is_terminal:
        return f"{wl.status.value}" + (f" ({wl.reason})" if wl.reason else "") + "; holds nothing"
    filters = _counts(a.get("filters", {}))
    if wl.placement is not None:
        parts = []
        for p in a.get("placed_on", []):
            rank = p.get("rank")
            parts.append(
                f"{p['node']} (ranks #{rank} of {a['candidates_total']} candidate nodes, "
                f"{p['idle_gpus_after']} idle GPUs left)"
                if rank is not None
                else f"{p['node']} (no longer a candidate for new placements)"
            )
        how = ""
        details = wl.reason_details or {}
        if details.get("moved_by") == DEFRAGMENTATION or details.get("defrag"):
            how = f" ({details.get('message')})"
        topo = a.get("topology") or {}
        packed = ""
        if topo.get("placed_domains"):
            domains = topo["placed_domains"]
            packed = (
                f"; its gang asks {topo['level']} ({topo['mode']}) and spans "
                f"{len(domains)}: {', '.join(domains)}"
            )
        return (
            f"{wl.status.value} on {', '.join(parts)}{how}: it is certified for "
            f"{wl.tags or 'no tags'} and scored best fit (fewest idle GPUs left, then name)"
            f"{packed}; nodes rejected as the cluster stands now: {filters}"
        )
    return (
        f"pending ({wl.reason}): {(wl.reason_details or {}).get('message', '')}; "
        f"nodes rejected per filter: {filters}; {a.get('candidates_total', 0)} node(s) could "
        "take it now"
    )
