"""A real Prometheus scrapes ``proofplane serve --workers 2`` on loopback and answers PromQL
through its HTTP API with the values the server's state implies (issue 15, §3).

Two worker processes: a scrape reaches one of them, and the counters still add up over both
(prometheus_client's multiprocess mode, ``service/instruments.py``): the requests made before
the scrape, however the kernel spread them over the workers, sum to exactly their number."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from dbtest import ADMIN_TOKEN, demo_text
from prom import Serve, prometheus, query, query_until, value
from proofplane.access import SYSTEM, Actor, Role
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service import access as access_svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import NodeRow, PlacementRow, WorkloadRow

REQUESTS = 23


def _prepare(url: str) -> tuple[str, int, int]:
    """The demo cluster (without commands: nothing runs), a monitoring user's token, and what
    the fleet series must then say: whole GPUs held, GPUs on admitted nodes."""
    store = Store(url)
    try:
        migrate.upgrade(store.engine)
        spec = parse_cluster(demo_text())
        spec = dataclasses.replace(
            spec, workloads=tuple(dataclasses.replace(w, command=()) for w in spec.workloads)
        )
        load_cluster(store, SYSTEM, spec)
        access_svc.bootstrap_admin(store, ADMIN_TOKEN)
        access_svc.create_user(store, SYSTEM, "prometheus", None, ["monitoring"], [])
        token = access_svc.issue_token(
            store,
            Actor("prometheus", frozenset({Role.MONITORING}), token_id="setup"),
            roles=None,
            tenants=None,
            expires_in=3600,
            name="scrape",
        ).token
        with store.read() as s:
            whole = 0
            for w in s.scalars(
                select(WorkloadRow).join(PlacementRow).options(selectinload(WorkloadRow.placement))
            ):
                assert w.placement is not None
                parts = w.placement.members or [{"devices": w.placement.devices}]
                whole += sum(
                    1
                    for p in parts
                    for d in p["devices"]
                    if not d.get("mig_profile") and d.get("share_milli") is None
                )
            gpus = sum(
                len(n.gpus)
                for n in s.scalars(
                    select(NodeRow)
                    .where(NodeRow.state == "admitted")
                    .options(selectinload(NodeRow.gpus))
                )
            )
    finally:
        store.dispose()
    return token, whole, gpus


def test_prometheus_scrapes_two_workers_and_answers_promql(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pp.db'}"
    token, whole_gpus, gpus = _prepare(url)
    assert whole_gpus > 0 and gpus > 0
    token_file = tmp_path / "scrape.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    metrics_dir = tmp_path / "metrics"
    server = Serve(
        url, tmp_path, "--workers", "2", env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    )
    try:
        for _ in range(REQUESTS):  # a new connection each: the kernel spreads them over workers
            assert httpx.get(f"{server.base}/healthz", timeout=5).status_code == 200
        # both workers answered some: each keeps its own counter file
        counters = list(metrics_dir.glob("counter_*.db"))
        assert len(counters) == 2, sorted(p.name for p in metrics_dir.iterdir())
        with prometheus(tmp_path, f"127.0.0.1:{server.port}", token_file) as prom:
            up = query_until(prom, 'up{job="proofplane"}', lambda r: value(r) == 1.0)
            assert value(up) == 1.0, up
            healthz = 'sum(proofplane_http_requests_total{route="/healthz",code="200"})'
            found = query_until(prom, healthz, lambda r: value(r) == REQUESTS)
            assert value(found) == REQUESTS, found
            held = query_until(
                prom,
                "sum(proofplane_tenant_gpus_allocated)",
                lambda r: value(r) == whole_gpus,
            )
            assert value(held) == whole_gpus, held
            assert value(query(prom, 'proofplane_pool_gpus{pool="general"}')) == gpus
            nodes = query(prom, 'sum(proofplane_nodes{state="admitted"})')
            assert value(nodes) is not None and value(nodes) > 0
            # a histogram Prometheus can take a quantile of
            q = query(
                prom,
                "histogram_quantile(0.5, sum by (le) "
                '(proofplane_http_request_duration_seconds_bucket{route="/healthz"}))',
            )
            assert value(q) is not None and 0 < float(value(q) or 0) < 10
    finally:
        server.stop()
    # the directory serve was given is kept (the operator's), its files from this run in it
    assert metrics_dir.is_dir()


def test_a_scrape_without_the_token_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pp.db'}"
    _prepare(url)
    server = Serve(url, tmp_path, "--workers", "1")
    try:
        r = httpx.get(f"{server.base}/metrics", timeout=5)
        assert r.status_code == 401 and "www-authenticate" in r.headers
    finally:
        server.stop()


@pytest.mark.parametrize("created", [True, False])
def test_prepare_multiprocess(tmp_path: Path, created: bool) -> None:
    from proofplane.service import instruments

    env: dict[str, str] = {}
    if not created:
        given = tmp_path / "given"
        given.mkdir()
        (given / "counter_1.db").write_bytes(b"stale")
        (given / "keep.txt").write_text("not ours")
        env[instruments.MULTIPROC_ENV] = str(given)
    path, made = instruments.prepare_multiprocess(env)
    assert made is created and env[instruments.MULTIPROC_ENV] == path
    assert not list(Path(path).glob("*.db"))  # an earlier run's values are not summed in
    instruments.forget_multiprocess(path, made, env)
    assert Path(path).exists() is not created
    if not created:
        assert (Path(path) / "keep.txt").exists() and env[instruments.MULTIPROC_ENV] == path
