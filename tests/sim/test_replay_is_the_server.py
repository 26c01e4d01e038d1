"""The replay places as the server does (issue 17, §1): the same stream of trace pods, once
through ``sim.engine.replay`` and once as workloads through the API's batch submit
(``POST /api/v1/workloads/batch``, persisted, on a cluster loaded from a cluster file with the
trace's plain GPU models, CPU and memory), lands on the same nodes and the same GPUs. The same
for MIG (§2): a stream of MIG requests through ``sim.mig.replay_mig`` and through the batch
submit, the server carving instances as the replay does, lands on the same nodes, GPUs,
profiles and start slots, and the GPUs' layouts end the same."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_nodes import register_admitted
from proofplane import config
from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import Placement
from proofplane.schedule.policy import server_policy as layout_policy
from proofplane.schedule.scoring import DEFAULT_SCORER
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.scheduling import (
    SCORER_ENV,
    scheduler_cache,
    server_policy,
    server_scheduler,
)
from proofplane.sim import dynamic, mig
from proofplane.sim.engine import TENANT, cluster_node, replay, scorer_for
from proofplane.sim.gorand import GoRand
from proofplane.sim.trace import Node, Pod, build_arrivals, typical_pods

API = "/api/v1"


def small_trace(seed: int = 11) -> tuple[list[Pod], list[Node]]:
    """A few trace-like nodes (plain models, CPU, memory) and pods of every kind: shares,
    whole GPUs, several GPUs, CPU-only, model-pinned (with alternatives)."""
    rng = random.Random(seed)
    models = ("T4", "V100M16", "P100")
    nodes = [
        Node(f"n{i:02d}", rng.choice([16000, 32000, 64000]), 65536, rng.choice([1, 2, 4]),
             models[i % 3])
        for i in range(10)
    ]  # fmt: skip
    pods = []
    for i in range(60):
        kind = rng.random()
        cpu = rng.choice([1000, 2000, 4000, 8000])
        mem = rng.choice([1024, 4096, 16384])
        if kind < 0.45:
            pods.append(Pod(f"p{i:03d}", cpu, mem, 1, rng.choice([250, 500, 700])))
        elif kind < 0.7:
            pods.append(Pod(f"p{i:03d}", cpu, mem, 1, 1000))
        elif kind < 0.8:
            pods.append(Pod(f"p{i:03d}", cpu, mem, 2, 1000, ("V100M16", "P100")))
        elif kind < 0.9:
            pods.append(Pod(f"p{i:03d}", cpu, mem, 1, 500, ("T4",)))
        else:
            pods.append(Pod(f"p{i:03d}", cpu, mem, 0, 0))
    return pods, nodes


def cluster_text(nodes: list[Node], rank: list[int]) -> str:
    """The trace's nodes as a cluster file: named by rank as the replay names them."""
    doc: dict[str, Any] = {
        "cluster": "openb-small",
        "tenants": [{"name": TENANT}],
        "nodes": [
            {
                "name": cluster_node(n, r).name,
                "region": "openb",
                "zone": "openb",
                "cpu_milli": n.cpu,
                "memory_mib": n.mem,
                "gpus": [{"model": n.model, "count": n.gpus}] if n.gpus else [],
            }
            for n, r in zip(nodes, rank, strict=True)
        ],
    }
    return json.dumps(doc)


def workload_body(pod: Pod) -> dict[str, Any]:
    gpus: dict[str, Any] = {"count": pod.k if pod.m else 0}
    if pod.spec:
        gpus["model"] = "|".join(pod.spec)
    if pod.k == 1 and 0 < pod.m < 1000:
        gpus["share_milli"] = pod.m
    return {
        "name": pod.name,
        "tenant": TENANT,
        "gpus": gpus,
        "cpu_milli": pod.cpu,
        "memory_mib": pod.mem,
    }


def where(p: Placement | dict[str, Any] | None) -> tuple[Any, ...] | None:
    """(node, (GPU index, share) per device): what both sides must agree on."""
    if p is None:
        return None
    if isinstance(p, Placement):
        return (p.node, tuple((d.gpu_index, d.share_milli) for d in p.devices))
    return (p["node"], tuple((d["gpu_index"], d["share_milli"]) for d in p["devices"]))


