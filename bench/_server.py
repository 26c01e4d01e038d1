"""Shared by the HTTP benchmarks (bench/api.py, bench/fleet.py, bench/api_tls.py,
bench/governance.py): a real ``proofplane serve`` subprocess on a fresh database, the demo
cluster loaded into it, a throwaway PostgreSQL database, percentiles, the CPU time of a
server's processes from /proc, and the load generators' lean keep-alive connection
(``RawConn``). Not a benchmark itself."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.db import WRITE_LOCK_KEY

SERVE = [sys.executable, "-m", "proofplane.cli.main", "serve"]


class RawConn:
    """One keep-alive HTTP/1.1 connection that sends prebuilt request bytes and reads the
    answer by its ``Content-Length``: a few microseconds of the generator's CPU a request, where
    httpx's asyncio client took about as much CPU as the server spent answering (issue 20: the
    generator shares the two cores with the server, so what it saves the server gets).
    ``retry_after``: the last answer's ``Retry-After`` in seconds (None: it had none)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.retry_after: float | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> RawConn:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def request(self, head: bytes, body: bytes = b"") -> tuple[int, bytes, bool]:
        """The status, the body and whether the server closes the connection after it."""
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        length, close, self.retry_after = 0, False, None
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value.strip().lower() == b"close"
            elif name == b"retry-after":
                self.retry_after = float(value)
            elif name == b"transfer-encoding":
                raise ValueError("a chunked answer: not what these endpoints send")
        return status, await self.reader.readexactly(length), close

    def close(self) -> None:
        self.writer.close()


