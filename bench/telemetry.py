"""Benchmark: observability and metering (issue 15). One JSON object with one section per
figure, each section made by one function of this file (``SECTIONS``): ``ingest`` (here),
``metrics_scrape`` and ``usage_report`` (added by their owners), and ``machine``.

**ingest** (target: ≥ 20,000 samples/s on one core into SQLite; 5,000 nodes × 8 GPUs every
15 s is 2,700/s). A *sample* is the issue's: one device's (a GPU's or a MIG instance's) set of
readings at one interval. The fleet: ``--nodes`` (100) nodes of 8 H100s loaded through
``load_cluster``; on each node GPU 0 holds 7 × 1g.10gb and GPU 1 2 × 3g.40gb MIG instances,
and workloads of several tenants hold the MIG instances, whole GPUs and GPU shares (so samples
are attributed to placements, shared GPUs split by share, as in production). One *post* is
what one node's agent sends each interval: 17 device samples (8 GPUs, 9 MIG instances), each
GPU with the DCGM fields a collector reads (utilisation, SM/DRAM activity, frame buffer,
power, energy, temperatures, XID, ECC SBE/DBE, row-remap failure, PCIe and NVLink throughput:
17 values, 16 on the two MIG-mode GPUs plus frame buffer free) and each MIG instance its five
(GR/SM/DRAM activity, frame buffer used/free): 181 readings per post. The timed path is the
server's for ``POST /api/v1/nodes/{name}/telemetry`` minus HTTP: ``json.loads`` of the body
bytes (what the route's JSON parsing does) and ``service.telemetry.ingest``, the function the
route calls (authorisation of the node's agent, ``meter.samples.parse_devices``, attribution to
the holding placements, the series lookup, one packed row per device holder and time into
``telemetry_samples``, the newest-sample upsert per device, the health check of XID/ECC/
row-remap/temperature, one write transaction per post), on one thread, SQLite in WAL mode with
the store's settings. Each run posts ``--intervals`` intervals of every node (the clock moves
15 s per interval) into the same, growing database; ``samples_per_s`` is the median over
``--runs`` runs of device samples / wall time (``samples_per_s_runs`` lists them),
``readings_per_s`` the same runs in field readings, ``posts_per_s`` per post,
``cpu_us_per_sample`` the process CPU time per device sample and ``samples_per_cpu_s`` device
samples per CPU-second of the one thread (the figure for "one core" on a machine others
share), ``bytes_per_sample`` / ``bytes_per_reading`` the database size (samples + series +
latest, indexes included) per stored row / stored reading after the runs. ``uptime_before`` /
``uptime_after`` say how loaded the machine was. HTTP itself is measured by ``bench/api.py``.

    .venv/bin/python bench/telemetry.py --json [--quick] [--only ingest]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from proofplane.access import SYSTEM, Actor
from proofplane.hardware.cluster_file import gpu_uuid, parse_cluster
from proofplane.machine import machine as common_machine
from proofplane.meter import fields as F
from proofplane.service import telemetry as tel
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

INTERVAL = timedelta(seconds=15)
GPU_FIELDS = (
    F.GR_ENGINE_ACTIVE, F.SM_ACTIVE, F.DRAM_ACTIVE, F.GPU_UTIL, F.FB_USED, F.POWER_USAGE,
    F.TOTAL_ENERGY, F.GPU_TEMP, F.MEMORY_TEMP, F.XID_ERRORS, F.ECC_SBE_VOL_TOTAL,
    F.ECC_DBE_VOL_TOTAL, F.ROW_REMAP_FAILURE, F.PCIE_TX_BYTES, F.PCIE_RX_BYTES,
    F.NVLINK_TX_BYTES, F.NVLINK_RX_BYTES,
)  # fmt: skip
MIG_FIELDS = (F.GR_ENGINE_ACTIVE, F.SM_ACTIVE, F.DRAM_ACTIVE, F.FB_USED, F.FB_FREE)
DEVICES_PER_POST = 8 + 7 + 2  # 8 GPUs, 7 + 2 MIG instances
MIG_LAYOUTS = {  # GPU index → instances (profile, start, GPU instance id)
    0: [("1g.10gb", s, 9 + s) for s in range(7)],
    1: [("3g.40gb", 0, 1), ("3g.40gb", 4, 2)],
}


def machine() -> dict[str, Any]:
    return {**common_machine(), "sqlite": sqlite3.sqlite_version}


# --- ingest ----------------------------------------------------------------------------------


def fleet_yaml(nodes: int) -> str:
    """``nodes`` H100 nodes (GPU 0: 7 × 1g, GPU 1: 2 × 3g), and workloads holding MIG slices,
    whole GPUs and shares across four tenants."""
    lines = ["cluster: bench-telemetry", "tenants:"]
    tenants = ["t0", "t1", "t2", "t3"]
    lines += [f"  - {{name: {t}, profile: {{}}}}" for t in tenants]
    lines.append("nodes:")
    for n in range(nodes):
        lines += [
            f"  - name: n{n:05d}",
            "    region: r",
            "    zone: z",
            "    gpus:",
            "      - {model: H100-80GB, count: 1, mig: [" + ", ".join(
                f"1g.10gb@{s}" for s in range(7)) + "]}",
            "      - {model: H100-80GB, count: 1, mig: [3g.40gb@0, 3g.40gb@4]}",
            "      - {model: H100-80GB, count: 6}",
        ]  # fmt: skip
    lines.append("workloads:")
    k = 0
    for n in range(nodes):
        # per node: 4 × 1g, 1 × 3g, 3 whole GPUs, 2 quarter shares (of one GPU)
        for spec in (
            ["{mig_profile: 1g.10gb}"] * 4
            + ["{mig_profile: 3g.40gb}"]
            + ["{count: 1}"] * 3
            + ["{share_milli: 250}"] * 2
        ):
            lines.append(f"  - {{name: w{k:06d}, tenant: {tenants[k % 4]}, gpus: {spec}}}")
            k += 1
        del n
    return "\n".join(lines) + "\n"


def node_body(node: str, ts: datetime, step: int) -> bytes:
    """One node's post for one interval, as its agent sends it (JSON bytes)."""
    iso = ts.isoformat().replace("+00:00", "Z")
    samples: list[dict[str, Any]] = []
    for i in range(8):
        uuid = gpu_uuid(node, i)
        load = ((step * 7 + i * 13) % 100) / 100
        values = {
            F.GR_ENGINE_ACTIVE: load, F.SM_ACTIVE: load * 0.9, F.DRAM_ACTIVE: load * 0.5,
            F.GPU_UTIL: round(load * 100), F.FB_USED: 40960 + i, F.POWER_USAGE: 150 + 500 * load,
            F.TOTAL_ENERGY: 1e9 + step * 15 * 500_000.0, F.GPU_TEMP: 40 + 30 * load,
            F.MEMORY_TEMP: 45 + 25 * load, F.XID_ERRORS: 0, F.ECC_SBE_VOL_TOTAL: 3,
            F.ECC_DBE_VOL_TOTAL: 0, F.ROW_REMAP_FAILURE: 0, F.PCIE_TX_BYTES: 1e9 * load,
            F.PCIE_RX_BYTES: 2e9 * load, F.NVLINK_TX_BYTES: 5e10 * load,
            F.NVLINK_RX_BYTES: 5e10 * load,
        }  # fmt: skip
        if i in MIG_LAYOUTS:
            del values[F.GPU_UTIL]  # never valid in MIG mode
            values[F.FB_FREE] = 1024.0
        samples.append({"gpu_uuid": uuid, "ts": iso, "values": values})
        for profile, start, gi in MIG_LAYOUTS.get(i, ()):
            samples.append({
                "gpu_uuid": uuid, "gi_id": gi, "profile": profile, "mig_start": start,
                "ts": iso,
                "values": {F.GR_ENGINE_ACTIVE: load, F.SM_ACTIVE: load * 0.8,
                           F.DRAM_ACTIVE: load * 0.4, F.FB_USED: 9000.0, F.FB_FREE: 900.0},
            })  # fmt: skip
    return json.dumps({"simulated": False, "samples": samples}).encode()