def test_batch_submit_places_as_the_replay(store: Store, client: TestClient) -> None:
    pods, nodes = small_trace()
    arrivals = build_arrivals(pods, nodes, GoRand(7))
    replayed = replay(arrivals, scorer_for("proofplane", typical_pods(pods)))
    assert replayed.failed > 0 and replayed.placed > 0  # over 100 %: both outcomes occur

    load_cluster(store, SYSTEM, parse_cluster(cluster_text(arrivals.nodes, arrivals.rank)))
    served: list[tuple[Any, ...] | None] = []
    stream = arrivals.pods
    for at in range(0, len(stream), 25):  # several batches: the server's scheduler carries on
        r = client.post(
            f"{API}/workloads/batch",
            json={"items": [workload_body(p) for p in stream[at : at + 25]]},
        )
        assert r.status_code == 201, r.text
        for item in r.json()["items"]:
            served.append(where(item["placement"]))
            if item["placement"] is None:
                assert item["status"] == "pending" and item["reason"] == "insufficient_capacity"
    assert served == [where(p) for p in replayed.placements]
    # the CPU and memory asked are kept with the workload
    got = client.get(f"{API}/workloads/{stream[0].name}", params={"tenant": TENANT}).json()
    assert (got["cpu_milli"], got["memory_mib"]) == (stream[0].cpu, stream[0].mem)


def test_resources_are_validated(store: Store, client: TestClient) -> None:
    load_cluster(store, SYSTEM, parse_cluster(cluster_text([Node("a", 1000, 1024, 1, "T4")], [0])))
    node = client.get(f"{API}/nodes/r0000-a").json()
    assert (node["cpu_milli"], node["memory_mib"]) == (1000, 1024)
    assert node["gpus"][0]["model"] == "T4"  # a plain model that is no MIG SKU

    def submit(**body: Any) -> Any:
        return client.post(f"{API}/workloads", json={"name": "w", "tenant": TENANT, **body})

    r = submit(cpu_milli=-1)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_resource_request"
    r = submit(gpus={"count": 0})  # no GPU and no CPU or memory: nothing asked
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_gpu_request"
    r = submit(gpus={"count": 0, "nodes": 2}, cpu_milli=500)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_gpu_request"
    # more CPU than any node has: pending, and the rejections say why
    r = submit(gpus={"count": 0}, cpu_milli=2000)
    assert r.status_code == 201, r.text
    w = r.json()
    assert w["status"] == "pending" and w["reason"] == "insufficient_capacity"
    assert w["reason_details"]["rejections"] == {"insufficient_cpu": 1}
    r = client.post(f"{API}/workloads", json={"name": "m", "tenant": TENANT, "memory_mib": 4096})
    assert r.json()["reason_details"]["rejections"] == {"insufficient_memory": 1}
    r = client.post(
        f"{API}/workloads",
        json={"name": "ok", "tenant": TENANT, "gpus": {"count": 0}, "cpu_milli": 500},
    )
    assert r.json()["status"] == "placed" and r.json()["placement"]["devices"] == []


# --- MIG (issue 17 §2): the server carves as the replay does ------------------------------------

MIG_PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


def mig_stream(seed: int = 5) -> mig.MigStream:
    """Five nodes of one or two H100s (CPU and memory that refuse some requests) and MIG
    requests of every profile, a few of two instances, more than the cluster holds."""
    rng = random.Random(seed)
    nodes = [
        Node(f"n{i}", rng.choice([8000, 16000, 64000]), 1 << 20, rng.choice([1, 2]), "x")
        for i in range(5)
    ]
    requests = []
    for i in range(70):
        profile = rng.choice(MIG_PROFILES)
        count = 2 if rng.random() < 0.15 and not profile.startswith(("4g", "7g")) else 1
        cpu = rng.choice([500, 1000, 4000])
        requests.append(mig.MigRequest(f"m{i:03d}", cpu, 1024, profile, count))
    return mig.MigStream(requests=requests, nodes=nodes, rank=[3, 0, 4, 1, 2])


