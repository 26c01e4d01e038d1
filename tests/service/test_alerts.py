"""service.alerts (issue 15, §8): the rules raise ``alert.<rule>`` events once, with evidence
and the runbook that answers them, and ``alert.resolve`` when they clear; alerts other code
records (failed-login bursts) are read the same way; what goes to Alertmanager and webhooks
(the real ones are in tests/workers/test_alert_worker.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

import alert_history as ah
from prom import Receiver
from proofplane.access import SYSTEM
from proofplane.config import AlertSettings
from proofplane.errors import ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.meter import alerts as core
from proofplane.model import Outcome
from proofplane.service import access
from proofplane.service import alerts as svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.sinks import create_sink
from proofplane.store.tables import EventRow, SinkRow

CLUSTER = """
cluster: alerts-test
tenants:
  - {name: acme, profile: {}}
  - {name: beta, profile: {}}
nodes:
  - {name: n1, region: r, zone: z, gpus: [{model: H100-80GB, count: 4}]}
  - {name: n2, region: r, zone: z, gpus: [{model: H100-80GB, count: 4}]}
workloads:
  - {name: w, tenant: acme, gpus: {count: 2}}
"""


@pytest.fixture
def cluster(store: Store) -> Store:
    load_cluster(store, SYSTEM, parse_cluster(CLUSTER))
    return store


def alert_events(store: Store, action: str | None = None) -> list[EventRow]:
    with store.read() as s:
        q = select(EventRow).where(EventRow.action.like("alert.%")).order_by(EventRow.seq)
        if action is not None:
            q = q.where(EventRow.action == action)
        return list(s.scalars(q))


def evaluate(store: Store, state: svc.AlertState, now: datetime, **kw: Any) -> svc.PassResult:
    return svc.evaluate(store, state, svc.load_rules(), now, capacity=False, **kw)


# --- failing controls ---------------------------------------------------------------------------


def _break_sink(store: Store, since: datetime, failures: int) -> None:
    with store.write(SYSTEM) as tx:
        tx.session.execute(
            update(SinkRow).values(
                consecutive_failures=failures,
                last_success_at=since,
                last_error="connection refused",
            )  # fmt: skip
        )


def test_a_sink_down_raises_once_and_resolves_when_it_delivers(cluster: Store) -> None:
    create_sink(cluster, SYSTEM, "soc", "ocsf-file", {"path": "alerts-soc.jsonl"})
    now = datetime.now(UTC)
    _break_sink(cluster, now - timedelta(minutes=20), 6)
    state = svc.AlertState()
    first = evaluate(cluster, state, now)
    assert len(first.raised) == 1 and not first.resolved
    (raised,) = alert_events(cluster, "alert.control_failing")
    assert (raised.target_type, raised.target_id, raised.outcome) == ("sink", "soc", "failure")
    d = raised.details
    assert d["state"] == "firing" and d["severity"] == "critical"
    assert d["runbook"] == "control-failing@v1" and d["labels"]["control"] == "siem_sink"
    assert d["evidence"]["consecutive_failures"] == 6 and "connection refused" in str(d)
    # still down: nothing new
    assert evaluate(cluster, state, now + timedelta(minutes=1)).raised == []
    # a fresh state (another leader) reads the log and raises nothing twice either
    assert evaluate(cluster, svc.AlertState(), now + timedelta(minutes=2)).raised == []
    # delivering again: resolved, once
    _break_sink(cluster, now + timedelta(minutes=3), 0)
    back = evaluate(cluster, state, now + timedelta(minutes=4))
    assert back.raised == [] and len(back.resolved) == 1
    (resolve,) = alert_events(cluster, core.RESOLVE)
    assert resolve.details["fingerprint"] == d["fingerprint"]
    assert resolve.details["raised_seq"] == raised.seq and resolve.target_id == "soc"
    assert evaluate(cluster, state, now + timedelta(minutes=5)).resolved == []
    listed = svc.list_alerts(cluster, SYSTEM, now + timedelta(minutes=5), status="resolved")
    assert [a["rule"] for a in listed] == ["control_failing"]
    assert listed[0]["resolved_seq"] == resolve.seq
    assert svc.list_alerts(cluster, SYSTEM, now + timedelta(minutes=5)) == []


def test_an_unsigned_log_raises_the_checkpoint_control(cluster: Store) -> None:
    later = datetime.now(UTC) + timedelta(hours=2)  # nothing signed the cluster's events
    result = evaluate(cluster, svc.AlertState(), later)
    (event,) = [e for e in alert_events(cluster) if e.seq in result.raised]
    assert event.details["labels"] == {"control": "audit_checkpoint"}


# --- anomalies ------------------------------------------------------------------------------------


def test_an_off_hours_spike_raises_and_the_next_usual_hour_resolves_it(cluster: Store) -> None:
    ah.usual_nights(cluster, "acme", ah.NIGHT)
    ah.rollups(cluster, "acme", ah.NIGHT, devices=6, activity=0.9)
    state = svc.AlertState()
    result = evaluate(cluster, state, ah.clock_for(ah.NIGHT))
    spikes = alert_events(cluster, "alert.offhours_spike")
    assert {e.details["labels"]["metric"] for e in spikes} == {"allocation", "utilisation"}
    assert {e.seq for e in spikes} <= set(result.raised)
    alloc = next(e for e in spikes if e.details["labels"]["metric"] == "allocation")
    assert alloc.target_id == "acme" and alloc.details["runbook"] == "offhours-spike@v1"
    assert alloc.details["evidence"]["value"] == 6 and alloc.details["evidence"]["z"] >= 3
    # the same hour is not judged twice
    assert evaluate(cluster, state, ah.clock_for(ah.NIGHT) + timedelta(minutes=5)).raised == []
    # the next hour is a usual one (nothing held): both resolve
    nxt = evaluate(cluster, state, ah.clock_for(ah.NIGHT + timedelta(hours=1)))
    assert len(nxt.resolved) == 2


def test_a_brand_new_tenant_has_no_baseline(cluster: Store) -> None:
    ah.rollups(cluster, "beta", ah.NIGHT, devices=8, activity=1.0)
    evaluate(cluster, svc.AlertState(), ah.clock_for(ah.NIGHT))
    assert alert_events(cluster, "alert.offhours_spike") == []


def test_transfer_volume(cluster: Store) -> None:
    noon = ah.NIGHT.replace(hour=12)
    for k in range(1, 5):
        ah.rollups(cluster, "acme", noon - k * ah.WEEK, devices=1, activity=0.5,
                   transfer_bps=1e5 * k)  # fmt: skip
    ah.rollups(cluster, "acme", noon, devices=1, activity=0.5, transfer_bps=5e7)  # 180 GB/h
    evaluate(cluster, svc.AlertState(), ah.clock_for(noon))
    (event,) = alert_events(cluster, "alert.transfer_volume")
    assert event.details["evidence"]["bytes"] == round(5e7 * 3600)
    assert event.details["runbook"] == "transfer-volume@v1"


# --- capacity -------------------------------------------------------------------------------------


def test_a_pool_that_cannot_lose_its_largest_node(store: Store) -> None:
    from dbtest import demo_text

    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    now = datetime.now(UTC)
    state = svc.AlertState()
    result = svc.evaluate(store, state, svc.load_rules(), now, capacity=True)
    assert "capacity_n_plus_one" in result.evaluated
    raised = alert_events(store, "alert.capacity_n_plus_one")
    assert raised and all(e.target_type == "pool" for e in raised)
    assert all(e.details["runbook"] == "capacity-n-plus-one@v1" for e in raised)
    # not due again for capacity_interval_s: nothing changes
    again = svc.evaluate(store, state, svc.load_rules(), now + timedelta(seconds=10))
    assert "capacity_n_plus_one" not in again.evaluated and again.resolved == []


# --- failed-login bursts (raised by the login service) --------------------------------------------


def test_failed_login_bursts_are_alerts_too(store: Store) -> None:
    access.create_user(store, SYSTEM, "alice", "correct horse battery", ["monitoring"], [])
    for _ in range(5):
        with pytest.raises(Exception):  # noqa: B017 - any refusal
            access.login(store, "alice", "wrong password!", None,
                         session_ttl=timedelta(hours=1))  # fmt: skip
    now = datetime.now(UTC)
    alerts = svc.list_alerts(store, SYSTEM, now)
    burst = [a for a in alerts if a["rule"] == "auth_failure_burst"]
    assert len(burst) == 1 and burst[0]["runbook"] == "key-compromise@v1"
    assert burst[0]["labels"]["subject"] == "alice" and not burst[0]["stateful"]
    later = svc.list_alerts(store, SYSTEM, now + timedelta(hours=2))
    assert not [a for a in later if a["rule"] == "auth_failure_burst"]  # its hold ended


def test_list_alerts_refuses_a_bad_status(store: Store) -> None:
    with pytest.raises(ValidationFailed) as err:
        svc.list_alerts(store, SYSTEM, datetime.now(UTC), status="open")
    assert err.value.code == "invalid_status"


# --- delivery -------------------------------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_webhooks_hear_of_each_change_once(cluster: Store, receiver: Receiver, tmp_path) -> None:
    token = tmp_path / "hook.token"
    token.write_text("hook-secret\n")
    settings = AlertSettings(webhooks=(f"{receiver.url}/hook",), webhook_token_file=str(token))
    create_sink(cluster, SYSTEM, "soc", "ocsf-file", {"path": "alerts-hook.jsonl"})
    now = datetime.now(UTC)
    _break_sink(cluster, now - timedelta(minutes=20), 3)
    state = svc.AlertState()
    evaluate(cluster, state, now)
    assert svc.deliver(state, settings, now, cluster="c1") == {f"{receiver.url}/hook": True}
    (body,) = receiver.bodies
    assert body["status"] == "firing" and body["alerts"][0]["labels"]["alertname"] == (
        "control_failing"
    )
    assert receiver.headers[0]["Authorization"] == "Bearer hook-secret"
    # nothing changed: nothing sent
    assert svc.deliver(state, settings, now + timedelta(minutes=1), cluster="c1") == {}
    # refused: told again next time
    _break_sink(cluster, now, 0)
    evaluate(cluster, state, now + timedelta(minutes=2))
    receiver.status = 503
    assert svc.deliver(state, settings, now + timedelta(minutes=2), cluster="c1") == {
        f"{receiver.url}/hook": False
    }
    receiver.status = 200
    assert svc.deliver(state, settings, now + timedelta(minutes=3), cluster="c1") == {
        f"{receiver.url}/hook": True
    }
    assert [b["status"] for b in receiver.bodies] == ["firing", "resolved", "resolved"]


def test_an_unreachable_receiver_is_a_failed_delivery_not_an_error(cluster: Store) -> None:
    state = svc.AlertState()
    state.alerts = core.alerts_from_events([], hold=timedelta(hours=1))
    settings = AlertSettings(
        alertmanagers=("http://127.0.0.1:9",), webhooks=("http://127.0.0.1:9/x",)
    )
    evaluate(cluster, state, datetime.now(UTC) + timedelta(hours=3))  # the unsigned log fires
    out = svc.deliver(state, settings, datetime.now(UTC) + timedelta(hours=3), cluster="c")
    assert out and not any(out.values())


def test_rules_file_errors(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "rules.yaml"
    bad.write_text("offhours_spike: {z: [1]}\n")
    with pytest.raises(ValidationFailed) as err:
        svc.load_rules(str(bad))
    assert err.value.code == "invalid_alert_rules"
    bad.write_text("a: [\n")
    with pytest.raises(ValidationFailed):
        svc.load_rules(str(bad))
    with pytest.raises(ValidationFailed):
        svc.load_rules(str(tmp_path / "missing.yaml"))
    monkeypatch.setenv(svc.RULES_ENV, str(bad))
    with pytest.raises(ValidationFailed):
        svc.load_rules()
    assert Outcome.FAILURE  # the raise events' outcome


def _latest(store: Store, tenant: str, devices: int, activity: float, at: datetime) -> None:
    from proofplane.meter.fields import GR_ENGINE_ACTIVE
    from proofplane.store.tables import TELEMETRY_COLUMNS, telemetry_device_latest

    ms = int(at.timestamp() * 1000)
    with store.write(SYSTEM) as tx:
        for d in range(devices):
            uuid = f"GPU-{tenant}-now-{d}"
            tx.session.execute(telemetry_device_latest.insert().values(
                key=f"{uuid}|-", node="n1", gpu_uuid=uuid, gi_id=None, profile=None, ts=ms,
                workload=f"w{d}", tenant=tenant, simulated=True,
                **{TELEMETRY_COLUMNS[GR_ENGINE_ACTIVE]: activity}))  # fmt: skip


def test_a_spike_in_the_newest_readings_raises_before_its_hour_ends(cluster: Store) -> None:
    from proofplane.meter import anomaly

    now = datetime.now(UTC)
    hour = svc._hour(now)
    other = anomaly.DAYS[(hour.weekday() + 3) % 7]
    rules = anomaly.parse_rules(
        {"business_hours": {"default": {"days": [other]}}}, lambda _n: UTC
    )  # now is off-hours
    ah.usual_nights(cluster, "acme", hour)
    _latest(cluster, "acme", 6, 0.9, now)
    state = svc.AlertState()
    result = svc.evaluate(cluster, state, rules, now, capacity=False)
    spikes = [e for e in alert_events(cluster, "alert.offhours_spike") if e.seq in result.raised]
    assert {e.details["labels"]["metric"] for e in spikes} == {"allocation", "utilisation"}
    assert all(e.details["evidence"]["window"] == "newest readings" for e in spikes)
    # the same again: nothing new; and a tenant with no past gets no verdict
    _latest(cluster, "beta", 8, 1.0, now)
    again = svc.evaluate(cluster, state, rules, now + timedelta(minutes=1), capacity=False)
    assert again.raised == [] and again.resolved == []
