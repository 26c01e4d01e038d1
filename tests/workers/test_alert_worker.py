"""The alert worker against a real Alertmanager (Debian ``prometheus-alertmanager``) on
loopback (issue 15, §8): an off-hours spike and an XID error each raise the right alert in
Alertmanager (``POST /api/v2/alerts``), with the runbook that answers it; re-sending keeps one
alert per label set; a failing control that recovers is resolved there too, and Alertmanager's
own webhook notification carries it; a webhook of ours hears each change. The worker runs in
the process holding the leader lease."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

import alert_history as ah
import telemetry_cluster as tc
from prom import Receiver, alertmanager, am_alerts
from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.config import AlertSettings, Settings
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import anomaly
from proofplane.meter.fields import XID_ERRORS
from proofplane.service import alerts as svc
from proofplane.service import telemetry as tel
from proofplane.service.context import Store
from proofplane.service.sinks import create_sink
from proofplane.store import migrate
from proofplane.store.tables import SinkRow
from proofplane.workers.alerts import AlertWorker


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'alerts.db'}")
    migrate.upgrade(s.engine)
    tc.load(s)
    yield s
    s.dispose()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def off_hours_rules(hour: datetime) -> anomaly.AlertRules:
    """Business hours on another day than ``hour``'s, so that ``hour`` is off-hours."""
    other = anomaly.DAYS[(hour.weekday() + 3) % 7]
    return anomaly.parse_rules(
        {"business_hours": {"default": {"days": [other], "start": "08:00", "end": "18:00"}}},
        lambda _name: UTC,
    )


def until(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def _set_sink(store: Store, failures: int, since: datetime) -> None:
    with store.write(SYSTEM) as tx:
        tx.session.execute(
            update(SinkRow).values(consecutive_failures=failures, last_success_at=since)
        )


def test_spike_and_xid_reach_a_real_alertmanager(
    store: Store, receiver: Receiver, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    judged = svc._hour(now - svc.SETTLE) - anomaly.HOUR
    ah.usual_nights(store, "acme", judged)
    ah.rollups(store, "acme", judged, devices=6, activity=0.9)
    # a fatal XID on n2 (the agent's reading): the GPU is drained, the node cordoned
    xid = tc.entry(gpu_uuid("n2", 1), now, {XID_ERRORS: 79})
    tel.ingest(store, tc.agent("n2"), "n2", {"samples": [xid]}, now=now)
    create_sink(store, SYSTEM, "soc", "ocsf-file", {"path": "am-soc.jsonl"})
    _set_sink(store, 4, now - timedelta(minutes=30))

    with alertmanager(tmp_path, webhook=f"{receiver.url}/from-alertmanager") as am:
        settings = AlertSettings(interval_s=30, alertmanagers=(am,),
                                 webhooks=(f"{receiver.url}/ours",))  # fmt: skip
        clock = {"now": now}  # the wall clock: Alertmanager judges endsAt by its own
        worker = AlertWorker(store, settings, off_hours_rules(judged), cluster="test-1",
                             now=lambda: clock["now"])  # fmt: skip
        first = worker.run_once()
        assert first.delivered == {am: True, f"{receiver.url}/ours": True}, first

        spikes = until(lambda: am_alerts(am, alertname="offhours_spike"))
        assert {a["labels"]["metric"] for a in spikes} == {"allocation", "utilisation"}
        for a in spikes:
            assert a["labels"]["tenant"] == "acme" and a["labels"]["cluster"] == "test-1"
            assert a["labels"]["severity"] == "medium" and a["status"]["state"] == "active"
            assert a["annotations"]["runbook"] == "offhours-spike@v1"
        (gpu,) = until(lambda: am_alerts(am, alertname="gpu_health"))
        assert gpu["labels"]["node"] == "n2" and gpu["labels"]["severity"] == "critical"
        assert gpu["labels"]["gpu_uuid"] == gpu_uuid("n2", 1)
        assert gpu["annotations"]["runbook"] == "gpu-health@v1"
        assert '"xid": 79' in gpu["annotations"]["evidence"]
        (sink,) = until(lambda: am_alerts(am, alertname="control_failing"))
        assert sink["labels"]["control"] == "siem_sink"

        # sent again on the next pass: still one alert per label set in Alertmanager
        clock["now"] = datetime.now(UTC)
        assert worker.run_once().raised == []
        assert len(am_alerts(am, alertname="offhours_spike")) == 2
        assert len(am_alerts(am, alertname="gpu_health")) == 1

        # Alertmanager routed them to its receiver (its own webhook notification)
        def routed(name: str, status: str) -> bool:
            return any(
                b.get("status") == status
                and any(a["labels"].get("alertname") == name for a in b.get("alerts", ()))
                for b in receiver.bodies
                if isinstance(b, dict) and b.get("receiver") == "default"
            )

        assert until(lambda: routed("gpu_health", "firing"))
        assert until(lambda: routed("offhours_spike", "firing"))

        # the sink delivers again: resolved in the log and in Alertmanager
        clock["now"] = datetime.now(UTC)
        _set_sink(store, 0, clock["now"])
        third = worker.run_once()
        assert len(third.resolved) == 1 and third.delivered[am]
        assert until(lambda: not am_alerts(am, alertname="control_failing"))
        assert until(lambda: routed("control_failing", "resolved"))

    # our own webhook: told of the first alerts, then of the resolve, each once
    ours = [b for b in receiver.bodies if isinstance(b, dict) and b.get("receiver") == "proofplane"]
    assert [b["status"] for b in ours] == ["firing", "resolved"]
    # (the XID cordoned n2: the general pool can no longer lose n1 either)
    assert {a["labels"]["alertname"] for a in ours[0]["alerts"]} == {
        "offhours_spike", "gpu_health", "control_failing", "capacity_n_plus_one",
    }  # fmt: skip
    assert [a["labels"]["alertname"] for a in ours[1]["alerts"]] == ["control_failing"]


def test_the_server_runs_the_worker_in_the_leader(store: Store, tmp_path: Path) -> None:
    settings = Settings(cookie_secure=False, alerts=AlertSettings(interval_s=3600))
    app = create_app(store, settings)
    with TestClient(app):
        worker = app.state.alert_worker
        assert isinstance(worker, AlertWorker) and worker.leader_only
        assert worker.leadership is not None and worker.leadership.held()
        until(lambda: worker.last is not None or worker.last_error, timeout=20)  # a pass at start
        assert worker.last_error is None, worker.last_error
        assert worker.last is not None and "control_failing" in worker.last.evaluated
    assert not worker.running


def test_a_broken_rules_file_stops_the_server_at_start(store: Store, tmp_path: Path) -> None:
    bad = tmp_path / "rules.yaml"
    bad.write_text("business_hours: {default: {timezone: Nowhere/Land}}\n")
    settings = Settings(alerts=AlertSettings(interval_s=60, rules_file=str(bad)))
    with pytest.raises(Exception) as err:
        create_app(store, settings)
    assert getattr(err.value, "code", None) == "invalid_alert_rules"
