"""The scheduling engine: quota → place (single node or gang) → repartition → preempt.

A ``Scheduler`` wraps a ``ClusterSnapshot`` (the indexed placement core) and adds what the
snapshot does not know: which workload holds which allocations (a gang holds several), its
priority and compliance pool, per-tenant quotas and usage. ``schedule(job)`` decides for one
pending workload and, when it places it, holds the capacity at once, so the next decision sees
it. It returns an ``Outcome`` that says everything the service has to persist and audit: the
placement, the workloads it preempted, the MIG layouts it changed, or why the job waits.
Pure: no I/O, no clock.

Order of the steps, least disruptive first:

1. **Quota** (a PreFilter): a tenant's holdings plus the request must fit its ``Quota``, or the
   job waits with ``quota_exceeded`` (every node counted under that code).
2. **Place** on existing capacity: the snapshot's filters and best fit. A gang (``gpus.nodes``
   > 1) places ``count // nodes`` whole GPUs on each of ``nodes`` distinct nodes, all or none;
   with a topology request (issue 17 §4) packed into the fewest domains at its level
   (``schedule.topology``), a ``required`` one waiting with ``topology_unsatisfiable`` when no
   single domain holds it.
3. **Repartition** (MIG requests only): an *idle* MIG-enabled GPU (no allocation on any of its
   instances) on a node certified for the job's tags may get a new layout
   (``schedule.mig.layout_for``). A GPU holding work is never touched.
   Then, when the caller passes one, **defragment** (``schedule.defrag``, issue 17 §3): move
   idle or restartable work of the job's pool off a region of a MIG GPU, fewest moves first.
4. **Preempt**: lower-priority workloads of the job's own compliance pool are evicted from a
   node when that makes the job placeable there, fewest victims first.

Compliance pool, precisely: the set of compliance tags a workload carries after its tenant's
profile added the required ones (``{"hipaa": "true"}``; the empty set is the general pool).
Two workloads are in the same pool iff those sets are equal. Preemption happens only inside a
pool: a victim must have exactly the preemptor's tags and a strictly lower priority. So a
general-pool job can never displace HIPAA work from HIPAA nodes (nor the reverse), priorities
are compared only between workloads that compete for the same certified capacity, and the
preemptor is still placed only where the compliance filters allow (rule 5: never a weaker
node). A gang preempts by the same rule over all its candidate nodes, all or nothing: victims
are evicted only when the whole gang then fits; a gang victim loses every member.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from proofplane.hardware.skus import SKUS
from proofplane.model import (
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    Placement,
    Quota,
    TopologyMode,
    missing_tags,
)
from proofplane.schedule.mig import layout_for
from proofplane.schedule.migslots import CarveIndex, Carver
from proofplane.schedule.quota import Cost, device_cost, quota_check, request_cost
from proofplane.schedule.reasons import (
    CO_RESIDENCY_NOTE,
    FILTER_CODES,
    GANG_NODE_TAKEN,
    GANG_TEMPLATE,
    INSUFFICIENT_CAPACITY,
    MISSING_CERTIFICATION,
    NETWORK_NOT_APPLIED,
    NETWORK_NOTE,
    NO_COMPLIANT_CAPACITY,
    NODE_NOT_ADMITTED,
    QUOTA_EXCEEDED,
    QUOTA_ITEM,
    TOPOLOGY_UNSATISFIABLE,
    blocking,
    render,
)
from proofplane.schedule.scoring import Scorer
from proofplane.schedule.snapshot import ClusterSnapshot
from proofplane.schedule.topology import domains_of, place_gang
from proofplane.schedule.values import Allocation, Decision, Request, allowed_models

if TYPE_CHECKING:
    from proofplane.schedule.defrag import Move

Pool = frozenset[tuple[str, str]]
UNEXPLAINED = "no capacity fits (not explained: schedule(explain=False))"


def pool_of(tags: Mapping[str, str]) -> Pool:
    """The compliance pool of a workload carrying ``tags`` (see the module docstring)."""
    return frozenset(tags.items())


@dataclass(frozen=True, slots=True)
class Job:
    """A pending workload as the engine sees it."""

    key: Hashable
    request: Request
    priority: int = 0

    @property
    def pool(self) -> Pool:
        return pool_of(self.request.tags)


@dataclass(frozen=True, slots=True)
class Held:
    """A workload holding capacity: every part of its placement is reserved in the snapshot."""

    key: Hashable
    name: str
    tenant: str
    isolation: IsolationLevel
    priority: int
    pool: Pool
    placement: Placement
    co_residency: bool = True
    cpu_milli: int = 0  # per part of the placement (issue 17)
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class Repartition:
    """A new MIG layout for an idle GPU; ``carved``: only instances added in free space
    (``before`` ⊂ ``after``, the GPU may hold work: nothing running is touched)."""

    node: str
    gpu_index: int
    gpu_uuid: str
    before: tuple[MigInstance, ...]
    after: tuple[MigInstance, ...]
    carved: bool = False
    # which step of the engine made it: "repartition" (an idle GPU re-laid), "carve" (new
    # instances in free slices only) or "reclaim" (carving that destroyed idle instances)
    step: str = "repartition"


@dataclass(frozen=True, slots=True)
class Outcome:
    placement: Placement | None
    reason: str | None  # None when placed; else a ``pending`` code of ``schedule.reasons``
    message: str
    rejections: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    preempted: tuple[Held, ...] = ()
    repartitions: tuple[Repartition, ...] = ()
    moves: tuple[Move, ...] = ()  # defragmentation (``schedule.defrag``): workloads moved first


#: The defragmentation step: given the scheduler and a job that waits, the outcome of placing
#: it after moving other work (held at once), or None (``schedule.defrag.Defragmenter``).
Defrag = Callable[["Scheduler", Job], Outcome | None]


def held_for(job: Job, placement: Placement) -> Held:
    """What ``job`` holds once placed at ``placement``."""
    req = job.request
    return Held(
        job.key,
        req.workload,
        req.tenant,
        req.isolation,
        job.priority,
        job.pool,
        placement,
        req.co_residency,
        req.cpu_milli,
        req.memory_mib,
    )


def member_request(req: Request) -> Request:
    """What each member of a gang asks for (``req`` itself when it is not a gang)."""
    g = req.gpus
    if g.nodes <= 1:
        return req
    return replace(req, gpus=GpuRequest(g.per_node, g.model), topology=None)


def _admitted_for(node: Node, tags: Mapping[str, str]) -> bool:
    return node.state is NodeState.ADMITTED and not missing_tags(tags, node.certifications)


class Scheduler:
    """Placement state for one scheduling session (the service builds one per transaction;
    a long-running scheduler would keep one and feed it deltas)."""

    def __init__(
        self,
        nodes: Iterable[Node] = (),
        held: Iterable[Held] = (),
        quotas: Mapping[str, Quota] | None = None,
        *,
        scorer: Scorer | None = None,
        carver: Carver | None = None,
        reclaim: bool = False,
        repartition: bool = True,
    ) -> None:
        self.snapshot = ClusterSnapshot(nodes, scorer=scorer)
        # whether the repartitioning step may re-lay idle GPUs at all (``schedule(repartition=)``
        # turns it off for one decision; the server's ``PROOFPLANE_MIG_AUTO_LAYOUT=off`` for all)
        self.repartition = repartition
        # MIG carving (``schedule.migslots``): None: instances come from inventory and from
        # repartitioning idle GPUs only (the server's ``PROOFPLANE_MIG_AUTO_LAYOUT=idle``);
        # ``reclaim``: carving may also destroy free (unused) instances on the GPUs it carves,
        # never one in use (the server does not reclaim)
        self.carving = CarveIndex(carver) if carver is not None else None
        self.reclaim = reclaim and carver is not None
        if self.carving is not None:
            for node in self.snapshot.nodes():
                self.carving.track(node, frozenset() if self.reclaim else None)
        self.quotas: dict[str, Quota] = dict(quotas or {})
        self._held: dict[Hashable, Held] = {}
        self._used: dict[str, Cost] = {}
        # placement order (preemption takes the most recently placed first among equals): a
        # rank per held key, so that what is released and held again at its old rank (a
        # what-if check undoing itself) keeps its place
        self._rank: dict[Hashable, int] = {}
        self._next_rank = 0
        for h in held:
            self.hold(h)

    # ------------------------------------------------------------------ state

    @property
    def held(self) -> Mapping[Hashable, Held]:
        return self._held

    def used(self, tenant: str) -> Cost:
        return self._used.get(tenant, Cost())

    def nodes(self) -> Iterator[Node]:
        return self.snapshot.nodes()

    def node(self, name: str) -> Node | None:
        return self.snapshot.node(name)

    def upsert_node(self, node: Node) -> None:
        self._set_node(node)

    def remove_node(self, name: str) -> None:
        self.snapshot.remove_node(name)
        if self.carving is not None:
            self.carving.forget(name)

    def _set_node(self, node: Node) -> None:
        """Replace a node's inventory (layouts included) in the snapshot and the carving
        index."""
        self.snapshot.upsert_node(node)
        if self.carving is not None:
            self._track(node.name)

    def _track(self, name: str) -> None:
        """Tell the carving index what ``name`` looks like now (reclaiming: with the MIG
        instances in use on it)."""
        assert self.carving is not None
        node = self.snapshot.node(name)
        if node is None:
            self.carving.forget(name)
            return
        held = None
        if self.reclaim:
            allocs = self.snapshot.allocations
            held = {
                (d.gpu_index, d.mig_start)
                for key in self.snapshot.allocations_on(name)
                for d in allocs[key].placement.devices
                if d.mig_start is not None
            }
        self.carving.track(node, held)

    def set_quota(self, tenant: str, quota: Quota) -> None:
        self.quotas[tenant] = quota

    def rank(self, key: Hashable) -> int | None:
        """Where ``key`` stands in placement order (lower: placed earlier); None if not held."""
        return self._rank.get(key)

    def hold(self, h: Held, *, rank: int | None = None) -> None:
        """Reserve every part of ``h``'s placement (replacing what ``h.key`` held before). It is
        the most recently placed, unless ``rank`` (a ``rank()`` it had) puts it back where it
        stood."""
        self.release(h.key)
        self._held[h.key] = h
        if rank is None:
            self._next_rank += 1
            rank = self._next_rank
        self._rank[h.key] = rank
        for i, part in enumerate(h.placement.parts):
            self.snapshot.reserve(
                (h.key, i),
                Allocation(
                    h.name, h.tenant, h.isolation, part, h.co_residency, h.cpu_milli, h.memory_mib
                ),
            )
            if self.reclaim:
                self._track(part.node)
        cost = sum((device_cost(p.devices) for p in h.placement.parts), Cost())
        self._used[h.tenant] = self.used(h.tenant) + cost

    def release(self, key: Hashable) -> Held | None:
        h = self._held.pop(key, None)
        if h is None:
            return None
        del self._rank[key]
        for i, part in enumerate(h.placement.parts):
            self.snapshot.release((key, i))
            if self.reclaim:
                self._track(part.node)
        cost = sum((device_cost(p.devices) for p in h.placement.parts), Cost())
        self._used[h.tenant] = self.used(h.tenant) - cost
        return h

    def busy_gpus(self, node: str) -> set[int]:
        """Indexes of the GPUs on ``node`` that hold any allocation."""
        allocs = self.snapshot.allocations
        return {
            d.gpu_index
            for key in self.snapshot.allocations_on(node)
            for d in allocs[key].placement.devices
        }

    # ------------------------------------------------------------------ deciding

    def quota_excess(self, tenant: str, gpus: GpuRequest) -> dict[str, object] | None:
        quota = self.quotas.get(tenant)
        if quota is None:
            return None
        return quota_check(quota, self.used(tenant), request_cost(gpus))

    def place(self, req: Request) -> tuple[Placement | None, Decision]:
        """Where ``req`` fits now (no quota, no repartition, no preemption); changes nothing."""
        if req.gpus.nodes <= 1:
            d = self.snapshot.place(req)
            return d.placement, d
        return self._place_gang(req)

    def _place_gang(self, req: Request) -> tuple[Placement | None, Decision]:
        """A gang: with a topology request, packed into the fewest domains at its level
        (``schedule.topology``); without, member by member (``_place_members``)."""
        topo = req.topology
        if topo is None:
            return self._place_members(req)
        found = place_gang(self.snapshot, req)
        if found.placement is not None:
            return found.placement, Decision(
                found.placement, None, f"{found.message}: {', '.join(found.placement.nodes)}",
                topology=found.info,
            )  # fmt: skip
        if not found.fits_elsewhere:
            # it does not fit even across domains: it waits for capacity like any gang (the
            # member-by-member search says which filters refused how many nodes)
            placement, d = self._place_members(replace(req, topology=None))
            if placement is None:
                return None, replace(d, topology=found.info)
            if topo.mode is TopologyMode.PREFERRED:  # cannot happen: the search spans all
                used = domains_of(self.snapshot, placement.nodes, topo.level)
                info = found.info | {"domains": used, "domains_used": len(used)}
                return placement, replace(d, topology=info)
        message = render(
            TOPOLOGY_UNSATISFIABLE,
            nodes=req.gpus.nodes,
            level=topo.level,
            most=found.info.get("most_in_one_domain", 0),
        )
        return None, Decision(None, TOPOLOGY_UNSATISFIABLE, message, {}, topology=found.info)

    def _place_members(self, req: Request) -> tuple[Placement | None, Decision]:
        """Best fit for each member in turn, each on a node no earlier member took; all or
        nothing. Nodes taken by earlier members are hidden by marking them cordoned in the
        snapshot for the duration of the search, then restored."""
        k, per = req.gpus.nodes, req.gpus.per_node
        member = member_request(req)
        parts: list[Placement] = []
        masked: list[Node] = []
        try:
            for i in range(k):
                d = self.snapshot.place(member)
                if d.placement is None:
                    rejections = dict(d.rejections)
                    if i:
                        left = rejections.get(NODE_NOT_ADMITTED, 0) - i
                        if left > 0:
                            rejections[NODE_NOT_ADMITTED] = left
                        else:
                            rejections.pop(NODE_NOT_ADMITTED, None)
                        rejections[GANG_NODE_TAKEN] = i
                    # Some compliant node took a member: the gang lacks capacity, not
                    # compliant nodes.
                    reason = INSUFFICIENT_CAPACITY if i else d.reason
                    return None, Decision(
                        None,
                        reason,
                        GANG_TEMPLATE.format(nodes=k, per_node=per, placed=i, message=d.message),
                        rejections,
                    )
                parts.append(d.placement)
                node = self.snapshot.node(d.placement.node)
                assert node is not None
                masked.append(node)
                self.snapshot.upsert_node(replace(node, state=NodeState.CORDONED))
        finally:
            for node in masked:
                self.snapshot.upsert_node(node)
        placement = Placement.of_parts(tuple(parts))
        return placement, Decision(placement, None, f"placed on {', '.join(placement.nodes)}")

    def schedule(
        self,
        job: Job,
        *,
        preempt: bool = True,
        repartition: bool = True,
        unready: AbstractSet[str] = frozenset(),
        defrag: Defrag | None = None,
        explain: bool = True,
    ) -> Outcome:
        """Decide for one pending job; when it is placed, its capacity is held at once.

        ``unready``: nodes that have not applied the network segment of the job (issue 14):
        none of them takes it, and a node that passes the compliance filters but is in this
        set counts under ``network_not_applied`` (the filter after ``missing_certification``).
        They are hidden for the decision as the gang search hides its taken nodes (marked
        cordoned), so repartitioning and preemption never pick them either.

        ``defrag`` (issue 17, §3; ``schedule.defrag.Defragmenter``): for a MIG request that
        neither fits nor gets an idle GPU repartitioned, a step before preemption that may move
        idle or restartable work to free a region; it returns the outcome when it places.
        ``explain`` False (trace replays retrying a queue): a single-node job that does not fit
        gets ``insufficient_capacity`` without its per-filter reasons, which are not worked
        out."""
        masked = [
            node
            for name in sorted(unready)
            if (node := self.snapshot.node(name)) is not None and node.state is NodeState.ADMITTED
        ]
        if not masked:
            return self._schedule(
                job, preempt=preempt, repartition=repartition, defrag=defrag, explain=explain
            )
        for node in masked:
            self.snapshot.upsert_node(replace(node, state=NodeState.CORDONED))
        try:
            out = self._schedule(
                job, preempt=preempt, repartition=repartition, defrag=defrag, explain=explain
            )
        finally:
            for node in masked:
                self.snapshot.upsert_node(node)
        if out.placement is not None or NODE_NOT_ADMITTED not in out.rejections:
            return out
        return self._network_outcome(out, job.request, masked)

    def _network_outcome(self, out: Outcome, req: Request, masked: list[Node]) -> Outcome:
        """``out`` with the hidden nodes counted under the filter that really refused them."""
        rejections = dict(out.rejections)
        uncertified = sum(1 for n in masked if missing_tags(req.tags, n.certifications))
        waiting = len(masked) - uncertified
        left = rejections[NODE_NOT_ADMITTED] - len(masked)
        if left > 0:
            rejections[NODE_NOT_ADMITTED] = left
        else:
            del rejections[NODE_NOT_ADMITTED]
        if uncertified:
            rejections[MISSING_CERTIFICATION] = (
                rejections.get(MISSING_CERTIFICATION, 0) + uncertified
            )
        if not waiting:
            return replace(out, rejections=rejections)
        rejections[NETWORK_NOT_APPLIED] = waiting
        ordered = {c: rejections[c] for c in FILTER_CODES if c in rejections}
        if out.reason == NO_COMPLIANT_CAPACITY:  # compliant nodes exist: they wait for the network
            compliant = sum(1 for n in self.snapshot.nodes() if _admitted_for(n, req.tags))
            return replace(
                out,
                reason=INSUFFICIENT_CAPACITY,
                message=render(INSUFFICIENT_CAPACITY, compliant=compliant,
                               blocking=blocking(ordered)),
                rejections=ordered,
            )  # fmt: skip
        return replace(
            out, message=NETWORK_NOTE.format(message=out.message, nodes=waiting), rejections=ordered
        )

    def _schedule(
        self,
        job: Job,
        *,
        preempt: bool,
        repartition: bool,
        defrag: Defrag | None = None,
        explain: bool = True,
    ) -> Outcome:
        req = job.request
        self.snapshot.observe(req)
        if self.carving is not None and req.gpus.mig_profile is not None:
            self.carving.observe(req.gpus.mig_profile, req.gpus.count)
        over = self.quota_excess(req.tenant, req.gpus)
        if over is not None:
            what = ", ".join(
                QUOTA_ITEM.format(kind=k, **cast("Mapping[str, object]", v))
                for k, v in over.items()
            )
            return Outcome(
                None,
                QUOTA_EXCEEDED,
                render(QUOTA_EXCEEDED, tenant=req.tenant, what=what),
                {QUOTA_EXCEEDED: len(self.snapshot)},
                {"quota": over},
            )
        searched = False  # whether a search already found no place
        if self.carving is not None and req.gpus.mig_profile is not None and req.gpus.nodes <= 1:
            # MIG carving: an existing free instance first, then new
            # instances in free space, before the full search works out a pending reason
            free = self.snapshot.find(req)
            if free is not None:
                return self._placed(job, free, f"placed on {free.node}")
            carved = self._carve(req)
            if carved is not None:
                got, changes = carved
                gpus = ", ".join(f"{c.node} GPU {c.gpu_index}" for c in changes)
                return replace(
                    self._placed(job, got, ""),
                    message=f"placed on {got.node} after carving {gpus}",
                    repartitions=changes,
                )
            searched = True
        spot: Placement | None
        placement: Placement | None
        if not explain and req.gpus.nodes <= 1:
            # a replay's retry: where, not why (no pending reason worked out)
            spot = None if searched else self.snapshot.find(req)
            reason = None if spot is not None else INSUFFICIENT_CAPACITY
            decision = Decision(spot, reason, UNEXPLAINED)
        else:
            spot, decision = self.place(req)
        if spot is not None:
            return self._placed(job, spot, decision.message, decision.topology)
        if decision.reason != INSUFFICIENT_CAPACITY:
            return Outcome(
                None, decision.reason, decision.message, dict(decision.rejections),
                {"topology": decision.topology} if decision.topology is not None else {},
            )  # fmt: skip
        if (
            repartition
            and self.repartition
            and req.gpus.mig_profile is not None
            and req.gpus.nodes <= 1
        ):
            found = self._repartition(req)
            if found is not None:
                placement, changes = found
                where = ", ".join(f"{c.node} GPU {c.gpu_index}" for c in changes)
                return replace(
                    self._placed(job, placement, f"placed on {placement.node}"),
                    message=f"placed on {placement.node} after repartitioning {where}",
                    repartitions=changes,
                )
        if defrag is not None and req.gpus.mig_profile is not None and req.gpus.nodes <= 1:
            moved = defrag(self, job)
            if moved is not None:
                return moved
        if preempt:
            victims = (
                self._preemption_victims(job)
                if req.gpus.nodes <= 1
                else self._gang_preemption_victims(job)
            )
            if victims:
                ranks = {v.key: self._rank.get(v.key) for v in victims}
                released = [self.release(v.key) for v in victims]
                placement, after = self.place(req)
                if placement is not None:
                    names = ", ".join(f"{v.tenant}/{v.name}" for v in victims)
                    return replace(
                        self._placed(job, placement, "", after.topology),
                        message=f"placed on {placement.node} by preempting {names}",
                        preempted=tuple(victims),
                    )
                for h in released:  # cannot happen (the search just showed it fits); be safe
                    if h is not None:
                        self.hold(h, rank=ranks[h.key])
        if not req.co_residency and (
            req.gpus.mig_profile is not None or req.gpus.share_milli is not None
        ):
            # the capacity count includes GPUs the co-residency rule closed: say so
            return Outcome(
                None,
                decision.reason,
                CO_RESIDENCY_NOTE.format(message=decision.message),
                dict(decision.rejections),
                {"co_residency": False},
            )
        return Outcome(
            None, decision.reason, decision.message, dict(decision.rejections),
            {"topology": decision.topology} if decision.topology is not None else {},
        )  # fmt: skip

    def _placed(
        self,
        job: Job,
        placement: Placement,
        message: str,
        topology: dict[str, object] | None = None,
    ) -> Outcome:
        self.hold(held_for(job, placement))
        return Outcome(placement, None, message, details={"topology": topology} if topology else {})

    # ------------------------------------------------------------------ carving

    def _carve(self, req: Request) -> tuple[Placement, tuple[Repartition, ...]] | None:
        """Add the request's instances to the free space of one certified node's MIG GPUs
        (the carver's plans, best first, then the node name), then place it there through
        the snapshot's filters and scorer; a node where it still does not fit (CPU, memory,
        tenancy) is restored and the next plan tried. Running instances are never touched."""
        carving = self.carving
        assert carving is not None
        g = req.gpus
        profile = g.mig_profile
        assert profile is not None
        for name, plan in carving.candidates(profile, g.count, allowed_models(g.model)):
            original = self.snapshot.node(name)
            if original is None or not _admitted_for(original, req.tags):
                continue
            if carving.tracked(name) is not original:
                # changed behind the index's back (state masks keep the inventory)
                tracked = carving.tracked(name)
                if tracked is None or tracked.gpus != original.gpus:
                    self._track(name)
                    continue
            if not self.snapshot.may_take(name, req):
                continue  # tenancy, model, CPU or memory refuse it whatever the layout
            after = dict(plan.layouts)
            node = replace(
                original,
                gpus=tuple(
                    replace(x, mig_instances=after[x.index]) if x.index in after else x
                    for x in original.gpus
                ),
            )
            self.snapshot.upsert_node(node)
            placement = self.snapshot.find(req)
            if placement is not None and placement.node == name:
                self._track(name)
                changes = tuple(
                    Repartition(
                        name,
                        x.index,
                        x.uuid,
                        x.mig_instances,
                        after[x.index],
                        carved=carved,
                        step="carve" if carved else "reclaim",
                    )
                    for x in original.gpus
                    if x.index in after
                    for carved in [set(x.mig_instances) <= set(after[x.index])]
                )
                return placement, changes
            self.snapshot.upsert_node(original)
        return None

    # ------------------------------------------------------------------ repartitioning

    def _repartition(self, req: Request) -> tuple[Placement, tuple[Repartition, ...]] | None:
        """Give idle MIG GPUs of one certified node new layouts until the request fits there.
        Nodes with the fewest idle GPUs are tried first (packing); a node whose changes do not
        make the request fit is restored as it was."""
        g = req.gpus
        profile = g.mig_profile
        assert profile is not None
        candidates: list[tuple[int, str, Node, list[int]]] = []
        for name in list(self.snapshot.idle_mig_nodes()):
            node = self.snapshot.node(name)
            if node is None or not _admitted_for(node, req.tags):
                continue
            if not self.snapshot.may_take(name, req):
                continue  # a node whose tenancy, model, CPU or memory refuse it: any layout
            busy = self.busy_gpus(node.name)
            idle = [
                gpu.index
                for gpu in node.gpus
                if gpu.mig_enabled
                and gpu.index not in busy
                and (g.model is None or gpu.model == g.model)
                and gpu.model in SKUS
                and SKUS[gpu.model].profile(profile) is not None
            ]
            if idle:
                candidates.append((len(node.gpus) - len(busy), node.name, node, idle))
        candidates.sort(key=lambda c: (c[0], c[1]))
        for _, _, original, indexes in candidates:
            node = original
            changes: list[Repartition] = []
            for index in indexes:
                gpu = next(x for x in node.gpus if x.index == index)
                layout = layout_for(gpu.model, profile, g.count)
                if layout is None or layout == tuple(
                    sorted(gpu.mig_instances, key=lambda i: i.start)
                ):
                    continue
                gpus = tuple(
                    replace(x, mig_instances=layout) if x.index == index else x for x in node.gpus
                )
                node = replace(node, gpus=gpus)
                self._set_node(node)
                changes.append(
                    Repartition(node.name, gpu.index, gpu.uuid, gpu.mig_instances, layout)
                )
                found = self.snapshot.find(req)
                if found is not None:
                    return found, tuple(changes)
            if changes:
                self._set_node(original)
        return None

    # ------------------------------------------------------------------ preemption

    def _preemption_victims(self, job: Job) -> list[Held]:
        """The smallest set of same-pool, lower-priority workloads on one compliant node whose
        eviction makes ``job`` placeable; [] when there is none. Changes nothing."""
        req = job.request
        by_node: dict[str, list[Held]] = {}
        for h, names in self._preemptible(job):
            for name in names:
                by_node.setdefault(name, []).append(h)  # ranked, as _preemptible yields them
        best: tuple[tuple[int, int, str], list[Held]] | None = None
        for name in sorted(by_node):
            chosen = self._victims_on(req, by_node[name])
            if not chosen:
                continue
            score = (len(chosen), max(h.priority for h in chosen), name)
            if best is None or score < best[0]:
                best = (score, chosen)
        return best[1] if best is not None else []

    def _preemptible(self, job: Job) -> list[tuple[Held, list[str]]]:
        """The workloads ``job`` may preempt (same pool, strictly lower priority), lowest
        priority first, then the most recently placed, each with the nodes of its parts that
        are admitted for ``job``'s tags (one name per such part; possibly none)."""
        tags = job.request.tags
        order = self._rank
        out: list[tuple[Held, list[str]]] = []
        for h in self._held.values():
            if h.pool != job.pool or h.priority >= job.priority:
                continue
            names = [
                part.node
                for part in h.placement.parts
                if (node := self.snapshot.node(part.node)) is not None and _admitted_for(node, tags)
            ]
            out.append((h, names))
        out.sort(key=lambda hn: (hn[0].priority, -order[hn[0].key]))
        return out

    def _gang_preemption_victims(self, job: Job) -> list[Held]:
        """Victims for a gang: same-pool, lower-priority workloads on any node admitted for
        its tags, lowest priority (then most recently placed) first. The shortest such prefix
        whose eviction lets the whole gang fit is found by bisection (a handful of gang
        searches, not one per candidate), then trimmed to the victims the gang needs gone;
        [] when even evicting every candidate would not make it fit. Changes nothing."""
        req = job.request
        ranked = [h for h, names in self._preemptible(job) if names]
        if not ranked or not self._fits_without(req, ranked):
            return []
        lo, hi = 1, len(ranked)  # the smallest n such that evicting ranked[:n] fits the gang
        while lo < hi:
            mid = (lo + hi) // 2
            if self._fits_without(req, ranked[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return self._victims_on(req, ranked[:lo])

    def _fits_without(self, req: Request, victims: list[Held]) -> bool:
        """Whether ``req`` could be placed were ``victims`` gone. Changes nothing (the victims
        keep their places in placement order)."""
        ranks = {h.key: self._rank.get(h.key) for h in victims}
        released = [h for h in victims if self.release(h.key) is not None]
        try:
            return self.place(req)[0] is not None
        finally:
            for h in released:
                self.hold(h, rank=ranks[h.key])

    def _victims_on(self, req: Request, ranked: list[Held]) -> list[Held]:
        released: list[Held] = []
        ranks = {h.key: self._rank.get(h.key) for h in ranked}
        try:
            fits = False
            for h in ranked:
                self.release(h.key)
                released.append(h)
                if self.place(req)[0] is not None:
                    fits = True
                    break
            if not fits:
                return []
            # Keep back every victim the job does not actually need gone.
            needed = list(released)
            for h in list(released):
                self.hold(h, rank=ranks[h.key])
                if self.place(req)[0] is not None:
                    needed.remove(h)
                    released.remove(h)
                else:
                    self.release(h.key)
            return needed
        finally:
            for h in released:
                self.hold(h, rank=ranks[h.key])
