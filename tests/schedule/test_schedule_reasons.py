"""The placement reason registry (``schedule.reasons``): every code a filter or a decision can
answer with is in it, every entry is one some part of placement answers with, no module spells
a code out instead of citing it, and the messages read exactly as they always have (users'
scripts match codes and messages)."""

from __future__ import annotations

import ast
import random
import string
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import proofplane
from proofplane.model import (
    KEEPS_WORK,
    NODE_TRANSITIONS,
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    Quota,
    TopologyMode,
    TopologyRequest,
)
from proofplane.schedule import reasons
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.explain import explain_job
from proofplane.schedule.reasons import (
    COMPLIANCE_FILTERS,
    EVICTED_BY_NODE_STATE,
    FILTER_CODES,
    REASONS,
    blocking,
    node_left_service,
    render,
)
from proofplane.schedule.reference import reference_place
from proofplane.schedule.snapshot import ClusterSnapshot
from proofplane.schedule.values import Allocation, Decision, Request

H100 = "H100-80GB"
SRC = Path(proofplane.__file__).parent


def node(
    name: str,
    gpus: int = 4,
    *,
    certs: dict[str, str] | None = None,
    state: NodeState = NodeState.ADMITTED,
    mig: bool = False,
) -> Node:
    layout = (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4)) if mig else ()
    return Node(
        name,
        "r",
        "z",
        certifications=dict(certs or {}),
        state=state,
        gpus=tuple(
            Gpu(i, f"GPU-{name}-{i}", H100, 81920, mig_enabled=mig, mig_instances=layout)
            for i in range(gpus)
        ),
    )


def request(
    tenant: str = "t",
    *,
    count: int = 1,
    model: str | None = None,
    tags: dict[str, str] | None = None,
    isolation: IsolationLevel = IsolationLevel.EXCLUSIVE_GPU,
    mig_profile: str | None = None,
    share: int | None = None,
    nodes: int = 1,
    co_residency: bool = True,
) -> Request:
    g = GpuRequest(count, model, mig_profile, share, nodes)
    return Request("w", tenant, dict(tags or {}), isolation, g, co_residency)


def alloc(
    on: str, tenant: str, isolation: IsolationLevel = IsolationLevel.EXCLUSIVE_GPU, gpu: int = 0
) -> Allocation:
    return Allocation(
        f"{tenant}-{on}-{gpu}", tenant, isolation, Placement(on, (PlacedDevice(gpu, "u"),))
    )


def both(req: Request, nodes: list[Node], allocations: list[Allocation]) -> Decision:
    """The snapshot's answer, checked against the reference's."""
    d = ClusterSnapshot(nodes, dict(enumerate(allocations))).place(req)
    assert d == reference_place(req, nodes, allocations)
    return d


# --- the registry itself -------------------------------------------------------------------------


def test_entries_are_keyed_by_their_code_and_say_what_they_mean() -> None:
    assert len(REASONS) == len({r.code for r in REASONS.values()})
    for code, r in REASONS.items():
        assert r.code == code
        assert set(code) <= set(string.ascii_lowercase + "_"), code
        assert r.kind in ("filter", "pending", "evicted", "ended")
        assert r.meaning and r.meaning == r.meaning.strip()
        assert (r.filter is not None) == (code in FILTER_CODES)
    assert set(FILTER_CODES) >= COMPLIANCE_FILTERS


def test_every_code_has_its_constant_and_every_constant_its_entry() -> None:
    constants = {
        name: value
        for name, value in vars(reasons).items()
        if name.isupper() and isinstance(value, str) and "{" not in value
    }
    assert set(constants.values()) == set(REASONS)
    assert all(name == value.upper() for name, value in constants.items())


def test_filter_codes_are_in_pipeline_order() -> None:
    assert FILTER_CODES == (
        "node_not_admitted",
        "missing_certification",
        "network_not_applied",
        "node_dedicated_to_other_tenant",
        "node_shared_with_other_tenant",
        "gpu_model_unavailable",
        "insufficient_cpu",
        "insufficient_memory",
        "insufficient_gpu_capacity",
        "gang_node_taken",
        "quota_exceeded",
    )