def mig_node_body(node: Node, rank: int) -> dict[str, Any]:
    """The trace node as ``sim.mig.cluster_node`` makes it: MIG H100s with no instances."""
    made = mig.cluster_node(node, rank)
    return {
        "name": made.name,
        "region": "openb",
        "zone": "openb",
        "cpu_milli": made.cpu_milli,
        "memory_mib": made.memory_mib,
        "gpus": [
            {
                "index": g.index,
                "uuid": f"GPU-{made.name}-{g.index}",
                "model": g.model,
                "memory_mb": g.memory_mb,
                "mig_enabled": True,
                "mig_instances": [],
            }
            for g in made.gpus
        ],
    }


def mig_where(p: Placement | dict[str, Any] | None) -> tuple[Any, ...] | None:
    """(node, (GPU index, profile, start slot) per device)."""
    if p is None:
        return None
    if isinstance(p, Placement):
        return (p.node, tuple((d.gpu_index, d.mig_profile, d.mig_start) for d in p.devices))
    devices = p["devices"]
    return (p["node"], tuple((d["gpu_index"], d["mig_profile"], d["mig_start"]) for d in devices))


def test_batch_submit_carves_as_the_mig_replay(
    monkeypatch: pytest.MonkeyPatch, store: Store, client: TestClient
) -> None:
    monkeypatch.setenv(config.MIG_AUTO_LAYOUT_ENV, "on")
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")  # the replay has no defragmenter
    stream = mig_stream()
    replayed = mig.replay_mig(stream, "proofplane", record_placements=True)
    assert 0 < replayed.accepted < replayed.requests  # over capacity: both outcomes occur
    assert replayed.carved > replayed.accepted  # instances were made, some two at a time

    assert client.post(f"{API}/tenants", json={"name": mig.TENANT}).status_code == 201
    for node, rank in zip(stream.nodes, stream.rank, strict=True):
        register_admitted(client, mig_node_body(node, rank))
    served: list[tuple[Any, ...] | None] = []
    for at in range(0, len(stream.requests), 20):  # several batches: the scheduler carries on
        items = [
            {
                "name": q.name,
                "tenant": mig.TENANT,
                "gpus": {"mig_profile": q.profile, "count": q.count},
                "cpu_milli": q.cpu,
                "memory_mib": q.mem,
            }
            for q in stream.requests[at : at + 20]
        ]
        r = client.post(f"{API}/workloads/batch", json={"items": items})
        assert r.status_code == 201, r.text
        for item in r.json()["items"]:
            served.append(mig_where(item["placement"]))
            if item["placement"] is None:
                assert item["status"] == "pending" and item["reason"] == "insufficient_capacity"
    assert served == [mig_where(p) for p in replayed.placements]
    # the GPUs' layouts the server persisted are the replay's, instance for instance
    assert replayed.scheduler is not None
    for node in replayed.scheduler.nodes():
        got = client.get(f"{API}/nodes/{node.name}").json()["gpus"]
        persisted = {g["index"]: sorted((i["start"], i["profile"]) for i in g["mig_instances"])
                     for g in got}  # fmt: skip
        assert persisted == {
            g.index: sorted((i.start, i.profile) for i in g.mig_instances) for g in node.gpus
        }
    changes = client.get(
        f"{API}/events", params={"action": "node.gpu.repartition", "limit": 500}
    ).json()["items"]
    assert changes and all(e["details"]["step"] == "carve" for e in changes)
    assert scheduler_cache(store.engine).loads == 1  # one scheduler decided every batch


def repartition_events(client: TestClient) -> list[dict[str, Any]]:
    r = client.get(f"{API}/events", params={"action": "node.gpu.repartition", "limit": 500})
    assert r.status_code == 200, r.text
    return r.json()["items"]  # type: ignore[no-any-return]


