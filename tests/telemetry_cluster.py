"""A small cluster for the telemetry tests (tests/service, tests/api, tests/workers), and
helpers to build posted bodies."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from proofplane.access import SYSTEM, Actor
from proofplane.hardware.cluster_file import gpu_uuid, parse_cluster
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store

CLUSTER = """
cluster: telemetry-test
tenants:
  - name: acme
    profile: {}
  - name: beta
    profile: {}
nodes:
  - name: n1
    region: r
    zone: z
    gpus:
      - {model: H100-80GB, count: 2, mig: [3g.40gb@0, 1g.10gb@4], mig_gpus: 1}
  - name: n2
    region: r
    zone: z
    gpus:
      - {model: H100-80GB, count: 2}
workloads:
  - name: slice
    tenant: beta
    gpus: {mig_profile: 3g.40gb}
  - name: whole
    tenant: acme
    gpus: {count: 1}
"""

MIG_GPU = gpu_uuid("n1", 0)  # 3g.40gb@0 (held by beta/slice) and 1g.10gb@4 (free)


def load(store: Store) -> dict[str, int]:
    return load_cluster(store, SYSTEM, parse_cluster(CLUSTER))


def agent(node: str) -> Actor:
    return Actor(f"node:{node}")


def entry(uuid: str, ts: datetime, values: dict[str, float], **mig: Any) -> dict[str, Any]:
    return {"gpu_uuid": uuid, "ts": ts.astimezone(UTC).isoformat(), "values": values, **mig}


def t(minutes: float = 0, base: datetime | None = None) -> datetime:
    return (base or datetime.now(UTC)) + timedelta(minutes=minutes)