def test_every_node_state_that_evicts_has_its_reason() -> None:
    reachable = {t for targets in NODE_TRANSITIONS.values() for t in targets}
    assert set(EVICTED_BY_NODE_STATE) == reachable - KEEPS_WORK
    for state, code in EVICTED_BY_NODE_STATE.items():
        assert code == f"node_{state.value}" and REASONS[code].kind == "evicted"


def test_a_reason_without_a_template_has_no_message() -> None:
    with pytest.raises(ValueError, match="backend_unavailable"):
        render(reasons.BACKEND_UNAVAILABLE)
    with pytest.raises(ValueError, match="backend_unavailable"):
        reasons.template(reasons.BACKEND_UNAVAILABLE)
    assert reasons.template("cancelled") == "cancelled by {actor}"


# --- every code a filter or decision answers with is in the registry, and the reverse ------------


def scenarios() -> list[tuple[Request, list[Node], list[Allocation]]]:
    """One placement per filter code, each node rejected by exactly the filter named."""
    return [
        (request(), [node("a", state=NodeState.CORDONED)], []),
        (request(tags={"hipaa": "true"}), [node("a")], []),
        (request(), [node("a", 1)], [alloc("a", "o", IsolationLevel.DEDICATED_NODE)]),
        (request(isolation=IsolationLevel.DEDICATED_NODE), [node("a", 2)], [alloc("a", "o")]),
        (request(model="B200"), [node("a")], []),
        (request(count=8), [node("a")], []),
        (request(mig_profile="1g.10gb"), [node("a", 1, mig=True)], []),
        (request(share=600), [node("a", 1)], [alloc("a", "o")]),
        # issue 17: CPU and memory are filtered like GPUs
        (replace(request(), cpu_milli=2000), [replace(node("a"), cpu_milli=1000)], []),
        (replace(request(), memory_mib=4096), [replace(node("a"), memory_mib=1024)], []),
    ]


def observed_codes() -> tuple[Counter[str], Counter[str]]:
    """(rejection codes, decision reasons) met over the scenarios and a random sweep, from the
    snapshot, the reference, the engine (quota, gangs) and the explainer."""
    rejections: Counter[str] = Counter()
    decided: Counter[str] = Counter()

    def note(d: Decision) -> None:
        rejections.update(d.rejections)
        if d.reason is not None:
            decided[d.reason] += 1

    for req, nodes, allocations in scenarios():
        note(both(req, nodes, allocations))
    rng = random.Random(18)
    models = [H100, "B200", None]
    for _ in range(300):
        nodes = [
            node(
                f"n{i}",
                rng.randint(1, 4),
                certs={"hipaa": "true"} if rng.random() < 0.5 else {},
                state=rng.choice([NodeState.ADMITTED, NodeState.ADMITTED, NodeState.FAILED]),
                mig=rng.random() < 0.3,
            )
            for i in range(rng.randint(0, 4))
        ]
        allocations = [
            alloc(n.name, rng.choice("tuv"), rng.choice(list(IsolationLevel)))
            for n in nodes
            if rng.random() < 0.5
        ]
        req = request(
            rng.choice("tuv"),
            count=rng.randint(1, 5),
            model=rng.choice(models),
            tags={"hipaa": "true"} if rng.random() < 0.5 else {},
            isolation=rng.choice(list(IsolationLevel)),
        )
        note(both(req, nodes, allocations))
    # the engine: the quota PreFilter and a gang
    s = Scheduler([node("a"), node("b")], quotas={"t": Quota(gpus=1)})
    out = s.schedule(Job("q", request(count=2)))
    note(Decision(out.placement, out.reason, out.message, out.rejections))
    s = Scheduler([node("a", 2), node("b", 1)])
    out = s.schedule(Job("g", request(count=4, nodes=2)))
    note(Decision(out.placement, out.reason, out.message, out.rejections))
    # the engine: a gang that requires one rack where no rack holds it (issue 17 §4)
    s = Scheduler([replace(node("a"), rack="r1"), replace(node("b"), rack="r2")])
    topo = TopologyRequest("rack", TopologyMode.REQUIRED)
    out = s.schedule(Job("r", replace(request(count=2, nodes=2), topology=topo)))
    note(Decision(out.placement, out.reason, out.message, out.rejections))
    # the engine: a node that has not applied the job's network segment (issue 14)
    s = Scheduler([node("a"), node("b", certs={"hipaa": "true"})])
    out = s.schedule(Job("n", request(tags={"hipaa": "true"})), unready=frozenset({"b"}))
    note(Decision(out.placement, out.reason, out.message, out.rejections))
    # the explainer counts nodes per filter with the same codes
    s = Scheduler([node("a", state=NodeState.FAILED), node("b")], quotas={"t": Quota(gpus=0)})
    rejections.update(explain_job(s, Job("x", request(tags={"k": "v"})))["filters"])
    return rejections, decided