def http_head(method: str, path: str, host: str, token: str, body: bytes | None = None) -> bytes:
    """A request's line and headers (bearer ``token``; a JSON ``body``'s type and length)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {token}"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_demo(url: str, token: str) -> None:
    """Migrate ``url`` and load the demo cluster with an admin holding ``token``. The demo's
    workloads come as placements only: serve's local executor would otherwise run their
    commands as processes beside the benchmark (an engine's jobs outlive the server)."""
    store = Store(url)
    try:
        migrate.upgrade(store.engine)
        text = (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text("utf-8")
        spec = parse_cluster(text)
        spec = dataclasses.replace(
            spec, workloads=tuple(dataclasses.replace(w, command=()) for w in spec.workloads)
        )
        load_cluster(store, SYSTEM, spec)
        bootstrap_admin(store, token)
    finally:
        store.dispose()


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``xs``; 0.0 when empty."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def serve_supports_workers() -> bool:
    """Whether this ``proofplane serve`` takes ``--workers`` (issue 20 adds it)."""
    out = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, timeout=60)
    return "--workers" in out.stdout


@contextmanager
def throwaway_postgres(admin_url: str) -> Iterator[str]:
    """A fresh database on the server of ``admin_url`` (e.g. postgresql://…/test), dropped
    afterwards; yields its URL."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    name = f"pp_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


class Server:
    """One ``proofplane serve`` process: access logs to /dev/null, stderr kept in ``log`` to
    explain a failure; background workers that would add load of their own (SIEM export,
    engine sync) off unless ``env`` turns them on."""

    def __init__(
        self,
        db: str,
        workdir: Path,
        *,
        workers: int | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"serve-{self.port}.log"
        cmd = [*SERVE, "--db", db, "--port", str(self.port), *(args or [])]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        full_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")},
            "PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS": "0",
            "PROOFPLANE_EXECUTION_SYNC_SECONDS": "0",
            "PROOFPLANE_MASTER_KEY_FILE": str(workdir / "master.key"),
            "PROOFPLANE_AUDIT_KEY_FILE": str(workdir / "audit.key"),
            **(env or {}),
        }
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=err)

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.base}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("the server did not start")

    def pids(self) -> list[int]:
        """The server process and its descendants (``--workers`` children)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    kids = (task / "children").read_text().split()
                    todo.extend(int(k) for k in kids)
            except OSError:
                continue
        return out

    def cpu_seconds(self) -> dict[int, float]:
        """user+system CPU seconds of each process (``pids``), from /proc/<pid>/stat."""
        out = {}
        for pid in self.pids():
            seconds = pid_cpu_seconds(pid)
            if seconds is not None:
                out[pid] = seconds
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def errors_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def positive(text: str) -> int:
    """argparse type: a whole number of at least 1 (a clear usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def pid_cpu_seconds(pid: int) -> float | None:
    """user+system CPU seconds of process ``pid`` (None: gone), from /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def engine_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


class LockSampler:
    """Samples ``pg_locks`` of one database every ``interval`` s: backends waiting on the
    write lock (an advisory lock with the write lock's key) and whether anyone holds it."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        self.engine = create_engine(engine_url(url), isolation_level="AUTOCOMMIT")
        self.interval = interval
        self.waiting: list[int] = []
        self.busy: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        query = text(
            "SELECT count(*) FILTER (WHERE NOT l.granted), count(*) FILTER (WHERE l.granted) "
            "FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND d.datname = current_database() "
            "AND l.objid = :key"
        )
        with self.engine.connect() as conn:
            while not self._stop.wait(self.interval):
                waiting, held = conn.execute(query, {"key": WRITE_LOCK_KEY}).one()
                self.waiting.append(int(waiting))
                self.busy.append(bool(waiting or held))

    def __enter__(self) -> LockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()

    def summary(self) -> dict[str, Any]:
        n = len(self.waiting)
        return {
            "samples": n,
            "write_lock_waiters": round(statistics.fmean(self.waiting), 2) if n else None,
            "write_lock_busy": round(sum(self.busy) / n, 3) if n else None,
        }


def own_cpu_seconds(children: bool = False) -> float:
    """user+system CPU seconds of this process (the load generator), and with ``children``
    of its finished child processes too (generators run in a process pool)."""
    usages = [resource.getrusage(resource.RUSAGE_SELF)]
    if children:
        usages.append(resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usages)


def write_lock(metrics_text: str) -> dict[str, float]:
    """From a ``/metrics`` exposition: ``proofplane_db_write_lock_seconds``' count and sum per
    phase (``wait_count``, ``wait_sum``, ``held_count``, ``held_sum``), summed over workers."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {f"{p}_{k}": 0.0 for p in ("wait", "held") for k in ("count", "sum")}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "proofplane_db_write_lock_seconds":
            continue
        for s in family.samples:
            phase = s.labels.get("phase")
            for k in ("count", "sum"):
                if s.name.endswith(f"_{k}") and phase in ("wait", "held"):
                    out[f"{phase}_{k}"] += s.value
    return out


def metrics_text(base: str, token: str) -> str:
    """The server's ``/metrics`` exposition (every worker's counts summed), read with ``token``."""
    r = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    if r.status_code != 200:
        raise SystemExit(f"GET /metrics: {r.status_code} {r.text[:300]}")
    return r.text


def histogram_buckets(metrics_text: str, family_name: str, **labels: str) -> dict[float, float]:
    """From a ``/metrics`` exposition: a histogram's cumulative bucket counts, ``{upper bound:
    observations at most that}``, summed over the workers (and over the labels not given)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != family_name:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket") and all(s.labels.get(k) == v for k, v in labels.items()):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def loop_lag(metrics_text: str) -> dict[float, float]:
    """``proofplane_event_loop_lag_seconds``' cumulative buckets, summed over the workers."""
    return histogram_buckets(metrics_text, "proofplane_event_loop_lag_seconds")


def gc_pauses(metrics_text: str) -> dict[str, tuple[dict[float, float], float]]:
    """``proofplane_gc_pause_seconds`` by generation ("0", "1", "2"), summed over the workers:
    (cumulative buckets, seconds in all)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[dict[float, float], float]] = {g: ({}, 0.0) for g in ("0", "1", "2")}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "proofplane_gc_pause_seconds":
            continue
        for s in family.samples:
            g = s.labels.get("generation")
            if g not in out:
                continue
            buckets, total = out[g]
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                out[g] = (buckets, total + s.value)
    return out


def _bucket_delta(
    before: dict[float, float], after: dict[float, float]
) -> tuple[list[float], dict[float, float], float]:
    """(bounds, cumulative counts between two bucket readings, how many in all)."""
    bounds = sorted(after)
    cum = {le: after[le] - before.get(le, 0.0) for le in bounds}
    return bounds, cum, cum.get(math.inf, 0.0)


def _bound_of(bounds: list[float], cum: dict[float, float], n: float) -> float | None:
    """The first bucket bound (ms) by which ``n`` observations are in; None past the last."""
    for le in bounds:
        if cum[le] >= n:
            return None if math.isinf(le) else round(le * 1000, 1)
    return None


def gc_pauses_delta(
    before: dict[str, tuple[dict[float, float], float]],
    after: dict[str, tuple[dict[float, float], float]],
    seconds: float,
) -> dict[str, Any]:
    """The workers' garbage collections between two :func:`gc_pauses` readings, by
    generation: how many, the bucket bound the longest fell within (ms; None: past 1 s), and
    ``stopped_share``: the collections' time over ``seconds`` (summed over the workers, so
    two workers each stopped 1 % of the time give 0.02)."""
    out: dict[str, Any] = {}
    for g, (cum_after, sum_after) in after.items():
        cum_before, sum_before = before.get(g, ({}, 0.0))
        bounds, cum, count = _bucket_delta(cum_before, cum_after)
        out[g] = {
            "collections": int(count),
            "longest_within_ms": _bound_of(bounds, cum, count) if count else 0.0,
            "stopped_share": round((sum_after - sum_before) / seconds, 4) if seconds > 0 else None,
        }
    return out


def histogram_delta(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """Between two cumulative bucket readings (:func:`histogram_buckets`): how many
    observations, the share above 10 ms, and p50/p99 as the bucket bound they fall within
    (ms; None: past the last bound)."""
    bounds, cum, count = _bucket_delta(before, after)
    if count <= 0:
        return {"count": 0, "over_10ms_share": None, "p50_ms": None, "p99_ms": None}
    within_10ms = next((cum[le] for le in bounds if abs(le - 0.01) < 1e-9), None)
    return {
        "count": int(count),
        "over_10ms_share": None if within_10ms is None else round(1 - within_10ms / count, 4),
        "p50_ms": _bound_of(bounds, cum, 0.5 * count),
        "p99_ms": _bound_of(bounds, cum, 0.99 * count),
    }


def loop_lag_delta(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """How late the workers' event loops woke between two :func:`loop_lag` readings: probes,
    the share later than 10 ms, and p50/p99 as the bucket bound they fall within (ms; None:
    past the last bound, 1 s). A request arriving at such a moment waits at least that
    long before the loop can refuse it."""
    out = histogram_delta(before, after)
    return {"probes": out.pop("count"), **out}


def refusals(metrics_text: str) -> dict[float, float]:
    """``proofplane_http_request_duration_seconds`` of the requests refused before routing
    (route ``<refused>``: the overload's 429s, a body limit's 413s), summed over the workers:
    the server's own time for them, from the ASGI call to the answer's last byte."""
    name = "proofplane_http_request_duration_seconds"
    return histogram_buckets(metrics_text, name, route="<refused>")


def write_lock_delta(
    before: dict[str, float], after: dict[str, float], seconds: float, units: int
) -> dict[str, float]:
    """What the write slot did between two :func:`write_lock` readings over ``seconds`` of
    wall time and ``units`` of work: writes per unit, mean ms waiting for and holding the
    slot per write, and the share of the time it was held (1.0: writes were serialised)."""
    writes = after["held_count"] - before["held_count"]
    held = after["held_sum"] - before["held_sum"]
    wait = after["wait_sum"] - before["wait_sum"]
    return {
        "writes_per_unit": round(writes / units, 2) if units else 0.0,
        "held_ms_per_write": round(1000 * held / writes, 3) if writes else 0.0,
        "wait_ms_per_write": round(1000 * wait / writes, 3) if writes else 0.0,
        "busy_share": round(held / seconds, 3) if seconds > 0 else 0.0,
    }


def tree_cpu_seconds(pid: int) -> float | None:
    """user+system CPU seconds of process ``pid`` and every live descendant (a ``serve
    --workers N`` supervisor and its worker processes), from /proc; None: ``pid`` is gone."""
    own = pid_cpu_seconds(pid)
    if own is None:
        return None
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    total, todo = own, [pid]
    while todo:
        parent = todo.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                todo.append(child)
                total += pid_cpu_seconds(child) or 0.0
    return total


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def process_cpu_seconds(name: str) -> float:
    """user+system CPU seconds of every process on this machine whose command name is
    ``name`` (e.g. ``postgres``: the server and all its backends), from /proc, including the
    children they have reaped: a PostgreSQL backend that exits between two readings is gone
    from /proc, and its CPU moves into the postmaster's ``cutime``/``cstime``, so the sum never
    goes down."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm, rest = (d / "stat").read_text().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if comm == name:
            fields = rest.split()
            # utime, stime, cutime, cstime (after the state field)
            total += sum(int(f) for f in fields[11:15])
    return total / tick


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> dict[str, Any]:
    per = {str(pid): round(after[pid] - before.get(pid, 0.0), 2) for pid in after}
    return {"per_process": per, "total": round(sum(per.values()), 2)}
