"""MIG under arrivals and departures (``proofplane.sim.dynamic``): the replay places through
the production scheduler, departures free capacity, FIFO with backfill, patience, and the
scheduler's invariants under random streams (hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mig_invariants import check_scheduler
from proofplane.cli import sim as sim_cli
from proofplane.model import Placement
from proofplane.schedule.engine import Job, Scheduler
from proofplane.schedule.migslots import LeastFragmenting
from proofplane.schedule.scoring import make_scorer
from proofplane.sim import dynamic, mig
from proofplane.sim.dynamic import DynamicStream, Move, Timed
from proofplane.sim.mig import MigRequest
from proofplane.sim.trace import Node

runner = CliRunner()
PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def _stream(rows: list[tuple[str, float, float]], gpus: int = 1, nodes: int = 1) -> DynamicStream:
    """(profile, arrival, duration) rows on ``nodes`` nodes of ``gpus`` MIG GPUs."""
    items = [Timed(MigRequest(f"r{i}", 0, 0, p), a, d) for i, (p, a, d) in enumerate(rows)]
    ns = [Node(f"n{i}", 256_000, 1 << 20, gpus, "x") for i in range(nodes)]
    end = max(a for _p, a, _d in rows)
    return DynamicStream(items, ns, list(range(nodes)), 1.0, 1.0, end)


def test_the_replay_places_what_the_server_core_places() -> None:
    """The same requests given straight to ``schedule.engine.Scheduler`` (built here from
    ``schedule/`` alone, not through ``sim/``) land on the same nodes, GPUs and slots: the
    replay has no placement of its own."""
    rows = [(PROFILES[(i * 7) % 6], float(i), 1e6) for i in range(60)]
    stream = _stream(rows, gpus=4, nodes=3)
    res = dynamic.replay_dynamic(stream, "proofplane", record_placements=True)
    nodes = [mig.cluster_node(n, r) for n, r in zip(stream.nodes, stream.rank, strict=True)]
    core = Scheduler(nodes, scorer=make_scorer("proofplane"), carver=LeastFragmenting())
    direct: list[Placement | None] = []
    for i, t in enumerate(stream.items):
        out = core.schedule(Job(i, mig.mig_request(t.request)), preempt=False, repartition=False)
        direct.append(out.placement)
    assert res.placements == direct
    assert sum(p is not None for p in direct) == res.accepted > 0


def test_departures_free_capacity_and_the_waiter_gets_it() -> None:
    stream = _stream([("7g.80gb", 0.0, 10.0), ("7g.80gb", 1.0, 50.0), ("7g.80gb", 100.0, 1.0)])
    res = dynamic.replay_dynamic(stream, "first-slot-best-fit", patience=600, tick=5)
    assert res.accepted == 3 and res.rejected == 0
    assert res.waits[1] == pytest.approx(14.0)  # freed at 10 s, the next tick at 15 s
    assert res.waits[2] == 0  # the idle 7g instance is reused
    assert res.carved == 1  # instances persist: one carved, reused twice
    assert res.compute_hours == pytest.approx((10 + 50) / 3600)


def test_patience_rejects_and_says_why() -> None:
    stream = _stream([("7g.80gb", 0.0, 5000.0), ("3g.40gb", 1.0, 10.0), ("1g.10gb", 900.0, 1.0)])
    res = dynamic.replay_dynamic(stream, "proofplane", patience=600, tick=5)
    assert res.accepted == 1 and res.rejected == 1
    assert res.rejected_why["capacity"] == 1
    assert res.waiting_at_end == 1  # the last one still waits at the horizon


def test_fifo_with_backfill() -> None:
    """A 4g runs; the head (7g) waits; a 3g that fits behind it is placed at once (backfill);
    when the 4g leaves the 7g still waits for the 3g; then the idle 4g and 3g instances are
    reclaimed and it is placed."""
    stream = _stream(
        [
            ("4g.40gb", 0.0, 100.0),
            ("7g.80gb", 1.0, 10.0),
            ("3g.40gb", 2.0, 150.0),
            ("1g.10gb", 400.0, 1.0),
        ]
    )
    res = dynamic.replay_dynamic(
        stream, "proofplane+repartition", patience=600, tick=5, record_placements=True
    )
    assert res.placements[2] is not None  # backfilled while the head waits
    assert res.accepted == 4
    assert res.waits[0] == 0 and res.waits[1] == 0  # the 4g, then the 3g, at once
    assert res.waits[2] == pytest.approx(157.0 - 1.0)  # 7g: the 3g left at 152, tick at 157
    assert res.repartitions >= 1


def test_defrag_hook_moves_are_applied_and_counted() -> None:
    stream = _stream([("7g.80gb", 0.0, 100.0), ("7g.80gb", 1.0, 10.0), ("1g.10gb", 300.0, 1.0)])
    calls: list[float] = []

    def hook(sched: Scheduler, head: object, now: float) -> list[Move]:
        calls.append(now)
        if len(calls) > 1:
            return []
        key = next(iter(sched.held))
        return [Move(key, sched.held[key].placement)]  # a no-op move, counted

    res = dynamic.replay_dynamic(stream, "proofplane", patience=600, tick=5, defrag=hook)
    assert res.moves == 1 and calls


def _fragmented() -> DynamicStream:
    """Two GPUs: a short 4g and a long 4g, one on each, and two long 1g next to the short one.
    When the short 4g has left, a 7g arrives: no GPU is free, but the long 4g could move into
    the idle 4g instance the short one left."""
    rows = [("4g.40gb", 0.0, 50.0), ("4g.40gb", 1.0, 1e5), ("1g.10gb", 2.0, 1e5),
            ("1g.10gb", 3.0, 1e5), ("7g.80gb", 60.0, 10.0), ("1g.10gb", 1000.0, 1.0)]  # fmt: skip
    return _stream(rows, gpus=2)


def _slot(p: Placement | None) -> tuple[int, str | None, int | None] | None:
    if p is None:
        return None
    d = p.devices[0]
    return d.gpu_index, d.mig_profile, d.mig_start


def test_defrag_policy_moves_work_to_free_a_region() -> None:
    """The engine's defragmenter, as the server runs it: the waiting 7g is placed after the
    long 4g moves into the idle 4g instance on the other GPU; the move is counted and the
    moved work is held at its target (no GPU holds two things in one place)."""
    stream = _fragmented()
    plain = dynamic.replay_dynamic(stream, "proofplane+repartition", record_placements=True)
    assert [_slot(p) for p in plain.placements[:4]] == [
        (0, "4g.40gb", 0), (1, "4g.40gb", 0), (0, "1g.10gb", 4), (0, "1g.10gb", 5)
    ]  # fmt: skip
    assert plain.placements[4] is None and plain.moves == 0  # without defrag the 7g waits
    res = dynamic.replay_dynamic(
        stream, "proofplane+repartition+defrag", record_placements=True, move_share=1.0
    )
    assert res.moves == 1 and res.rejected == 0
    assert res.defrag_plans == 1 and res.summary()["defrag_plans"] == 1
    assert plain.defrag_plans == 0 and plain.defrag_refused == {}  # no defragmenter there
    assert _slot(res.placements[1]) == (0, "4g.40gb", 0)  # the long 4g, moved
    assert _slot(res.placements[4]) == (1, "7g.80gb", 0)  # the 7g, on the GPU it freed
    assert res.summary()["moves_pct_of_instances"] == round(100 / res.placed_instances, 3)


def test_defrag_policy_keeps_its_move_budget() -> None:
    """At the default cap (2 % of the instances placed so far) four placements allow no move:
    the 7g waits past its patience, as without defragmentation."""
    res = dynamic.replay_dynamic(_fragmented(), "proofplane+repartition+defrag")
    assert res.moves == 0 and res.rejected == 1
    assert res.defrag_plans == 0
    assert res.summary()["defrag_refused"] == {"move_budget_exhausted": 1}  # tried once
    with pytest.raises(mig.MigSimError, match="move_share"):
        dynamic.replay_dynamic(_fragmented(), "proofplane+repartition+defrag", move_share=1.5)


def test_the_fragmentation_free_reference_places_what_gpus_cannot_hold() -> None:
    """Two GPUs each run a long 4g (3 slices free on each, 6 in all): a third 4g cannot be
    placed on any GPU and is rejected after its patience, but fits the pool of slices; the
    1g behind it fits both."""
    rows = [("4g.40gb", 0.0, 1e4), ("4g.40gb", 1.0, 1e4), ("4g.40gb", 2.0, 10.0)]
    stream = _stream([*rows, ("1g.10gb", 3.0, 10.0), ("1g.10gb", 9.0, 1.0)], gpus=2)
    res = dynamic.replay_dynamic(stream, "proofplane", patience=5, tick=1)
    assert (res.accepted, res.rejected) == (4, 1)
    assert res.rejected_why == {"capacity": 0, "fragmentation": 1, "layout": 0}
    ref = dynamic.replay_pooled(stream, patience=5, tick=1)
    assert ref.policy == dynamic.REFERENCE
    assert (ref.accepted, ref.rejected, ref.waiting_at_end) == (5, 0, 0)
    assert ref.carved == ref.repartitions == ref.moves == 0
    # 4 + 4 + 4 slices held from 0, 1 and 2 s, a 1g from 3 s and one at 9 s, to the horizon
    assert ref.compute_hours == pytest.approx((4 * 9 + 4 * 8 + 4 * 7 + 6 + 0) / 7 / 3600)


def test_the_reference_waits_rejects_and_releases_like_the_replay() -> None:
    """The pool keeps the replay's clock: a waiter is placed at the tick after a departure,
    one that waits past its patience is rejected (for capacity), the horizon censors."""
    stream = _stream([("7g.80gb", 0.0, 10.0), ("7g.80gb", 1.0, 50.0), ("7g.80gb", 100.0, 1.0)])
    ref = dynamic.replay_pooled(stream, patience=600, tick=5)
    assert ref.accepted == 3 and ref.rejected == 0
    assert ref.waits == pytest.approx([0.0, 14.0, 0.0])
    assert ref.compute_hours == pytest.approx((10 + 50) / 3600)
    stream = _stream([("7g.80gb", 0.0, 5000.0), ("3g.40gb", 1.0, 10.0), ("1g.10gb", 900.0, 1.0)])
    ref = dynamic.replay_pooled(stream, patience=600, tick=5)
    assert (ref.accepted, ref.rejected, ref.waiting_at_end) == (1, 1, 1)
    assert ref.rejected_why["capacity"] == 1 and ref.free_at_rejection == [0]
    with pytest.raises(mig.MigSimError):
        dynamic.replay_pooled(stream, patience=-1)


def test_offered_load_is_what_was_asked() -> None:
    nodes = [Node(f"n{i}", 96_000, 393_216, 8, "x") for i in range(4)]
    reqs = [MigRequest(f"r{i}", 0, 0, PROFILES[i % 6]) for i in range(3000)]
    arrivals = [float(i * 7) for i in range(3000)]
    durations = [float(300 + (i * 37) % 5000) for i in range(3000)]
    slices = [dynamic.request_slices(r) for r in reqs]
    for load in (1.0, 1.3, 1.6):
        s = dynamic.compress(reqs, arrivals, durations, nodes, [0, 1, 2, 3], load)
        got = dynamic.offered_load([t.arrival for t in s.items], durations, slices, 4 * 8 * 7)
        assert got == pytest.approx(load, rel=1e-3)
        assert all(t.arrival + t.duration <= s.end + 1e-6 for t in s.items)
    with pytest.raises(mig.MigSimError, match="cannot offer"):
        dynamic.synthetic_dynamic(nodes, 42, 5.0, n=10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(PROFILES),
            st.floats(0, 500, allow_nan=False),
            st.floats(0.5, 400, allow_nan=False),
        ),
        min_size=1,
        max_size=40,
    ),
    policy=st.sampled_from(dynamic.POLICIES),
)
def test_random_streams_keep_every_invariant(
    rows: list[tuple[str, float, float]], policy: str
) -> None:
    """No double allocation, every MIG layout valid, no instance in use destroyed, CPU and
    memory within capacity, compliance never violated: checked at every queue retry (the
    defrag hook is the probe) and at the end."""
    rows.sort(key=lambda r: r[1])
    stream = _stream(rows, gpus=2, nodes=2)
    seen: list[Scheduler] = []

    def probe(sched: Scheduler, head: object, now: float) -> list[Move]:
        check_scheduler(sched)
        seen.append(sched)
        return []

    res = dynamic.replay_dynamic(stream, policy, patience=60, tick=3, defrag=probe, move_share=0.25)
    assert res.accepted + res.rejected + res.waiting_at_end == len(rows)
    if policy in dynamic.DEFRAG_POLICIES:  # the engine's moves, within their cap
        assert res.moves <= 0.25 * res.placed_instances
    else:
        assert res.moves == 0
    for sched in seen[-1:]:
        check_scheduler(sched)
    ref = dynamic.replay_pooled(stream, patience=60, tick=3)
    assert ref.accepted + ref.rejected + ref.waiting_at_end == len(rows)
    assert ref.rejected == ref.rejected_why["capacity"]  # a pool only ever lacks capacity
    capacity_hours = 2 * 2 * stream.end / 3600  # four GPUs over the horizon
    assert ref.compute_hours <= capacity_hours + 1e-9


def test_cli_dynamic_json(tmp_path: Path) -> None:
    pods = (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        + "".join(
            f"p{i},1000,1024,1,{[100, 250, 400, 1000][i % 4]},,LS,Running,"
            f"{i * 60},{i * 60 + 900},0\n"
            for i in range(200)
        )
    )
    nodes = "".join(
        ["sn,cpu_milli,memory_mib,gpu,model\n"] + [f"n{i},64000,262144,2,T4\n" for i in range(3)]
    )
    pf, nf = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pf.write_text(pods)
    nf.write_text(nodes)
    args = ["openb", "--pods", str(pf), "--nodes", str(nf), "--mig", "--dynamic", "--seeds", "1"]
    out = runner.invoke(sim_cli.app, [*args, "--load", "1.3", "--mix", "openb", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["engine"] == "proofplane.schedule" and doc["mode"] == "mig-dynamic"
    cell = doc["mixes"]["openb"]["130%"]
    assert set(cell["policies"]) == {*dynamic.POLICIES, dynamic.REFERENCE}
    assert dynamic.REFERENCE in cell["accepted_vs_baseline"]
    assert dynamic.REFERENCE in doc["definitions"]
    assert cell["accepted_vs_baseline"]["first-slot-best-fit"] == 1.0
    rec = cell["policies"]["proofplane"][0]
    for key in ("accepted", "accepted_ratio", "gpu_compute_hours", "wait_mean_s", "wait_p95_s",
                "repartitions", "moves_pct_of_instances", "rejected_why"):  # fmt: skip
        assert key in rec
    bad = runner.invoke(sim_cli.app, ["openb", "--pods", str(pf), "--nodes", str(nf), "--dynamic"])
    assert bad.exit_code != 0 and "--dynamic needs --mig" in bad.output