def serve_stream(
    client: TestClient,
    stream: dynamic.DynamicStream,
    around: Callable[[Callable[[], tuple[Any, ...] | None]], tuple[Any, ...] | None] = (
        lambda submit: submit()
    ),
) -> dict[int, tuple[Any, ...] | None]:
    """``stream`` through the API: its nodes registered and admitted, its arrivals submitted
    and its departures (those before the horizon) cancelled, in trace-time order (a departure
    before an arrival at the same time, as the replay's clock). Where each request was placed
    (``mig_where``); ``around`` wraps each submit (to look before and after it)."""
    assert client.post(f"{API}/tenants", json={"name": mig.TENANT}).status_code == 201
    for node, rank in zip(stream.nodes, stream.rank, strict=True):
        register_admitted(client, mig_node_body(node, rank))
    items = stream.items
    timeline = sorted(
        [(t.arrival, 1, i) for i, t in enumerate(items)]
        + [
            (t.arrival + t.duration, 0, i)
            for i, t in enumerate(items)
            if t.arrival + t.duration < stream.end
        ]  # fmt: skip
    )
    served: dict[int, tuple[Any, ...] | None] = {}
    for _at, kind, i in timeline:
        q = items[i].request
        if kind == 0:
            r = client.post(f"{API}/workloads/{q.name}/cancel", json={})
            assert r.status_code == 200, r.text
            continue
        body = {"name": q.name, "tenant": mig.TENANT, "gpus": {"mig_profile": q.profile},
                "cpu_milli": q.cpu, "memory_mib": q.mem}  # fmt: skip

        def submit(body: dict[str, Any] = body) -> tuple[Any, ...] | None:
            r = client.post(f"{API}/workloads", json=body)
            assert r.status_code == 201, r.text
            return mig_where(r.json()["placement"])

        served[i] = around(submit)
    return served


