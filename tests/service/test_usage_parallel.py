"""The usage meter over a SQLite log in worker processes (one share of the workload names
each) adds up to exactly what one process meters, and so does the PostgreSQL path; the order
of the stream (grouped by name, or the log's own) does not change a total."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.meter.usage import Meter
from proofplane.service import usage as usage_svc
from proofplane.store.tables import EventRow
from usage_scenario import WINDOW, ClockStore, H, build


@pytest.fixture
def history(db_url: str) -> Iterator[ClockStore]:
    store = ClockStore(db_url)
    build(store)
    yield store
    store.dispose()


def test_worker_processes_add_up_to_one_process(history: ClockStore, db_url: str) -> None:
    start, end = WINDOW
    cut = (start + 3 * H,)
    tracked = frozenset({("acme", "gang"), ("beta", "infer")})
    one, _ = usage_svc.meter_log(history, start, end, cuts=cut, tracked=tracked, workers=0)
    assert one.events > 0 and one.usage
    if db_url.startswith("sqlite"):
        for workers in (2, 3):
            many, _ = usage_svc.meter_log(
                history, start, end, cuts=cut, tracked=tracked, workers=workers
            )
            assert many.usage == one.usage and many.tracked == one.tracked, workers
            assert many.events == one.events
    by_name, _ = usage_svc.meter_log(history, start, end, by_workload=True, workers=0)
    assert {k.workload for _s, k in by_name.usage} >= {"train", "infer", "gang", "notebook"}


def test_the_log_order_and_the_name_order_agree(history: ClockStore) -> None:
    start, end = WINDOW
    with history.read() as session:
        models = usage_svc.gpu_models(session, end)
        events = list(session.scalars(select(EventRow).order_by(EventRow.seq)))
    grouped, _ = usage_svc.meter_log(history, start, end, workers=0)
    # the log's own order, through the meter directly
    meter = Meter(start, end, models.by_uuid)
    tuples = []
    for e in events:
        d = e.details
        if e.action not in usage_svc.USAGE_ACTIONS:
            continue
        place = e.action == "workload.place"
        tuples.append(
            (
                e.action, e.ts, e.target_id, d.get("tenant"), d.get("node"),
                d.get("tags") if place else None,
                d["gpus"]["mig_profile"] if place else None,
                d["gpus"]["share_milli"] if place else None,
                len(d["devices"]) if place else None,
                d["devices"][0]["gpu_uuid"] if place else None,
                None,
                d.get("members") if place else None,
            )
        )  # fmt: skip
    meter.feed(tuples)
    assert meter.finish().usage == grouped.usage


def test_a_report_through_workers(
    history: ClockStore, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("worker processes read a SQLite file")
    now = datetime.now(UTC)
    plain = usage_svc.usage_report(history, SYSTEM, start=WINDOW[0], end=WINDOW[1], now=now)
    monkeypatch.setattr(usage_svc, "PARALLEL_FROM", 1)  # this small log counts as large
    parallel = usage_svc.usage_report(history, SYSTEM, start=WINDOW[0], end=WINDOW[1], now=now)
    assert usage_svc.render(parallel, "focus") == usage_svc.render(plain, "focus")