def test_every_code_a_filter_answers_with_is_registered_and_every_filter_code_occurs() -> None:
    rejections, decided = observed_codes()
    assert set(rejections) == set(FILTER_CODES)
    pending = {code for code, r in REASONS.items() if r.kind == "pending"}
    assert set(decided) == pending


# --- no bare reason codes outside the registry ---------------------------------------------------

# The same words with another meaning: (file under src/proofplane, word) → how many times, why.
OTHER_MEANINGS: dict[tuple[str, str], tuple[int, str]] = {
    ("model/workload.py", "cancelled"): (1, "WorkloadStatus.CANCELLED, a status"),
    ("backends/base.py", "cancelled"): (1, "an engine job's state"),
    ("backends/base.py", "backend_unavailable"): (1, "the BackendUnavailable error's code"),
    ("backends/local.py", "cancelled"): (1, "an engine job's message"),
    ("service/jobs.py", "cancelled"): (1, "an engine job's state"),
    ("service/reconcile.py", "cancelled"): (1, "an engine job's state"),
    ("cli/render.py", "cancelled"): (2, "the style of the cancelled status"),
    ("cli/workloads.py", "cancelled"): (1, "the status word the CLI prints"),
    ("govern/changes.py", "cancelled"): (1, "a change request's state"),
    ("cli/changes.py", "cancelled"): (1, "the style of a cancelled change request"),
    ("audit/export/ocsf.py", "cancelled"): (1, "the verb of a workload.cancelled event"),
    ("service/nodes.py", "node_not_admitted"): (1, "an error code: only admitted nodes certify"),
    ("service/attestation.py", "node_decommissioned"): (1, "an error code: no attestation"),
    ("service/scheduling.py", "preempted"): (1, "an event's list of the workloads preempted"),
    # service/execution.py owns the constant the dispatch evicts with; it must stay the same
    # word as the registry's (checked below).
    ("service/execution.py", "backend_unavailable"): (1, "BACKEND_UNAVAILABLE"),
}


def bare_codes() -> Counter[tuple[str, str]]:
    """String literals (and f-string heads such as ``f"node_{state}"``) that spell a reason
    code, per file, outside the registry."""
    codes = set(REASONS)
    found: Counter[tuple[str, str]] = Counter()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "schedule/reasons.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in codes:
                found[(rel, n.value)] += 1
            elif isinstance(n, ast.JoinedStr) and len(n.values) > 1:
                head = n.values[0]
                if (
                    isinstance(head, ast.Constant)
                    and isinstance(head.value, str)
                    and head.value.endswith("_")
                    and any(c.startswith(head.value) for c in codes)
                ):
                    found[(rel, head.value + "{…}")] += 1
    return found


def test_no_module_spells_a_reason_code_out() -> None:
    unexplained = {
        where: n
        for where, n in bare_codes().items()
        if where not in OTHER_MEANINGS or n > OTHER_MEANINGS[where][0]
    }
    assert not unexplained, f"cite schedule.reasons instead: {unexplained}"


def test_the_schedule_package_cites_every_code_it_answers_with() -> None:
    assert not [where for where in bare_codes() if where[0].startswith("schedule/")]


def test_the_dispatch_evicts_with_the_registered_code() -> None:
    from proofplane.service import execution

    assert execution.BACKEND_UNAVAILABLE == reasons.BACKEND_UNAVAILABLE


# --- the messages read exactly as before ---------------------------------------------------------