def test_submit_and_cancel_carve_and_reuse_as_the_dynamic_replay(
    monkeypatch: pytest.MonkeyPatch, store: Store, client: TestClient
) -> None:
    """With departures (``sim.dynamic.replay_dynamic``, policy ``proofplane``): arrivals as
    submits and departures as cancels, in trace-time order, land where the replay puts them;
    a departed workload's instance stays and is reused, new ones are carved beside running
    work. The cluster holds every request on arrival, so no queue policy is involved."""
    monkeypatch.setenv(config.MIG_AUTO_LAYOUT_ENV, "on")
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")
    rng = random.Random(3)
    small = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "1g.10gb", "4g.40gb")
    items = [
        dynamic.Timed(
            mig.MigRequest(f"d{i:03d}", 500, 1024, rng.choice(small)),
            10.0 * i + 0.5,
            rng.choice([13.3, 27.1, 55.9, 1e6]),
        )
        for i in range(48)
    ]
    nodes = [Node(f"n{i}", 64_000, 1 << 20, 2, "x") for i in range(4)]
    stream = dynamic.DynamicStream(items, nodes, [2, 0, 3, 1], 1.0, 1.0, items[-1].arrival)
    replayed = dynamic.replay_dynamic(stream, "proofplane", record_placements=True)
    assert replayed.accepted == len(items) and not any(replayed.waits)  # all at arrival

    reused = 0

    def count_reused(submit: Callable[[], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
        nonlocal reused
        before = len(repartition_events(client))
        where = submit()
        reused += len(repartition_events(client)) == before
        return where

    served = serve_stream(client, stream, around=count_reused)
    assert [served[i] for i in range(len(items))] == [mig_where(p) for p in replayed.placements]
    assert reused > 0 and replayed.carved < len(items)  # departed instances were reused


@pytest.mark.parametrize(
    ("mode", "policy"), [("on", "proofplane+relayout"), ("reclaim", "proofplane+repartition")]
)
def test_submit_and_cancel_relayout_idle_gpus_as_the_relayout_replay(
    monkeypatch: pytest.MonkeyPatch, store: Store, client: TestClient, mode: str, policy: str
) -> None:
    """The server's default (``PROOFPLANE_MIG_AUTO_LAYOUT=on``: carving without reclaim, and
    the repartitioning of idle GPUs) is the replay's ``proofplane+relayout``: arrivals as
    submits and departures as cancels, in trace-time order, land on the same nodes, GPUs,
    profiles and slots, and the GPUs' layouts end the same. Departures leave idle GPUs
    holding instances of other profiles; larger requests that no free slice takes then get an
    idle GPU re-laid (it happens: asserted), which the carve-only ``proofplane`` cannot do.
    ``PROOFPLANE_MIG_AUTO_LAYOUT=reclaim`` (carving may also destroy idle instances beside
    running ones) is the replay's ``proofplane+repartition`` in the same way."""
    monkeypatch.setenv(config.MIG_AUTO_LAYOUT_ENV, mode)
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")
    rng = random.Random(28)
    profiles = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "1g.10gb", "4g.40gb", "7g.80gb",
                "1g.10gb")  # fmt: skip
    items = []
    for i in range(48):
        profile = rng.choice(profiles)
        lifetimes = [13.3, 27.1, 35.9, 55.9, 1e6] if i < 24 else [13.3, 27.1, 1e6]
        items.append(
            dynamic.Timed(
                mig.MigRequest(f"r{i:03d}", 500, 1024, profile),
                10.0 * i + 0.5,
                rng.choice(lifetimes),
            )
        )
    nodes = [Node(f"n{i}", 64_000, 1 << 20, 2, "x") for i in range(3)]
    stream = dynamic.DynamicStream(items, nodes, [2, 0, 1], 1.0, 1.0, items[-1].arrival)
    replayed = dynamic.replay_dynamic(stream, policy, record_placements=True)
    assert replayed.accepted == len(items) and not any(replayed.waits)  # all at arrival
    assert replayed.repartitions > 0  # idle GPUs were re-laid: the test is not vacuous
    carve_only = dynamic.replay_dynamic(stream, "proofplane")
    assert carve_only.accepted < replayed.accepted  # re-laying them is what placed more

    served = serve_stream(client, stream)
    assert [served[i] for i in range(len(items))] == [mig_where(p) for p in replayed.placements]
    # the GPUs' layouts the server persisted are the replay's, instance for instance
    assert replayed.scheduler is not None
    for node in replayed.scheduler.nodes():
        got = client.get(f"{API}/nodes/{node.name}").json()["gpus"]
        persisted = {g["index"]: sorted((i["start"], i["profile"]) for i in g["mig_instances"])
                     for g in got}  # fmt: skip
        assert persisted == {
            g.index: sorted((i.start, i.profile) for i in g.mig_instances) for g in node.gpus
        }
    steps = [e["details"]["step"] for e in repartition_events(client)]
    # the server re-laid idle GPUs (and reclaimed idle instances) as often as the replay
    assert steps.count("repartition") + steps.count("reclaim") == replayed.repartitions
    assert {"carve", "reclaim" if mode == "reclaim" else "repartition"} <= set(steps)
    assert ("reclaim" in steps) is (mode == "reclaim")


@pytest.mark.parametrize("mode", ["on", "idle", "off", "reclaim"])
def test_the_server_builds_its_scheduler_from_the_replay_policy(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """One ``schedule.policy.Policy`` per setting, built by one function: with the default
    setting the server's is the replay's ``proofplane+relayout``, with ``reclaim`` its
    ``proofplane+repartition``."""
    monkeypatch.setenv(config.MIG_AUTO_LAYOUT_ENV, mode)
    monkeypatch.delenv(SCORER_ENV, raising=False)
    policy = server_policy()
    assert policy == layout_policy(DEFAULT_SCORER, mode)
    assert (policy == mig.POLICY_PLUGINS["proofplane+relayout"]) is (mode == "on")
    assert (policy == mig.POLICY_PLUGINS["proofplane+repartition"]) is (mode == "reclaim")
    assert policy.reclaim is (mode == "reclaim") and policy.repartition is (mode != "off")
    sched = server_scheduler([], [], {})
    assert (sched.carving is not None, sched.reclaim, sched.repartition) == (
        mode in ("on", "reclaim"),
        mode == "reclaim",
        mode != "off",
    )
