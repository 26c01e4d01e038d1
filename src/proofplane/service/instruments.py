"""The control plane's own instruments: process-local Prometheus counters and histograms
(issue 15, §3), and how they add up over the worker processes of ``serve --workers N``.

What a process observes as it works is counted here: HTTP requests by method, route template
and status (never the raw path: a path holds names, so it would make one series per workload);
placement decision latency; attestation verdicts by reason; KMS operations; alert deliveries.
Everything that is *state* (pending workloads, the audit log's size, a sink's lag, the fleet)
is read at scrape time instead, by ``service.metrics``, so it is the same whichever process
answers the scrape.

Several worker processes (``serve --workers N``): each counts its own requests, and a scrape
reaches one of them at random. prometheus_client's **multiprocess mode** makes the counters
correct for that: every process writes its values to memory-mapped files in one directory
(``PROMETHEUS_MULTIPROC_DIR``), and the process answering a scrape sums the files of all
processes, dead ones included (a counter must not fall when a worker restarts).
:func:`prepare_multiprocess` (called by ``serve`` before it starts the workers) sets the
directory up: the operator's ``PROMETHEUS_MULTIPROC_DIR`` emptied of earlier runs' files, or a
private temporary one; the workers inherit the variable. The value class is chosen when
prometheus_client is first imported, which in a worker (a spawned process) is after the variable
is set. Per-process labels were the alternative and were not taken: a scrape would see one
process's counts each time and ``rate()`` would jump between them. One process (``serve`` with
one worker, tests): plain in-memory values, and the Python process collectors too.

Labels are bounded by construction: a method outside the standard ones is ``OTHER``; a request
no route matched is ``<unmatched>`` (``<refused>`` when something refused it before routing:
overload, body limit); attestation reasons come from the verifier's registry; KMS key names
from the inventory.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# No ``*_created`` series: one per label set, of no use to a PromQL ``rate()``, and doubling
# what a scrape carries.
disable_created_metrics()

#: the instruments of this process (single-process exposition collects this registry)
REGISTRY = CollectorRegistry(auto_describe=True)

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "<unmatched>"  # no route matched (a 404 or 405 for a path the API does not serve)
REFUSED = "<refused>"  # answered before routing (overload 429, body limit 413)

HTTP_REQUESTS = Counter(
    "proofplane_http_requests",
    "HTTP requests answered, by method, route template and status code.",
    ["method", "route", "code"],
    registry=REGISTRY,
)
HTTP_DURATION = Histogram(
    "proofplane_http_request_duration_seconds",
    "Time from a request's arrival to the last byte of its answer, by method and route template.",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
DECISION_DURATION = Histogram(
    "proofplane_schedule_decision_duration_seconds",
    "Placement decision latency (quota, place, repartition, preempt; the pure engine's "
    "time), by outcome: placed or pending.",
    ["outcome"],
    buckets=(
        0.00005,
        0.0001,
        0.00025,
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        1.0,
    ),  # fmt: skip
    registry=REGISTRY,
)
WRITE_LOCK = Histogram(
    "proofplane_db_write_lock_seconds",
    "Write transactions by phase: 'wait' for this database's one write slot (SQLite: the "
    "writer gate every process queues on), then 'held' from getting it to the commit's end "
    "(PostgreSQL: the whole transaction, its advisory write lock's wait included).",
    ["phase"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
    registry=REGISTRY,
)

#: How often a worker's event loop is probed (a timer that should fire this many seconds on).
LOOP_LAG_PROBE_S = 0.05
LOOP_LAG = Histogram(
    "proofplane_event_loop_lag_seconds",
    "How late a worker's event loop ran a timer due every 50 ms: the time a request that "
    "arrives then waits before the loop can read it, route it or refuse it (429), because the "
    "threads running endpoints hold the interpreter lock.",
    ["loop"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)

GC_PAUSE = Histogram(
    "proofplane_gc_pause_seconds",
    "How long each of the interpreter's garbage collections stopped this process, by "
    "generation (0, 1, 2): while it runs no request moves, so a slow generation-2 pass "
    "shows as a latency tail on every endpoint at once.",
    ["generation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)

ATTESTATION_VERDICTS = Counter(
    "proofplane_attestation_verdicts",
    "Attestation verdicts recorded, by verdict (pass or fail) and reason code (one count per "
    "reason a failed verdict carries; 'none' for a pass).",
    ["verdict", "reason"],
    registry=REGISTRY,
)
KMS_OPERATIONS = Counter(
    "proofplane_kms_operations",
    "KMS operations done with key material, by backend, key, operation (encrypt, decrypt, "
    "sign, generate) and outcome (success or failure).",
    ["backend", "key", "operation", "outcome"],
    registry=REGISTRY,
)
ALERT_DELIVERIES = Counter(
    "proofplane_alert_deliveries",
    "Alert notifications sent, by receiver kind (alertmanager, webhook) and outcome.",
    ["receiver", "outcome"],
    registry=REGISTRY,
)


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "OTHER"


def observe_http(method: str, route: str, code: int, seconds: float) -> None:
    m = method_label(method)
    HTTP_REQUESTS.labels(m, route, str(code)).inc()
    HTTP_DURATION.labels(m, route).observe(seconds)


def observe_loop_lag(seconds: float) -> None:
    LOOP_LAG.labels("http").observe(seconds)


async def probe_loop_lag(interval: float = LOOP_LAG_PROBE_S) -> None:
    """Until cancelled: every ``interval`` seconds, how late the running event loop woke."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval)
        observe_loop_lag(max(0.0, loop.time() - start - interval))