def test_pending_messages() -> None:
    d = both(request(tags={"hipaa": "true"}), [node("a"), node("b")], [])
    assert d.reason == "no_compliant_capacity"
    assert d.message == "none of 2 nodes is admitted and certified for {'hipaa': 'true'}"
    d = both(request(), [node("a", state=NodeState.FAILED)], [])
    assert d.message == "none of 1 nodes is admitted and certified for this"
    d = both(
        request(count=2),
        [node("a", 1), node("b", 4, certs={"x": "y"}), node("c", state=NodeState.CORDONED)],
        [alloc("b", "o", IsolationLevel.DEDICATED_NODE)],
    )
    assert d.reason == "insufficient_capacity"
    assert d.message == (
        "2 node(s) are admitted and certified, none can take it now "
        "(insufficient_gpu_capacity on 1, node_dedicated_to_other_tenant on 1)"
    )
    assert d.rejections == {
        "node_not_admitted": 1,
        "node_dedicated_to_other_tenant": 1,
        "insufficient_gpu_capacity": 1,
    }
    assert blocking(d.rejections) == (
        "insufficient_gpu_capacity on 1, node_dedicated_to_other_tenant on 1"
    )


def test_quota_gang_and_co_residency_messages() -> None:
    s = Scheduler([node("a")], quotas={"t": Quota(gpus=1, mig_slices=2)})
    out = s.schedule(Job("q", request(count=2)))
    assert (out.reason, out.message) == (
        "quota_exceeded",
        "tenant 't' quota would be exceeded (gpus: 0 used + 2 asked > 1)",
    )
    assert out.rejections == {"quota_exceeded": 1}
    out = s.schedule(Job("m", request(mig_profile="3g.40gb", count=1)))
    assert out.message == "tenant 't' quota would be exceeded (mig_slices: 0 used + 3 asked > 2)"

    s = Scheduler([node("a", 2), node("b", 1), node("c", state=NodeState.FAILED)])
    out = s.schedule(Job("g", request(count=4, nodes=2)))
    assert out.reason == "insufficient_capacity"
    assert out.message == (
        "a gang of 2 nodes x 2 GPUs: only 1 node(s) can take a member (1 node(s) are admitted "
        "and certified, none can take it now (insufficient_gpu_capacity on 1))"
    )
    assert out.rejections == {"node_not_admitted": 1, "gang_node_taken": 1,
                              "insufficient_gpu_capacity": 1}  # fmt: skip
    out = s.schedule(Job("h", request(count=4, nodes=2, tags={"k": "v"})))
    assert out.reason == "no_compliant_capacity"
    assert out.message == (
        "a gang of 2 nodes x 2 GPUs: only 0 node(s) can take a member (none of 3 nodes is "
        "admitted and certified for {'k': 'v'})"
    )

    a = node("a", 1, mig=True)
    s = Scheduler(
        [a],
        [
            Held(
                "o",
                "o",
                "other",
                IsolationLevel.MIG,
                0,
                pool_of({}),
                Placement("a", (PlacedDevice(0, "u", mig_profile="3g.40gb", mig_start=0),)),
            )
        ],
    )
    out = s.schedule(
        Job("c", request(mig_profile="3g.40gb", co_residency=False, isolation=IsolationLevel.MIG)),
        repartition=False,
    )
    assert out.reason == "insufficient_capacity"
    assert out.message == (
        "1 node(s) are admitted and certified, none can take it now (insufficient_gpu_capacity "
        "on 1); its tenant refuses GPU co-residency, so GPUs holding another tenant's MIG "
        "slices or shares are closed to it"
    )
    assert out.details == {"co_residency": False}


def test_eviction_and_cancel_messages() -> None:
    assert render("preempted", by="t/w", priority=5, victim_priority=1, pool={"hipaa": "true"}) == (
        "preempted by t/w (priority 5 > 1, same compliance pool {'hipaa': 'true'})"
    )
    assert render("certification_revoked", node="a", lost={"hipaa": "true"}) == (
        "node a no longer certified for {'hipaa': 'true'}"
    )
    assert node_left_service("a", NodeState.FAILED, "PSU fault") == (
        "node_failed",
        "node a is failed: PSU fault",
    )
    assert node_left_service("a", NodeState.QUARANTINED, None) == (
        "node_quarantined",
        "node a is quarantined",
    )
    assert node_left_service("a", NodeState.DECOMMISSIONED, "") == (
        "node_decommissioned",
        "node a is decommissioned",
    )
    assert render("cancelled", actor="admin") == "cancelled by admin"
