"""``GET /metrics`` (issue 15, §3): the exposition parses, its labels are bounded (route
templates, never raw paths), who may scrape it, and the fleet series equal an independent
recount from the database, on the cached scheduler's path and after a catch-up."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from dbtest import ADMIN_TOKEN
from proofplane.access import SYSTEM, Actor, Role
from proofplane.api.app import create_app
from proofplane.meter.capacity import pool_label
from proofplane.schedule.quota import mig_slices
from proofplane.service import access as access_svc
from proofplane.service import metrics as metrics_svc
from proofplane.service.context import Store
from proofplane.service.scheduling import scheduler_cache
from proofplane.service.workloads import WorkloadSpec, submit_workload
from proofplane.store.tables import NodeRow, PlacementRow, WorkloadRow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: TestClient) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def token_for(store: Store, role: Role, tenants: frozenset[str] = frozenset()) -> str:
    name = f"m-{role.value}"
    access_svc.create_user(store, SYSTEM, name, None, [role.value], sorted(tenants))
    actor = Actor(name, frozenset({role}), tenants, token_id="setup")
    return access_svc.issue_token(
        store, actor, roles=None, tenants=None, expires_in=3600, name="metrics test"
    ).token


def test_who_may_scrape(client: TestClient, store: Store) -> None:
    client.post("/api/v1/tenants", json={"name": "acme"}).raise_for_status()
    assert client.get("/metrics", headers={"Authorization": ""}).status_code == 401
    monitoring = token_for(store, Role.MONITORING)
    developer = token_for(store, Role.DEVELOPER, frozenset({"acme"}))
    assert (
        client.get("/metrics", headers={"Authorization": f"Bearer {monitoring}"}).status_code == 200
    )
    refused = client.get("/metrics", headers={"Authorization": f"Bearer {developer}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    # the monitoring role may do nothing else
    other = client.get("/api/v1/nodes", headers={"Authorization": f"Bearer {monitoring}"})
    assert other.status_code == 403


def test_http_series_use_route_templates_not_paths(client: TestClient) -> None:
    client.post(
        "/api/v1/nodes",
        json={"name": "secret-node-7", "region": "r", "zone": "z",
              "gpus": [{"index": 0, "uuid": "GPU-s7-0", "model": "H100-80GB"}]},
    ).raise_for_status()  # fmt: skip
    before = scrape(client)
    for _ in range(3):
        assert client.get("/api/v1/nodes/secret-node-7").status_code == 200
    assert client.get("/api/v1/nodes/no-such-node").status_code == 404
    assert client.get("/no/such/route/secret-path").status_code == 404
    assert client.request("BREW", "/api/v1/nodes").status_code in (404, 405)
    after = scrape(client)

    def delta(labels: dict[str, str]) -> float:
        key = ("proofplane_http_requests_total", tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    node = "/api/v1/nodes/{name}"
    assert delta({"method": "GET", "route": node, "code": "200"}) == 3
    assert delta({"method": "GET", "route": node, "code": "404"}) == 1
    assert delta({"method": "GET", "route": "<unmatched>", "code": "404"}) == 1
    assert delta({"method": "OTHER", "route": "/api/v1/nodes", "code": "405"}) == 1
    count = ("proofplane_http_request_duration_seconds_count",
             (("method", "GET"), ("route", node)))  # fmt: skip
    assert after[count] - before.get(count, 0) == 4
    text = client.get("/metrics").text
    assert "secret-node-7" not in text and "secret-path" not in text


def test_exposition_parses_and_holds_the_control_plane(client: TestClient, store: Store) -> None:
    client.post("/api/v1/audit/checkpoint").raise_for_status()
    samples = scrape(client)
    names = {n for n, _ in samples}
    for name in (
        "proofplane_audit_log_entries",
        "proofplane_audit_checkpoint_tree_size",
        "proofplane_audit_checkpoint_age_seconds",
        "proofplane_audit_unsigned_entries",
        "proofplane_workloads",
        "proofplane_fleet_snapshot_age_seconds",
    ):
        assert name in names, name
    assert not any(n.endswith("_created") for n in names)
    entries = samples[("proofplane_audit_log_entries", ())]
    assert entries >= samples[("proofplane_audit_checkpoint_tree_size", ())] > 0
    assert 0 <= samples[("proofplane_audit_checkpoint_age_seconds", ())] < 60
    # every counter is a *_total, every series' name starts with proofplane_ or is Python's
    assert all(n.startswith(("proofplane_", "process_", "python_")) for n in names)


def test_query_string_and_accept_header_change_nothing(client: TestClient) -> None:
    r = client.get("/metrics?name[]=x&%00=1", headers={"Accept": "application/openmetrics-text"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


# --- the fleet, recounted from the database -----------------------------------------------------


def recount(store: Store) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[int]]]:
    """What the fleet series must say, counted from rows, not from the scheduler."""
    held: dict[tuple[str, str], list[float]] = {}
    with store.read() as s:
        rows = s.scalars(
            select(WorkloadRow)
            .join(PlacementRow)
            .options(selectinload(WorkloadRow.tenant), selectinload(WorkloadRow.placement))
        )
        for w in rows:
            assert w.placement is not None
            row = held.setdefault((w.tenant.name, pool_label(w.tags)), [0, 0, 0.0, 0])
            row[0] += 1
            parts = w.placement.members or [{"devices": w.placement.devices}]
            for part in parts:
                for d in part["devices"]:
                    if d.get("mig_profile"):
                        row[3] += mig_slices(d["mig_profile"])
                    elif d.get("share_milli") is not None:
                        row[2] += d["share_milli"] / 1000
                    else:
                        row[1] += 1
        busy: dict[str, set[int]] = {}
        slices_held: dict[str, int] = {}
        for p in s.scalars(select(PlacementRow).options(selectinload(PlacementRow.workload))):
            parts = p.members or [{"node": None, "devices": p.devices}]
            for part in parts:
                node = part.get("node")
                if node is None:
                    node = s.get(NodeRow, p.node_id).name  # type: ignore[union-attr]
                for d in part["devices"]:
                    busy.setdefault(node, set()).add(d["gpu_index"])
                    if d.get("mig_profile"):
                        slices_held[node] = slices_held.get(node, 0) + mig_slices(d["mig_profile"])
        nodes = s.scalars(
            select(NodeRow)
            .where(NodeRow.state == "admitted")
            .options(selectinload(NodeRow.gpus), selectinload(NodeRow.certifications))
        ).all()
        pools = {pool for _t, pool in held} | {"general"}
        by_pool: dict[str, list[int]] = {}
        for pool in pools:
            want = {} if pool == "general" else dict(p.split("=", 1) for p in pool.split(","))
            row = by_pool.setdefault(pool, [0, 0, 0, 0, 0])
            for n in nodes:
                certs = {c.key: c.value for c in n.certifications}
                if any(certs.get(k) != v for k, v in want.items()):
                    continue
                configured = sum(
                    mig_slices(i["profile"])
                    for g in n.gpus
                    if g.mig_enabled
                    for i in g.mig_instances
                )
                row[0] += 1
                row[1] += len(n.gpus)
                row[2] += sum(1 for g in n.gpus if g.index not in busy.get(n.name, set()))
                row[3] += configured
                row[4] += configured - slices_held.get(n.name, 0)
    return held, by_pool


def check_fleet(client: TestClient, store: Store) -> None:
    samples = scrape(client)
    held, by_pool = recount(store)
    names = (
        "proofplane_tenant_workloads_placed",
        "proofplane_tenant_gpus_allocated",
        "proofplane_tenant_gpu_shares_allocated",
        "proofplane_tenant_mig_slices_allocated",
    )
    for i, name in enumerate(names):
        got = {
            dict(k)["tenant"] + "|" + dict(k)["pool"]: v for k, v in series(samples, name).items()
        }
        want = {f"{t}|{p}": pytest.approx(v[i]) for (t, p), v in held.items()}
        assert got == want, name
    pool_names = (
        "proofplane_pool_nodes",
        "proofplane_pool_gpus",
        "proofplane_pool_gpus_free",
        "proofplane_pool_mig_slices",
        "proofplane_pool_mig_slices_free",
    )
    for i, name in enumerate(pool_names):
        got = {dict(k)["pool"]: v for k, v in series(samples, name).items()}
        for pool, row in by_pool.items():
            assert got[pool] == row[i], (name, pool)
    assert samples[("proofplane_fleet_snapshot_age_seconds", ())] == 0


def test_fleet_series_equal_a_recount_from_the_database(client: TestClient, demo: Store) -> None:
    check_fleet(client, demo)
    # work placed and cancelled through the API: the cache the writes left is read as is
    for i in range(6):
        body = {"name": f"extra-{i}", "tenant": "research-lab",
                "gpus": {"count": 1} if i % 2 else {"share_milli": 250}}  # fmt: skip
        assert client.post("/api/v1/workloads", json=body).status_code == 201
    client.post("/api/v1/workloads/extra-1/cancel", json={"reason": "t"}).raise_for_status()
    check_fleet(client, demo)


def test_fleet_series_catch_up_with_writes_the_cache_did_not_see(
    client: TestClient, demo: Store
) -> None:
    check_fleet(client, demo)
    cache = scheduler_cache(demo.engine)
    version = cache.version
    # another process writes: a second store on the same database has its own cache
    other = Store(demo.url)
    try:
        for i in range(4):
            submit_workload(
                other, SYSTEM, WorkloadSpec(f"elsewhere-{i}", "berlin-telco", gpus=_mig("1g.10gb"))
            )
    finally:
        other.dispose()
    check_fleet(client, demo)
    assert cache.version is not None and version is not None and cache.version > version
    assert cache.catch_ups >= 1


def _mig(profile: str) -> Any:
    from proofplane.model import GpuRequest

    return GpuRequest(count=1, mig_profile=profile)


def test_a_process_without_a_cached_scheduler_loads_one(demo: Store) -> None:
    fresh = Store(demo.url)  # a new engine: no cache, no metrics state yet
    try:
        access_svc.bootstrap_admin(fresh, ADMIN_TOKEN)
        assert scheduler_cache(fresh.engine).scheduler is None
        with TestClient(
            create_app(fresh), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as client:
            check_fleet(client, fresh)
        assert scheduler_cache(fresh.engine).loads == 1
    finally:
        fresh.dispose()


def test_a_scrape_does_not_wait_for_a_long_transaction(
    client: TestClient, demo: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While this process's scheduler is held, a scrape serves the last fleet numbers and says
    how old they are; the control-plane series are read fresh."""
    first = scrape(client)
    monkeypatch.setattr(metrics_svc, "FLEET_WAIT_S", 0.05)
    cache = scheduler_cache(demo.engine)
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with cache.lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        second = scrape(client)
    finally:
        release.set()
        t.join()
    assert second[("proofplane_fleet_snapshot_age_seconds", ())] > 0
    for name in ("proofplane_tenant_gpus_allocated", "proofplane_pool_gpus_free"):
        assert series(second, name) == series(first, name)
    assert scrape(client)[("proofplane_fleet_snapshot_age_seconds", ())] == 0