def _db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def _uptime() -> str:
    """``uptime``'s line (the load on a shared machine, printed with the figure)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5,
                              check=False).stdout.strip()  # fmt: skip
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def ingest(args: argparse.Namespace) -> dict[str, Any]:
    """The ingest figure (see the module docstring)."""
    nodes = args.nodes
    uptime_before = _uptime()
    with tempfile.TemporaryDirectory(prefix="pp-bench-telemetry-") as tmp:
        path = Path(tmp) / "telemetry.db"
        store = Store(f"sqlite:///{path}")
        migrate.upgrade(store.engine)
        t0 = time.perf_counter()
        counts = load_cluster(store, SYSTEM, parse_cluster(fleet_yaml(nodes)))
        load_s = time.perf_counter() - t0
        names = [f"n{n:05d}" for n in range(nodes)]
        agents = {name: Actor(f"node:{name}") for name in names}
        start = datetime.now(UTC) + timedelta(seconds=1)  # after every placement
        step = 0
        # warm-up: one interval (series created, caches filled), not timed
        readings_per_post = 0
        stored = 0
        for name in names:
            out = tel.ingest(store, agents[name], name, json.loads(node_body(name, start, 0)),
                             now=start)  # fmt: skip
            readings_per_post = out.accepted
            stored += out.stored
        runs, readings_runs, posts_runs, cpu_runs = [], [], [], []
        for _ in range(args.runs):
            bodies = []
            for _i in range(args.intervals):
                step += 1
                ts = start + step * INTERVAL
                bodies += [(name, ts, node_body(name, ts, step)) for name in names]
            readings = 0
            c0, w0 = time.process_time(), time.perf_counter()
            for name, ts, raw in bodies:
                out = tel.ingest(store, agents[name], name, json.loads(raw), now=ts)
                readings += out.accepted
                stored += out.stored
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            samples = len(bodies) * DEVICES_PER_POST
            runs.append(samples / wall)
            readings_runs.append(readings / wall)
            posts_runs.append(len(bodies) / wall)
            cpu_runs.append(cpu / samples * 1e6)
        with store.read() as session:
            from sqlalchemy import func, select

            from proofplane.store.tables import telemetry_samples

            rows = session.scalar(select(func.count()).select_from(telemetry_samples)) or 0
        store.dispose()
        size = _db_bytes(path)
        posts = (args.runs * args.intervals + 1) * nodes
        median = statistics.median(runs)
        return {
            # a sample is the issue's: one device's (a GPU's or a MIG instance's) readings at
            # one interval; 17 devices per post (8 GPUs, 9 MIG instances)
            "samples_per_s": round(median),
            "samples_per_s_runs": [round(r) for r in runs],
            "target_samples_per_s": 20_000,
            "meets": median >= 20_000,
            # the same runs counted in field readings (17 per GPU, 5 per MIG instance)
            "readings_per_s": round(statistics.median(readings_runs)),
            "readings_per_s_runs": [round(r) for r in readings_runs],
            "posts_per_s": round(statistics.median(posts_runs), 1),
            "cpu_us_per_sample": round(statistics.median(cpu_runs), 2),
            # samples per CPU-second of the one thread: "on one core" on a machine others
            # share (the wall-clock figure above counts the time the thread waited for a core)
            "samples_per_cpu_s": round(1e6 / statistics.median(cpu_runs)),
            "devices_per_post": DEVICES_PER_POST,
            "readings_per_post": readings_per_post,
            # the fleet: 5,000 nodes x 8 GPUs every 15 s
            "fleet_gpu_samples_per_s_5000x8_every_15s": round(5000 * 8 / 15),
            "fleet_samples_per_s_5000_nodes_every_15s": round(5000 * DEVICES_PER_POST / 15),
            "nodes": nodes,
            "gpus": nodes * 8,
            "workloads": counts.get("workloads"),
            # a shared GPU's sample is stored once per holder (and once for the rest)
            "stored_rows_per_post": round(rows / posts, 1),
            "stored_readings_per_post": round(stored / posts, 1),
            "intervals_per_run": args.intervals,
            "runs": args.runs,
            "bytes_per_sample": round(size / max(rows, 1), 1),
            "bytes_per_reading": round(size / max(stored, 1), 1),
            "db_size_bytes": size,
            "cluster_load_s": round(load_s, 2),
            "uptime_before": uptime_before,
            "uptime_after": _uptime(),
            "path": "json.loads + service.telemetry.ingest (the route's call), one write "
            "transaction per post, one thread, SQLite WAL",
        }


# --- metrics_scrape (M2) -----------------------------------------------------------------------


def _scrape_fleet(tmp: str, nodes: int, workloads: int) -> tuple[Store, dict[str, Any]]:
    """A SQLite store holding the placement bench's fleet (``bench/placement.py``: 8 H100 per
    node, half of the nodes MIG with mixed layouts, 20 zones, mixed certifications, a dozen
    tenants) with ``workloads`` asks submitted through ``submit_workloads`` (500 per
    transaction), and each GPU's newest utilisation, frame buffer and power reading written to
    ``telemetry_device_latest`` directly, one row per GPU (what ingest leaves there; posting
    5,000 nodes' readings would time ingest, not the scrape)."""
    import random as _random

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import placement as pl
    from proofplane.service.workloads import submit_workloads
    from proofplane.store.tables import TELEMETRY_COLUMNS, telemetry_device_latest

    entries = pl.build_cluster(_random.Random(7), nodes)
    asks = pl.make_asks(_random.Random(9), workloads, "m")
    store, load_s = pl._e2e_store(tmp, entries)
    t0 = time.perf_counter()
    placed = 0
    for at in range(0, len(asks), 500):
        out = submit_workloads(store, SYSTEM, [pl._spec(a) for a in asks[at : at + 500]])
        placed += sum(w.placement is not None for w in out)
    submit_s = time.perf_counter() - t0
    holder: dict[str, tuple[str, str]] = {}
    with store.read() as session:
        from sqlalchemy import select

        from proofplane.store.tables import PlacementRow, TenantRow, WorkloadRow

        for tenant, name, devices in session.execute(
            select(TenantRow.name, WorkloadRow.name, PlacementRow.devices)
            .join(WorkloadRow, WorkloadRow.tenant_id == TenantRow.id)
            .join(PlacementRow, PlacementRow.workload_id == WorkloadRow.id)
            .where(PlacementRow.members.is_(None))
        ):
            for d in devices:
                if d.get("mig_profile") is None and d.get("share_milli") is None:
                    holder[d["gpu_uuid"]] = (tenant, name)
    ms = int(datetime.now(UTC).timestamp() * 1000)
    cols = {f: TELEMETRY_COLUMNS[f] for f in (F.GR_ENGINE_ACTIVE, F.FB_USED, F.POWER_USAGE)}
    rows = []
    for node, _certs in entries:
        for gpu in node.gpus:
            tenant, name = holder.get(gpu.uuid, (None, None))
            rows.append({"key": f"{gpu.uuid}|", "node": node.name, "gpu_uuid": gpu.uuid,
                         "gi_id": None, "profile": None, "ts": ms, "workload": name,
                         "tenant": tenant, "simulated": True,
                         cols[F.GR_ENGINE_ACTIVE]: 0.6, cols[F.FB_USED]: 40960.0,
                         cols[F.POWER_USAGE]: 450.0})  # fmt: skip
    with store.write(SYSTEM) as tx:
        from sqlalchemy import insert

        tx.session.execute(insert(telemetry_device_latest), rows)
    return store, {
        "cluster_load_s": round(load_s, 2),
        "submit_s": round(submit_s, 2),
        "workloads_placed": placed,
        "telemetry_latest_devices": len(rows),
    }


def metrics_scrape(args: argparse.Namespace) -> dict[str, Any]:
    """**metrics_scrape** (target: ``GET /metrics`` of a 5,000-node fleet ≤ 200 ms). The fleet
    of :func:`_scrape_fleet` (``--scrape-nodes``, ``--scrape-workloads``); the timed path is
    ``GET /metrics`` through the whole application in process (FastAPI's TestClient: the
    middleware, the token check, ``service.metrics``: the control-plane queries, the fleet from
    the scheduler cache, per-tenant telemetry in SQL, the exposition), one thread, SQLite WAL.
    Figures, each the median of ``--scrapes`` scrapes: ``scrape_ms`` with this process's
    scheduler current (the usual case); ``scrape_after_writes_ms`` when another process has
    submitted 100 workloads since the last scrape (the cache catches up from the event stream
    first); ``first_scrape_ms`` is the first scrape of a process, which loads the cluster into
    its scheduler once (reported, not the figure). The per-tenant telemetry aggregate is
    refreshed in the background every ``TELEMETRY_TTL_S`` (a scrape serves what it has): its
    query is timed apart, ``telemetry_query_ms`` (median of ``--scrapes`` calls)."""
    from fastapi.testclient import TestClient

    from proofplane.api.app import create_app
    from proofplane.service import metrics as metrics_svc
    from proofplane.service.access import bootstrap_admin
    from proofplane.service.workloads import WorkloadSpec, submit_workloads

    token = "ppt_bench-metrics-scrape-token-0123456789"
    with tempfile.TemporaryDirectory(prefix="pp-bench-metrics-") as tmp:
        store, setup = _scrape_fleet(tmp, args.scrape_nodes, args.scrape_workloads)
        bootstrap_admin(store, token)
        store.dispose()
        # a fresh engine: this "process" has no scheduler cache yet
        store = Store(f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            app = create_app(store)
            with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
                t0 = time.perf_counter()
                first = client.get("/metrics")
                first_ms = (time.perf_counter() - t0) * 1e3
                assert first.status_code == 200, first.text
                warm = []
                for _ in range(args.scrapes):
                    t0 = time.perf_counter()
                    r = client.get("/metrics")
                    warm.append((time.perf_counter() - t0) * 1e3)
                    assert r.status_code == 200
                body = r.content
                other = Store(store.url)  # another process's writes: its own engine and cache
                after = []
                try:
                    for i in range(args.scrapes):
                        specs = [
                            WorkloadSpec(
                                f"late-{i}-{k}", "research-1", gpus=_share(250)
                            )  # fmt: skip
                            for k in range(100)
                        ]
                        submit_workloads(other, SYSTEM, specs)
                        t0 = time.perf_counter()
                        r = client.get("/metrics")
                        after.append((time.perf_counter() - t0) * 1e3)
                        assert r.status_code == 200
                finally:
                    other.dispose()
            fields = [f[0] for f in metrics_svc.TENANT_FIELDS]
            since = datetime.now(UTC) - timedelta(minutes=5)
            query = []
            for _ in range(args.scrapes):
                t0 = time.perf_counter()
                tel.tenant_latest(store, fields=fields, since=since)
                query.append((time.perf_counter() - t0) * 1e3)
        finally:
            store.dispose()
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    return {
        "scrape_ms": round(statistics.median(warm), 1),
        "scrape_p90_ms": round(sorted(warm)[int(0.9 * (len(warm) - 1))], 1),
        "scrape_after_writes_ms": round(statistics.median(after), 1),
        "first_scrape_ms": round(first_ms, 1),
        "telemetry_query_ms": round(statistics.median(query), 1),
        "target_ms": 200,
        "meets": statistics.median(warm) <= 200,
        "scrapes": args.scrapes,
        "nodes": args.scrape_nodes,
        "gpus": args.scrape_nodes * 8,
        "workloads_submitted": args.scrape_workloads,
        **setup,
        "series": len(lines),
        "exposition_bytes": len(body),
        "path": "GET /metrics through the application in process (TestClient), one thread, "
        "SQLite WAL; per-tenant telemetry refreshed in the background (its query timed apart)",
    }


def _share(milli: int) -> Any:
    from proofplane.model import GpuRequest

    return GpuRequest(1, share_milli=milli)


# --- usage_report (M3) -------------------------------------------------------------------


def usage_report(args: argparse.Namespace) -> dict[str, Any]:
    """The usage report for one month of a 5,000-node fleet (about 10 million events; target
    ≤ 10 s): ``bench/usage_report.py``'s measurement (its docstring says how the history is
    built and what is timed; run alone, it prints the same section)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import usage_report as usage_bench  # bench/usage_report.py

    shape = dict(usage_bench.QUICK) if args.quick else {
        "nodes": args.usage_nodes, "days": args.usage_days, "events": args.usage_events,
        "runs": args.usage_runs,
    }  # fmt: skip
    return usage_bench.measure(**shape, db=args.usage_db, quick=args.quick)


#: The sections, in the order they run; each takes the parsed arguments and returns its JSON.
SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "ingest": ingest,
    "metrics_scrape": metrics_scrape,
    "usage_report": usage_report,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    ap.add_argument("--quick", action="store_true", help="a small CI-sized run")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS),
                    help="run only these sections (repeatable)")  # fmt: skip
    ap.add_argument("--nodes", type=int, default=100, help="ingest: nodes of 8 GPUs")
    ap.add_argument("--intervals", type=int, default=5, help="ingest: intervals per run")
    ap.add_argument("--runs", type=int, default=5, help="ingest: runs (the median is the figure)")
    ap.add_argument("--scrape-nodes", type=int, default=5000, help="metrics_scrape: nodes")
    ap.add_argument("--scrape-workloads", type=int, default=20_000,
                    help="metrics_scrape: workloads submitted (most are placed)")  # fmt: skip
    ap.add_argument("--scrapes", type=int, default=20, help="metrics_scrape: timed scrapes")
    ap.add_argument("--usage-nodes", type=int, default=5000, help="usage_report: nodes")
    ap.add_argument("--usage-days", type=int, default=30, help="usage_report: days of history")
    ap.add_argument("--usage-events", type=int, default=10_000_000,
                    help="usage_report: events in the history")  # fmt: skip
    ap.add_argument("--usage-runs", type=int, default=3, help="usage_report: timed reports")
    ap.add_argument("--usage-db", default=None,
                    help="usage_report: the history file, kept between runs "
                    "(default: /tmp/pp-bench-usage-NODES-DAYS-EVENTS.db)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.intervals, args.runs = 10, 2, 3
        args.scrape_nodes, args.scrape_workloads, args.scrapes = 100, 400, 5
    out: dict[str, Any] = {"machine": machine(), "pid": os.getpid()}
    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        out[name] = section(args)
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
