"""Benchmark: the usage report for one month of a 5,000-node fleet (issue 15, §5 figure:
about 10 million events, target ≤ 10 s).

**The database.** Writing 10 million events through the services would take hours, so the
``events`` table of a migrated SQLite store is filled by bulk inserts of rows shaped exactly
like the ones the server writes: the same columns, ``ts`` as the column type's own stored
text, ``details`` as ``audit.canonical.stored_details`` stores them, built by the very
functions the services use (``service.cluster.register_details`` for ``node.register``,
``service.scheduling.decision_fields`` and ``placement_json`` for ``workload.place`` and
``workload.evict``, the detail keys of ``workload.submit``, ``.dispatch``, ``.running``,
``.succeeded``, ``.cancel`` and ``node.attest`` as written today; a nonce's issue writes no
event since issue 20).
The Merkle hashes (``audit_hashes``) are not written: the report never reads them
(``bench/audit.py`` measures the log itself). The history is a discrete-event simulation in
time order: 5,000 nodes of 8 GPUs (H100, A100, H200, B200); 70 % of the nodes run whole-GPU
jobs of 1, 2, 4 or 8 GPUs, 20 % MIG instances (7 x 1g or 2 x 3g per GPU), 10 % quarter GPUs
(``share_milli`` 250); 50 tenants in three compliance pools; each job submit, place, dispatch,
running, succeeded, with 3 % evicted by a node failure and re-placed, 4 % cancelled; every
node attests every two hours (its verdict). The job length is chosen so the month holds
``--events`` events. The file is kept (``--db``) and reused by later runs with the same shape.

**The figure.** ``report_s``: wall time of ``service.usage.usage_report`` (what ``GET
/api/v1/usage`` and ``proofplane usage report --db`` run) for the whole month, every tenant,
grouped by SKU, priced with the shipped rate card, then rendered as FOCUS CSV: the median of
``--runs`` runs on a warm page cache (``report_s_runs`` lists them; ``report_s_cold`` is the
first). A log this large is metered by one worker process per CPU (``workers``), each
reading one consecutive range of the log, the holds open at a range's end joined to the
next range's releases (``meter.usage.join_ranges``); ``report_cpu_s`` is
the CPU time of the run, parent and workers together (on a shared machine the wall time
depends on what else runs: the CPU time does much less). ``peak_rss_mib`` is the parent's
peak resident memory (the report streams: no event objects are kept).
``events_per_s`` = events in the log / report_s.

    .venv/bin/python bench/usage_report.py --json [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.dialects import sqlite as sqlite_dialect

from proofplane.access import SYSTEM
from proofplane.audit.canonical import stored_details
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.hardware.skus import SKUS
from proofplane.machine import machine as common_machine
from proofplane.model import Gpu, GpuRequest, Node, PlacedDevice, Placement
from proofplane.service import usage as usage_svc
from proofplane.service.cluster import register_details
from proofplane.service.context import Store
from proofplane.service.scheduling import decision_fields, placement_json
from proofplane.store import migrate
from proofplane.store.tables import EventRow

START = datetime(2026, 1, 1, tzinfo=UTC)
TARGET_S = 10.0
MODELS = ["H100-80GB"] * 6 + ["A100-80GB"] * 2 + ["H200-141GB", "B200-180GB"]
MIG_LAYOUTS = {  # per GPU: (profile, instances)
    "H100-80GB": [("1g.10gb", 7), ("3g.40gb", 2)],
    "A100-80GB": [("1g.10gb", 7), ("3g.40gb", 2)],
    "H200-141GB": [("1g.18gb", 7), ("3g.71gb", 2)],
    "B200-180GB": [("1g.23gb", 7), ("3g.90gb", 2)],
}
POOLS = [{"gdpr-zone": "eu-central"}, {"hipaa": "true"}, {}]
EVENTS_PER_JOB = 5.25  # submit, place, dispatch, running, end (+ evictions and re-places)
ATTEST_EVERY = timedelta(hours=2)


def machine() -> dict[str, Any]:
    return {**common_machine(), "sqlite": sqlite3.sqlite_version}


class Writer:
    """Rows into ``events`` exactly as ``Tx.record`` stores them on SQLite."""

    BATCH = 50_000

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.seq = 0
        self.rows: list[tuple[Any, ...]] = []
        self.count = 0
        dialect = sqlite_dialect.dialect()  # the column type's own processing, as Tx writes
        self._ts_bind = EventRow.__table__.c.ts.type.dialect_impl(dialect).bind_processor(dialect)
        self._ts_cache: dict[datetime, str] = {}

    def ts(self, when: datetime) -> str:
        text = self._ts_cache.get(when)
        if text is None:
            if len(self._ts_cache) > 10_000:
                self._ts_cache.clear()
            text = self._ts_cache[when] = self._ts_bind(when)
        return text

    def add(
        self,
        when: datetime,
        actor: str,
        action: str,
        target_type: str,
        target_id: str,
        details: dict[str, Any],
        outcome: str = "success",
    ) -> None:
        self.seq += 1
        stored = stored_details(details)[1]
        self.rows.append(
            (self.seq, self.ts(when), actor, action, target_type, target_id, outcome, stored)
        )
        if len(self.rows) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        self.conn.executemany(
            "INSERT INTO events (seq, ts, actor, action, target_type, target_id, outcome, "
            "details) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            self.rows,
        )
        self.count += len(self.rows)
        self.rows.clear()


class Lane:
    """One stream of back-to-back jobs on fixed devices of one node."""

    __slots__ = ("node", "devices", "gpus", "state", "tenant", "tags", "name", "job_id")

    def __init__(self, node: str, devices: tuple[PlacedDevice, ...], gpus: GpuRequest) -> None:
        self.node, self.devices, self.gpus = node, devices, gpus
        self.state = "idle"
        self.tenant = ""
        self.tags: dict[str, str] = {}
        self.name = ""
        self.job_id = ""


def build(path: Path, nodes: int, days: int, events: int, seed: int = 15) -> dict[str, Any]:
    """Write the month's history into a fresh migrated SQLite file at ``path``."""
    t0 = time.perf_counter()
    if path.exists():
        path.unlink()
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    store.dispose()
    rng = random.Random(seed)
    end = START + timedelta(days=days)
    lanes: list[Lane] = []
    node_objs: list[Node] = []
    for i in range(nodes):
        name = f"node-{i:05d}"
        model = MODELS[i % len(MODELS)]
        mig = (i // len(MODELS)) % 10 in (7, 8)
        gpus = tuple(
            Gpu(g, gpu_uuid(name, g), model, SKUS[model].memory_mb, mig_enabled=mig)
            for g in range(8)
        )
        node_objs.append(Node(name=name, region="eu-central", zone=f"z{i % 3}", gpus=gpus))
        kind = (i // len(MODELS)) % 10
        if kind < 7:  # whole GPUs: lanes of 1, 2, 4 or 8
            size = (1, 2, 4, 8)[i % 4]
            for first in range(0, 8, size):
                devs = tuple(PlacedDevice(g, gpus[g].uuid) for g in range(first, first + size))
                lanes.append(Lane(name, devs, GpuRequest(count=size)))
        elif kind < 9:  # MIG instances
            profile, n = MIG_LAYOUTS[model][i % 2]
            for g in range(8):
                for k in range(n):
                    dev = PlacedDevice(g, gpus[g].uuid, profile, k, None)
                    lanes.append(Lane(name, (dev,), GpuRequest(count=1, mig_profile=profile)))
        else:  # quarter GPUs
            for g in range(8):
                for _k in range(4):
                    dev = PlacedDevice(g, gpus[g].uuid, None, None, 250)
                    lanes.append(Lane(name, (dev,), GpuRequest(count=1, share_milli=250)))
    hours = days * 24
    attest_events = nodes * (hours // 2)  # one a round: its verdict (node.attest)
    jobs = max(1.0, (events - nodes - attest_events) / EVENTS_PER_JOB)
    cycle_h = len(lanes) * hours / jobs  # mean job length plus the gap after it
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    w = Writer(conn)
    register_at = START - timedelta(days=1)
    for n in node_objs:
        w.add(register_at, "operator", "node.register", "node", n.name, register_details(n))
    heap: list[tuple[datetime, int, int]] = []
    for li in range(len(lanes)):  # first jobs spread over the first cycle
        heapq.heappush(heap, (START + timedelta(hours=rng.random() * cycle_h), 1, li))
    for ni in range(nodes):
        heapq.heappush(heap, (START + ATTEST_EVERY * rng.random(), 0, ni))
    serials = itertools.count(1)
    round_n = 0
    while heap:
        when, kind, idx = heapq.heappop(heap)
        if when >= end:
            continue
        if kind == 0:  # a node's attestation round
            node = node_objs[idx]
            round_n += 1
            w.add(
                when + timedelta(milliseconds=40),
                f"node:{node.name}",
                "node.attest",
                "node",
                node.name,
                {
                    "evidence_id": round_n,
                    "evidence_hash": f"{round_n * 7919:064x}",
                    "policy_id": 1,
                    "policy_hash": "ab" * 32,
                    "node_class": "gpu-h100",
                    "ok": True,
                    "reasons": [],
                    "enforce": True,
                    "gpu_uuids": sorted(g.uuid for g in node.gpus),
                },
            )
            heapq.heappush(heap, (when + ATTEST_EVERY, 0, idx))
            continue
        nxt = _step(w, rng, lanes[idx], when, cycle_h, serials)
        heapq.heappush(heap, (nxt, 1, idx))
    w.flush()
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("ANALYZE")
    conn.close()
    return {
        "events": w.count,
        "nodes": nodes,
        "gpus": nodes * 8,
        "lanes": len(lanes),
        "days": days,
        "mean_cycle_h": round(cycle_h, 2),
        "build_s": round(time.perf_counter() - t0, 1),
        "db_bytes": path.stat().st_size,
    }


def _step(
    w: Writer,
    rng: random.Random,
    lane: Lane,
    when: datetime,
    cycle_h: float,
    serials: Iterator[int],
) -> datetime:
    """The lane's next event at ``when``; returns when the one after it is due."""
    g = lane.gpus
    if lane.state == "idle":  # a new job: submitted and placed at once
        job = next(serials)
        tenant_n = rng.randrange(50)
        lane.tenant = f"tenant-{tenant_n:02d}"
        lane.tags = POOLS[tenant_n % 3]
        lane.name = f"job-{job:08d}"
        lane.job_id = str(1_000_000 + job)
        fields = decision_fields(lane.tenant, lane.tags, _isolation(g), g)
        submit = {**fields, "priority": 0, "command": ["python", "train.py", "--epochs", "10"]}
        w.add(when, "ci-bot", "workload.submit", "workload", lane.name, submit)
        _place(w, lane, when, fields)
        lane.state = "placed"
        return when + timedelta(seconds=5 + rng.random() * 20)
    fields = decision_fields(lane.tenant, lane.tags, _isolation(g), g)
    if lane.state == "placed":  # handed to the engine, and running
        w.add(when, "ci-bot", "workload.dispatch", "workload", lane.name,
              {"backend": "slurm", "job_id": lane.job_id, "node": lane.node})  # fmt: skip
        w.add(when + timedelta(seconds=2), "system", "workload.running", "workload", lane.name,
              {"backend": "slurm", "job_id": lane.job_id, "message": "RUNNING"})  # fmt: skip
        lane.state = "running"
        return when + timedelta(hours=rng.expovariate(1 / (0.8 * cycle_h)))
    if lane.state == "running":
        roll = rng.random()
        if roll < 0.03:  # the node failed: evicted, and re-placed on this lane a little later
            w.add(when, "system", "workload.evict", "workload", lane.name, {
                **fields, "node": lane.node, "nodes": [lane.node], "reason": "node_failed",
                "message": f"node {lane.node} failed: engine: node lost"})  # fmt: skip
            lane.state = "evicted"
            return when + timedelta(minutes=1 + rng.random() * 30)
        if roll < 0.07:
            cancel = {"tenant": lane.tenant, "from_status": "running", "node": lane.node,
                      "reason": "not needed"}  # fmt: skip
            w.add(when, "ci-bot", "workload.cancel", "workload", lane.name, cancel)
        else:
            w.add(when, "system", "workload.succeeded", "workload", lane.name, {
                "tenant": lane.tenant, "backend": "slurm", "job_id": lane.job_id,
                "message": "COMPLETED", "exit_code": 0})  # fmt: skip
        lane.state = "idle"
        return when + timedelta(hours=rng.expovariate(1 / (0.2 * cycle_h)))
    # evicted: placed again
    _place(w, lane, when, fields)
    lane.state = "running"
    return when + timedelta(hours=rng.expovariate(1 / (0.4 * cycle_h)))


def _isolation(g: GpuRequest) -> str:
    return g.natural_isolation.value


def _place(w: Writer, lane: Lane, when: datetime, fields: dict[str, Any]) -> None:
    placement = Placement(lane.node, lane.devices)
    w.add(when, "ci-bot", "workload.place", "workload", lane.name,
          {**fields, **placement_json(placement)})  # fmt: skip


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the worker processes)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_report(path: Path, days: int) -> tuple[float, float, dict[str, Any], bytes]:
    store = Store(f"sqlite:///{path}")
    try:
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        report = usage_svc.usage_report(
            store,
            SYSTEM,
            start=START,
            end=START + timedelta(days=days),
            now=datetime.now(UTC),
            group_by="sku",
        )
        body = usage_svc.render(report, "focus")
        elapsed = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
    finally:
        store.dispose()
    summary = {
        "lines": len(report.lines),
        "tenants": len(report.tenants),
        "gpu_hours": str(report.total_gpu_hours),
        "billed": f"{report.total_billed_cost} {report.currency}",
    }
    return elapsed, cpu, summary, body


def _workers(events: int) -> int:
    """The worker processes ``service.usage`` meters this log with (0: in-process)."""
    cpus = os.cpu_count() or 1
    return min(cpus, 8) if cpus > 1 and events >= usage_svc.PARALLEL_FROM else 0


def measure(
    *,
    nodes: int,
    days: int,
    events: int,
    runs: int,
    db: str | None = None,
    rebuild: bool = False,
    quick: bool = False,
) -> dict[str, Any]:
    """Build (or reuse) the history and time the report over it (the module docstring); the
    figure's JSON without the machine (``bench/telemetry.py``'s ``usage_report`` section)."""
    os.environ.setdefault("PROOFPLANE_AUDIT_KEY_FILE", str(Path(tempfile.gettempdir()) / "k"))
    path = Path(db or Path(tempfile.gettempdir()) / f"pp-bench-usage-{nodes}-{days}-{events}.db")
    meta_path = path.with_suffix(".json")
    if rebuild or not path.exists() or not meta_path.exists():
        meta = build(path, nodes, days, events)
        meta_path.write_text(json.dumps(meta))
    else:
        meta = {**json.loads(meta_path.read_text()), "reused": True}
    times: list[float] = []
    cpus: list[float] = []
    summary: dict[str, Any] = {}
    bodies: set[bytes] = set()
    for _ in range(runs):
        elapsed, cpu, summary, body = run_report(path, days)
        times.append(round(elapsed, 3))
        cpus.append(round(cpu, 3))
        bodies.add(body)
    report_s = statistics.median(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "quick": quick,
        "history": meta,
        "report_s": report_s,
        "report_s_runs": times,
        "report_s_cold": times[0],
        "report_cpu_s": statistics.median(cpus),
        "report_cpu_s_runs": cpus,
        "workers": _workers(meta["events"]),
        "events_per_s": round(meta["events"] / report_s),
        "peak_rss_mib": round(peak, 1),
        "same_bytes_every_run": len(bodies) == 1,
        "report": summary,
        "target_report_s": TARGET_S,
        "meets": report_s <= TARGET_S,
        "figure": "usage report, one month, all tenants, group_by=sku, FOCUS CSV rendered",
    }


#: --quick: a CI-sized history
QUICK = {"nodes": 50, "days": 3, "events": 30_000, "runs": 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CI-sized sanity run")
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--events", type=int, default=10_000_000, help="events in the month")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--db",
        default=None,
        help="the history file, kept between runs "
        "(default: /tmp/pp-bench-usage-NODES-DAYS-EVENTS.db)",
    )
    ap.add_argument("--rebuild", action="store_true", help="write the history file again")
    args = ap.parse_args(argv)
    shape = dict(QUICK) if args.quick else {
        "nodes": args.nodes, "days": args.days, "events": args.events, "runs": args.runs,
    }  # fmt: skip
    out = {
        "machine": machine(),
        **measure(**shape, db=args.db, rebuild=args.rebuild, quick=args.quick),
    }
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        h = out["history"]
        print(
            f"usage report: {h['events']:,} events ({h['nodes']} nodes, {h['days']} days) in "
            f"{out['report_s']:.2f} s (median of {out['report_s_runs']}; CPU "
            f"{out['report_cpu_s']:.2f} s, {out['workers']} worker processes); target "
            f"{TARGET_S} s: {'met' if out['meets'] else 'NOT met'}; peak RSS "
            f"{out['peak_rss_mib']} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