def test_pending_by_reason(client: TestClient, demo: Store) -> None:
    body = {"name": "too-big", "tenant": "research-lab", "gpus": {"count": 64}}
    assert client.post("/api/v1/workloads", json=body).json()["status"] == "pending"
    samples = scrape(client)
    pending = {
        dict(k)["reason"]: v for k, v in series(samples, "proofplane_workloads_pending").items()
    }
    with demo.read() as s:
        want = Counter(
            r or "none"
            for r in s.scalars(select(WorkloadRow.reason).where(WorkloadRow.status == "pending"))
        )
    assert pending == dict(want) and pending


def test_decision_latency_is_observed(client: TestClient, demo: Store) -> None:
    before = scrape(client)
    body = {"name": "timed", "tenant": "research-lab", "gpus": {"count": 1}}
    assert client.post("/api/v1/workloads", json=body).status_code == 201
    after = scrape(client)
    key = ("proofplane_schedule_decision_duration_seconds_count", (("outcome", "placed"),))
    assert after[key] - before.get(key, 0) == 1


def test_write_transactions_are_timed_by_phase(client: TestClient, demo: Store) -> None:
    """Every write transaction observes its wait for the write slot and its time holding it;
    a read observes neither; a write that fails (a 404 inside the transaction) still
    counts its time under the slot."""

    def counts(samples: Samples) -> tuple[float, float, float]:
        def get(name: str, phase: str) -> float:
            return samples.get((name, (("phase", phase),)), 0.0)

        base = "proofplane_db_write_lock_seconds"
        return (
            get(f"{base}_count", "wait"),
            get(f"{base}_count", "held"),
            get(f"{base}_sum", "held"),
        )

    before = counts(scrape(client))
    body = {"name": "locked", "tenant": "research-lab", "gpus": {"count": 1}}
    assert client.post("/api/v1/workloads", json=body).status_code == 201
    after_write = counts(scrape(client))
    assert after_write[0] - before[0] >= 1 and after_write[1] - before[1] >= 1
    assert after_write[1] - before[1] == after_write[0] - before[0]  # one of each per write
    assert after_write[2] > before[2]  # it held the slot for some time
    assert client.get("/api/v1/workloads").status_code == 200
    assert counts(scrape(client))[:2] == after_write[:2]  # reads take no write slot
    assert client.post("/api/v1/workloads/nobody/cancel", json={}).status_code == 404
    assert counts(scrape(client))[1] > after_write[1]


