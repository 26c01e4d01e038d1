"""The replay places as the server does (issue 17, §1): the same stream of trace pods, once
through ``sim.engine.replay`` and once as workloads through the API's batch submit
(``POST /api/v1/workloads/batch``, persisted, on a cluster loaded from a cluster file with the
trace's plain GPU models, CPU and memory), lands on the same nodes and the same GPUs."""

from __future__ import annotations

import json
import random
from typing import Any

from fastapi.testclient import TestClient

from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import Placement
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
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
