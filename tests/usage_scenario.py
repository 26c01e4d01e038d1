"""A small cluster's history on a fixed clock, for the usage and chargeback tests, and an
independent recomputation of its bill from the events API.

Tests import from here (never from conftest). ``build(store)`` writes, through the real
services, hours of placements, MIG slices, a shared GPU, a gang, cancels, a node failure with
its evictions and re-placements, and two tenants using the same workload name. ``recompute``
reads ``GET /api/v1/events`` and prices the usage with its own small code (fractions, the
prices written here), so that the report's figures are checked against a second reading of the
log, not against themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction
from typing import Any

from fastapi.testclient import TestClient

from proofplane.access import SYSTEM, Actor
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import GpuRequest, NodeState
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store, Tx
from proofplane.service.nodes import set_node_state
from proofplane.service.workloads import WorkloadSpec, cancel_workload, submit_workload

T0 = datetime(2021, 3, 1, tzinfo=UTC)  # long past: no report window reaches "now"
H = timedelta(hours=1)
WINDOW = (T0, T0 + 10 * H)
# The shipped rate card's prices for the SKUs used here (data/rate-card.yaml).
PRICES = {"H100-80GB": Decimal("2.40"), "A100-40GB": Decimal("1.10")}
COMPUTE_SLICES = {"3g.40gb": 3, "1g.10gb": 1, "2g.20gb": 2}

CLUSTER = """
cluster: usage-test
tenants:
  - name: acme
  - name: beta
nodes:
  - name: n1
    region: r1
    zone: z1
    certifications: {tier: gold}
    gpus:
      - {model: H100-80GB, count: 4, mig: [3g.40gb@0, 3g.40gb@4], mig_gpus: 1}
  - name: n2
    region: r1
    zone: z1
    gpus:
      - {model: A100-40GB, count: 2}
      - {model: H100-80GB, count: 2}
  - name: n3
    region: r1
    zone: z1
    gpus:
      - {model: H100-80GB, count: 2}
"""


class ClockStore(Store):
    """A store whose write transactions happen at ``clock`` (the services take no ``now``)."""

    clock: datetime = T0

    @contextmanager
    def write(
        self, actor: Actor, now: datetime | None = None, *, catch_up: bool = False
    ) -> Iterator[Tx]:
        with super().write(actor, now or self.clock, catch_up=catch_up) as tx:
            yield tx


def build(store: ClockStore) -> None:
    def at(hours: float) -> None:
        store.clock = T0 + timedelta(hours=hours)

    def submit(name: str, tenant: str, **gpus: Any) -> None:
        tags = gpus.pop("tags", {})
        w = submit_workload(
            store, SYSTEM, WorkloadSpec(name, tenant, tags, None, GpuRequest(**gpus))
        )
        assert w.placement is not None, (name, w.reason, w.reason_details)

    at(-1)
    load_cluster(store, SYSTEM, parse_cluster(CLUSTER))
    at(0)
    submit("train", "acme", count=2, model="H100-80GB")
    submit("infer", "beta", count=1, mig_profile="3g.40gb", tags={"tier": "gold"})
    at(0.5)
    submit("notebook", "acme", count=1, share_milli=250)
    at(1.25)
    submit("gang", "acme", count=2, nodes=2, model="H100-80GB")
    at(2)
    submit("train", "beta", count=1, model="A100-40GB")  # the same name as acme's
    at(3)
    cancel_workload(store, SYSTEM, "train", "done", tenant="acme")
    at(4.5)
    set_node_state(store, SYSTEM, "n2", NodeState.FAILED, "power supply")  # evicts, re-places
    at(5 + 1 / 3)
    cancel_workload(store, SYSTEM, "infer", None, tenant="beta")
    at(7)
    set_node_state(store, SYSTEM, "n3", NodeState.CORDONED, "maintenance")  # evicts nothing


def events(client: TestClient) -> list[dict[str, Any]]:
    """Every event through the events API, oldest first, page by page."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 500}
        if cursor:
            params["cursor"] = cursor
        r = client.get("/api/v1/events", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        out.extend(page["items"])
        cursor = page.get("next")
        if not cursor:
            return out


def recompute(client: TestClient, start: datetime, end: datetime) -> dict[str, dict[str, Any]]:
    """Per tenant: GPU-hours and the bill (each (pool, SKU, kind) line rounded half-even to the
    cent, then added), from the events API alone."""
    models: dict[str, str] = {}
    held: dict[tuple[str, str], tuple[datetime, str | None, list[tuple[str, str, Fraction]]]] = {}
    lines: dict[tuple[str, str, str, str], Fraction] = {}  # -> GPU-hours

    def close(key: tuple[str, str], until: datetime) -> None:
        since, _node, parts = held.pop(key)
        lo, hi = max(since, start), min(until, end)
        if hi <= lo:
            return
        hours = Fraction(int((hi - lo) / timedelta(microseconds=1)), 3_600_000_000)
        for sku, kind, weight in parts:
            pool = key_pool[key]
            line = (key[0], pool, sku, kind)
            lines[line] = lines.get(line, Fraction(0)) + hours * weight

    key_pool: dict[tuple[str, str], str] = {}
    for e in events(client):
        ts = datetime.fromisoformat(e["ts"])
        d = e["details"]
        if ts >= end:
            break
        if e["action"] == "node.register":
            for g in d["gpus"]:
                models[g["uuid"]] = g["model"]
        elif e["action"] == "workload.place":
            key = (d["tenant"], e["target_id"])
            if key in held:
                close(key, ts)
            devices = [x for m in d.get("members") or [d] for x in m["devices"]]
            parts = []
            for dev in devices:
                if dev["mig_profile"]:
                    kind, w = dev["mig_profile"], Fraction(COMPUTE_SLICES[dev["mig_profile"]], 7)
                elif dev["share_milli"]:
                    kind, w = "shared", Fraction(dev["share_milli"], 1000)
                else:
                    kind, w = "gpu", Fraction(1)
                parts.append((models[dev["gpu_uuid"]], kind, w))
            held[key] = (ts, d["node"], parts)
            key_pool[key] = ",".join(f"{k}={v}" for k, v in sorted(d["tags"].items()))
        elif e["action"] in (
            "workload.evict",
            "workload.cancel",
            "workload.succeeded",
            "workload.failed",
            "workload.cancelled",
        ):
            tenant = d.get("tenant")
            if tenant is None:
                found = [k for k, v in held.items() if k[1] == e["target_id"] and v[1] == d["node"]]
                key = found[0] if found else ("", "")
            else:
                key = (tenant, e["target_id"])
            if key in held:
                close(key, ts)
    for key in list(held):
        close(key, end)
    out: dict[str, dict[str, Any]] = {}
    for (tenant, _pool, sku, _kind), gpu_hours in sorted(lines.items()):
        cost = gpu_hours * Fraction(PRICES[sku])
        cents = (Decimal(cost.numerator) / Decimal(cost.denominator)).quantize(
            Decimal("0.01"), rounding=ROUND_HALF_EVEN
        )
        t = out.setdefault(tenant, {"gpu_hours": Fraction(0), "billed": Decimal("0.00")})
        t["gpu_hours"] += gpu_hours
        t["billed"] += cents
    return out
