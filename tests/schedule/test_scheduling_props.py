"""Property tests of the scheduling engine (hypothesis): random clusters, workloads, failures,
certification revocations, cancellations, repartitions and preemptions, driven the way the
service drives the engine (evict, then offer capacity to pending work by priority). After every
step:

* no compliance violation: every part of every placement is on an admitted node whose
  certifications include all of the workload's tags;
* no double allocation: a whole GPU has one holder and nothing else; a MIG instance has one
  holder and exists in the GPU's current layout; shares on a GPU sum to at most 1000;
* every MIG layout is valid for its SKU; a repartitioned GPU held nothing before;
* a dedicated-node workload shares its node with no other tenant;
* quotas hold; preemption victims are of the preemptor's pool with a lower priority;
* every pending workload has a reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    Node,
    NodeState,
    Quota,
    missing_tags,
)
from proofplane.schedule.engine import Job, Scheduler
from proofplane.schedule.mig import valid_layouts
from proofplane.schedule.quota import Cost, request_cost
from proofplane.schedule.values import Request

SKUS = ("H100-80GB", "A100-40GB")
CERT_CHOICES = (
    {},
    {"hipaa": "true"},
    {"gdpr-zone": "paris"},
    {"hipaa": "true", "gdpr-zone": "paris"},
)
TENANTS = ("t1", "t2", "t3")


@st.composite
def clusters(draw: st.DrawFn) -> list[Node]:
    nodes = []
    for n in range(draw(st.integers(2, 4))):
        sku = draw(st.sampled_from(SKUS))
        layouts = valid_layouts(sku)
        gpus = []
        for i in range(draw(st.integers(1, 3))):
            mig = draw(st.booleans())
            layout = layouts[draw(st.integers(0, len(layouts) - 1))] if mig else ()
            gpus.append(Gpu(i, f"GPU-n{n}-{i}", sku, 0, mig_enabled=mig, mig_instances=layout))
        nodes.append(
            Node(
                f"n{n}",
                "r",
                "z",
                certifications=dict(draw(st.sampled_from(CERT_CHOICES))),
                state=NodeState.ADMITTED,
                gpus=tuple(gpus),
            )
        )
    return nodes


@st.composite
def requests(draw: st.DrawFn) -> tuple[GpuRequest, IsolationLevel]:
    shape = draw(st.sampled_from(["whole", "dedicated", "mig", "share", "gang"]))
    if shape == "mig":
        sku = draw(st.sampled_from(SKUS))
        prof = draw(st.sampled_from([p.name for p in get_sku(sku).mig_profiles]))
        return GpuRequest(draw(st.integers(1, 2)), sku, prof), IsolationLevel.MIG
    if shape == "share":
        return GpuRequest(1, share_milli=draw(st.integers(1, 999))), IsolationLevel.SHARED
    if shape == "gang":
        k = draw(st.integers(2, 3))
        return GpuRequest(k * draw(st.integers(1, 2)), nodes=k), IsolationLevel.EXCLUSIVE_GPU
    iso = IsolationLevel.DEDICATED_NODE if shape == "dedicated" else IsolationLevel.EXCLUSIVE_GPU
    return GpuRequest(draw(st.integers(1, 3))), iso


SUBMIT = st.tuples(
    st.just("submit"),
    requests(),
    st.sampled_from(TENANTS),
    st.sampled_from(CERT_CHOICES[:2]),
    st.integers(0, 3),
)
OPS = st.one_of(
    SUBMIT,
    SUBMIT,
    SUBMIT,
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("fail"), st.integers(0, 5)),
    st.tuples(st.just("restore"), st.integers(0, 5)),
    st.tuples(st.just("revoke"), st.integers(0, 5), st.sampled_from(["hipaa", "gdpr-zone"])),
)


class Harness:
    """The service's loop, in memory."""

    def __init__(self, nodes: list[Node], quotas: dict[str, Quota]) -> None:
        self.s = Scheduler(nodes, quotas=quotas)
        self.original = {n.name: n for n in nodes}
        self.jobs: dict[int, Job] = {}
        self.pending: dict[int, str | None] = {}  # key → reason
        self.seq = 0

    def run(self, job: Job) -> None:
        before = {n.name: (n, self.s.busy_gpus(n.name)) for n in self.s.nodes()}
        out = self.s.schedule(job)
        for change in out.repartitions:
            node, busy = before[change.node]
            assert change.gpu_index not in busy, "repartitioned a GPU holding work"
            assert any(g.index == change.gpu_index and g.mig_enabled for g in node.gpus)
        if out.repartitions:
            event("repartitioned")
        if out.preempted:
            event("preempted")
            # evictions only buy a placement: never victims for a job that still waits
            assert out.placement is not None, "preempted without placing"
            if len(out.placement.parts) > 1:
                event("gang preempted")
        if out.placement is not None and len(out.placement.parts) > 1:
            event("gang placed")
        if out.reason:
            event(out.reason)
        for v in out.preempted:
            assert v.pool == job.pool and v.priority < job.priority
            self.pending[v.key] = "preempted"
        if out.placement is None:
            self.pending[job.key] = out.reason
        else:
            self.pending.pop(job.key, None)

    def reschedule(self) -> None:
        for _ in range(3):  # preempted victims get another turn
            order = sorted(self.pending, key=lambda k: (-self.jobs[k].priority, k))
            for key in order:
                if key in self.pending:
                    self.run(self.jobs[key])

    def evict(self, keys: list) -> None:
        for key in keys:
            self.s.release(key)
            self.pending[key] = "evicted"

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "submit":
            (g, iso), tenant, tags, prio = op[1:]
            self.seq += 1
            # the first tenant's profile refuses GPU co-residency
            private = tenant == TENANTS[0]
            req = Request(f"w{self.seq}", tenant, tags, iso, g, co_residency=not private)
            job = Job(self.seq, req, prio)
            self.jobs[self.seq] = job
            self.run(job)
        elif kind == "cancel":
            keys = sorted(self.jobs)
            if keys:
                key = keys[op[1] % len(keys)]
                self.s.release(key)
                self.jobs.pop(key)
                self.pending.pop(key, None)
        else:
            names = sorted(self.original)
            name = names[op[1] % len(names)]
            node = self.s.node(name)
            assert node is not None
            if kind == "fail":
                self.s.upsert_node(replace(node, state=NodeState.FAILED))
                self.evict([k for k, h in self.s.held.items() if name in h.placement.nodes])
            elif kind == "restore":
                self.s.upsert_node(replace(node, state=NodeState.ADMITTED))
            elif kind == "revoke":
                certs = {k: v for k, v in node.certifications.items() if k != op[2]}
                node = replace(node, certifications=certs)
                self.s.upsert_node(node)
                self.evict(
                    [
                        k
                        for k, h in self.s.held.items()
                        if name in h.placement.nodes
                        and missing_tags(self.jobs[k].request.tags, certs)
                    ]
                )
        self.reschedule()

    def check(self, quotas: dict[str, Quota]) -> None:
        s = self.s
        nodes = {n.name: n for n in s.nodes()}
        whole: Counter = Counter()
        mig: Counter = Counter()
        share: Counter = Counter()
        tenants: dict[str, set[str]] = {}
        dedicated: dict[str, str] = {}
        on_gpu: dict[tuple[str, int], set[tuple[str, bool]]] = {}  # slices and shares
        used: dict[str, Cost] = {}
        for key, h in s.held.items():
            job = self.jobs[key]
            assert key not in self.pending
            used[h.tenant] = used.get(h.tenant, Cost()) + request_cost(job.request.gpus)
            assert len(set(h.placement.nodes)) == len(h.placement.parts)  # gang: distinct nodes
            for part in h.placement.parts:
                node = nodes[part.node]
                assert node.state is NodeState.ADMITTED
                assert not missing_tags(job.request.tags, node.certifications), "compliance"
                tenants.setdefault(part.node, set()).add(h.tenant)
                if h.isolation is IsolationLevel.DEDICATED_NODE:
                    dedicated[part.node] = h.tenant
                gpus = {g.index: g for g in node.gpus}
                for d in part.devices:
                    gpu = gpus[d.gpu_index]
                    if d.mig_profile is not None or d.share_milli is not None:
                        holder = (h.tenant, job.request.co_residency)
                        on_gpu.setdefault((part.node, d.gpu_index), set()).add(holder)
                    if d.mig_profile is not None:
                        assert gpu.mig_enabled
                        assert any(
                            i.profile == d.mig_profile and i.start == d.mig_start
                            for i in gpu.mig_instances
                        ), "MIG instance not in the GPU's layout"
                        mig[(part.node, d.gpu_index, d.mig_start)] += 1
                    elif d.share_milli is not None:
                        assert not gpu.mig_enabled
                        share[(part.node, d.gpu_index)] += d.share_milli
                    else:
                        assert not gpu.mig_enabled
                        whole[(part.node, d.gpu_index)] += 1
        assert all(n == 1 for n in whole.values()), "a whole GPU held twice"
        assert all(n == 1 for n in mig.values()), "a MIG instance held twice"
        assert all(m <= 1000 for m in share.values()), "a GPU shared beyond 1000 milli"
        assert not set(whole) & set(share), "a whole GPU also shared"
        for name, owner in dedicated.items():
            assert tenants[name] == {owner}, "dedicated node shared"
        for where, holders in on_gpu.items():
            if len({t for t, _ in holders}) > 1:
                assert all(co for _, co in holders), f"co-residency refused but shared: {where}"
        for node in nodes.values():
            for gpu in node.gpus:
                if gpu.mig_enabled:
                    assert not layout_errors(get_sku(gpu.model), gpu.mig_instances)
        for tenant, cost in used.items():
            q = quotas.get(tenant, Quota())
            if q.gpus is not None:
                assert cost.gpu_milli <= q.gpus * 1000
            if q.mig_slices is not None:
                assert cost.mig_slices <= q.mig_slices
            assert s.used(tenant) == cost
        for key, reason in self.pending.items():
            assert reason, f"pending workload {key} without a reason"


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    nodes=clusters(),
    quotas=st.dictionaries(
        st.sampled_from(TENANTS),
        st.builds(
            Quota,
            st.one_of(st.none(), st.integers(0, 6)),
            st.one_of(st.none(), st.integers(0, 10)),
        ),
    ),
    ops=st.lists(OPS, min_size=4, max_size=25),
)
def test_random_operations_keep_every_invariant(
    nodes: list[Node], quotas: dict[str, Quota], ops: list[tuple]
) -> None:
    h = Harness(nodes, quotas)
    for op in ops:
        h.apply(op)
        h.check(quotas)