def test_utilisation_per_tenant_under_dcgm_names(client: TestClient, store: Store) -> None:
    from datetime import UTC, datetime

    import telemetry_cluster as tc
    from proofplane.hardware.cluster_file import gpu_uuid
    from proofplane.service import telemetry as tel

    tc.load(store)
    now = datetime.now(UTC)
    g, fb, p = "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE"
    entries = [
        tc.entry(gpu_uuid("n1", 1), now, {g: 0.8, fb: 1024, p: 250}),  # acme/whole
        tc.entry(tc.MIG_GPU, now, {g: 0.2, fb: 512}, gi_id=7, profile="3g.40gb"),  # beta/slice
        tc.entry(tc.MIG_GPU, now, {g: 0.0}, gi_id=8, profile="1g.10gb", mig_start=4),  # nobody
    ]
    tel.ingest(store, tc.agent("n1"), "n1", {"samples": entries}, now=now)
    samples = scrape(client)
    util = series(samples, "proofplane_tenant_gpu_utilization_ratio")
    assert util == {
        (("dcgm_field", g), ("tenant", "acme")): pytest.approx(0.8),
        (("dcgm_field", g), ("tenant", "beta")): pytest.approx(0.2),
    }
    fb_bytes = series(samples, "proofplane_tenant_gpu_framebuffer_used_bytes")
    assert fb_bytes[(("dcgm_field", fb), ("tenant", "acme"))] == 1024 * 2**20
    power = series(samples, "proofplane_tenant_gpu_power_watts")
    assert power == {(("dcgm_field", p), ("tenant", "acme")): 250.0}
    devices = series(samples, "proofplane_tenant_telemetry_devices")
    assert devices == {(("tenant", "acme"),): 1.0, (("tenant", "beta"),): 1.0}


def test_the_event_loop_lag_is_exposed(client: TestClient) -> None:
    import time

    time.sleep(0.2)  # the lifespan's probe runs every 50 ms
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    lag = families["proofplane_event_loop_lag_seconds"]
    count = [s.value for s in lag.samples if s.name.endswith("_count")]
    assert count and count[0] >= 1