_gc_began = 0.0  # when the running collection started (one runs at a time in a process)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_began
    if phase == "start":
        _gc_began = time.perf_counter()
    else:
        GC_PAUSE.labels(str(info["generation"])).observe(time.perf_counter() - _gc_began)


def watch_gc() -> None:
    """Time this process's garbage collections (``proofplane_gc_pause_seconds``), once per
    process however often it is called."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def observe_decision(placed: bool, seconds: float) -> None:
    DECISION_DURATION.labels("placed" if placed else "pending").observe(seconds)


def observe_write(wait: float, held: float) -> None:
    """One write transaction: seconds waiting for the write slot, then holding it."""
    # children made on first use, not at import: in multiprocess mode making one opens its
    # file in PROMETHEUS_MULTIPROC_DIR, which ``serve`` creates after importing this module
    WRITE_LOCK.labels("wait").observe(wait)
    WRITE_LOCK.labels("held").observe(held)


def count_verdict(ok: bool, reasons: Iterable[str]) -> None:
    if ok:
        ATTESTATION_VERDICTS.labels("pass", "none").inc()
        return
    for reason in sorted(set(reasons)) or ["unspecified"]:
        ATTESTATION_VERDICTS.labels("fail", reason).inc()


def count_kms(backend: str, key: str, operation: str, ok: bool = True) -> None:
    KMS_OPERATIONS.labels(backend, key, operation, "success" if ok else "failure").inc()


def count_delivery(receiver: str, ok: bool) -> None:
    ALERT_DELIVERIES.labels(receiver, "success" if ok else "failure").inc()


def on_commit(session: Session, action: Callable[[], Any]) -> None:
    """Run ``action`` once ``session``'s transaction commits (never on a rollback): a counter of
    recorded facts counts only facts that were recorded."""
    sa_event.listen(session, "after_commit", lambda _s: action(), once=True)


# --- several worker processes ----------------------------------------------------------------


def multiprocess_dir() -> str | None:
    """The directory of multiprocess mode, when this process is in it."""
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess(env: dict[str, str] | None = None) -> tuple[str, bool]:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` up for worker processes started after this call
    (``serve --workers N``): the operator's directory emptied of an earlier run's ``*.db``
    files (they would be summed into this run), else a new private temporary directory.
    Returns the directory and whether this call created it (the caller removes it at the end).
    ``env``: where to set the variable (default ``os.environ``, which the workers inherit)."""
    target = os.environ if env is None else env
    given = target.get(MULTIPROC_ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink(missing_ok=True)
        return str(path), False
    path = Path(tempfile.mkdtemp(prefix="proofplane-metrics-"))
    target[MULTIPROC_ENV] = str(path)
    return str(path), True


def forget_multiprocess(path: str, created: bool, env: dict[str, str] | None = None) -> None:
    """After the workers stopped: remove a directory :func:`prepare_multiprocess` created."""
    target = os.environ if env is None else env
    if created:
        shutil.rmtree(path, ignore_errors=True)
        if target.get(MULTIPROC_ENV) == path:
            del target[MULTIPROC_ENV]
