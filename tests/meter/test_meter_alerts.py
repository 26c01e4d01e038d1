"""meter.alerts (issue 15, §8): alerts from events with Alertmanager's identity (a fingerprint
of the label set) and lifecycle (startsAt/endsAt; raise once, resolve once), and the bodies
sent to Alertmanager and to webhooks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.meter import alerts as core
from proofplane.model import Event, Outcome

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
HOLD = timedelta(hours=1)


def ev(seq: int, action: str, target: tuple[str, str], details: dict[str, Any],
       at: datetime | None = None) -> Event:  # fmt: skip
    return Event(seq, at or T0 + timedelta(minutes=seq), "system", action, target[0], target[1],
                 Outcome.FAILURE, details)  # fmt: skip


def finding(subject: str = "acme", severity: str = "medium") -> core.Finding:
    return core.Finding("offhours_spike", severity, "tenant", subject, f"spike of {subject}",
                        (("tenant", subject), ("metric", "allocation")), {"z": 4.2})  # fmt: skip


def raise_event(seq: int, f: core.Finding, at: datetime | None = None) -> Event:
    return ev(seq, f"alert.{f.rule}", (f.subject_type, f.subject), f.details("offhours-spike@v1"),
              at)  # fmt: skip


def resolve_event(seq: int, f: core.Finding, at: datetime | None = None) -> Event:
    return ev(seq, core.RESOLVE, (f.subject_type, f.subject),
              {"fingerprint": f.fingerprint, "rule": f.rule}, at)  # fmt: skip


def test_the_fingerprint_is_the_label_set() -> None:
    a, b = finding("acme"), finding("acme")
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16
    assert finding("beta").fingerprint != a.fingerprint
    assert finding("acme", "high").fingerprint != a.fingerprint  # severity is a label
    labels = a.all_labels
    assert labels["alertname"] == "offhours_spike" and labels["tenant"] == "acme"
    assert core.fingerprint(dict(reversed(list(labels.items())))) == a.fingerprint


def test_a_stateful_alert_fires_until_its_resolve() -> None:
    f = finding()
    alerts = core.alerts_from_events([raise_event(1, f)], hold=HOLD)
    a = alerts[f.fingerprint]
    assert a.stateful and a.status(T0 + timedelta(days=30)) == core.FIRING
    assert a.runbook == "offhours-spike@v1" and a.evidence == {"z": 4.2}
    # raised twice without a resolve: the first raise stands
    again = core.alerts_from_events([raise_event(1, f), raise_event(2, f)], hold=HOLD)
    assert again[f.fingerprint].seq == 1
    done = core.alerts_from_events([raise_event(1, f), resolve_event(5, f)], hold=HOLD)
    d = done[f.fingerprint]
    assert d.status(T0 + timedelta(minutes=6)) == core.RESOLVED and d.resolved_seq == 5
    assert d.ends_at == T0 + timedelta(minutes=5)
    # a new episode after the resolve
    later = core.alerts_from_events(
        [raise_event(1, f), resolve_event(5, f), raise_event(9, f)], hold=HOLD
    )
    assert later[f.fingerprint].seq == 9 and later[f.fingerprint].ends_at is None
    # a resolve of nothing changes nothing
    assert core.alerts_from_events([resolve_event(3, f)], hold=HOLD) == {}


def test_one_shot_alerts_fire_for_their_hold() -> None:
    burst = ev(4, "alert.auth_failure_burst", ("user", "alice"),
               {"consecutive_failures": 5, "severity": "medium",
                "runbook": "key-compromise@v1"})  # fmt: skip
    alerts = core.alerts_from_events([burst], hold=HOLD)
    (a,) = alerts.values()
    assert (a.rule, a.severity, a.stateful, a.runbook) == (
        "auth_failure_burst", "medium", False, "key-compromise@v1",
    )  # fmt: skip
    assert a.labels["subject"] == "alice" and a.labels["subject_type"] == "user"
    assert a.status(burst.ts + HOLD - timedelta(seconds=1)) == core.FIRING
    assert a.status(burst.ts + HOLD) == core.RESOLVED
    # raised again within its hold: one episode, longer
    again = ev(5, "alert.auth_failure_burst", ("user", "alice"), {"severity": "medium"},
               burst.ts + timedelta(minutes=30))  # fmt: skip
    (b,) = core.alerts_from_events([burst, again], hold=HOLD).values()
    assert b.starts_at == burst.ts and b.ends_at == again.ts + HOLD
    # details that identify it become labels: two GPUs of one node are two alerts
    gpu = [
        ev(
            6 + i,
            "alert.gpu_health",
            ("node", "n1"),
            {"severity": "critical", "gpu_uuid": f"GPU-{i}", "xid": 79},
        )  # fmt: skip
        for i in range(2)
    ]
    assert len(core.alerts_from_events(gpu, hold=HOLD)) == 2
    # an unknown severity is high (as the SIEM exports read it)
    odd = ev(9, "alert.x_y", ("cluster", "c"), {"severity": "apocalyptic"})
    assert next(iter(core.alerts_from_events([odd], hold=HOLD).values())).severity == "high"


def test_other_events_are_not_alerts() -> None:
    events = [ev(1, "node.state", ("node", "n1"), {}), ev(2, "alert.", ("cluster", "c"), {})]
    assert core.alerts_from_events(events, hold=HOLD) == {}
    assert core.rule_of("alert.resolve") is None and core.rule_of("alerts.x") is None


def test_reconcile_raises_once_and_resolves_only_what_was_evaluated() -> None:
    f, g = finding("acme"), finding("beta")
    now = T0 + timedelta(hours=1)
    plan = core.reconcile({}, [f, f, g], ["offhours_spike"], now)
    assert [x.subject for x in plan.raise_] == ["acme", "beta"] and plan.resolve == ()
    alerts = core.alerts_from_events([raise_event(1, f), raise_event(2, g)], hold=HOLD)
    same = core.reconcile(alerts, [f, g], ["offhours_spike"], now)
    assert same.raise_ == () and same.resolve == ()
    cleared = core.reconcile(alerts, [g], ["offhours_spike"], now)
    assert cleared.raise_ == () and [a.labels["tenant"] for a in cleared.resolve] == ["acme"]
    # a pass that did not evaluate the rule resolves nothing of it
    assert core.reconcile(alerts, [], ["control_failing"], now).resolve == ()
    # one-shot alerts are never resolved by a rule
    burst = ev(3, "alert.offhours_spike", ("tenant", "acme"), {"severity": "medium"})
    one = core.alerts_from_events([burst], hold=HOLD)
    assert core.reconcile(one, [], ["offhours_spike"], now).resolve == ()


def test_alertmanager_payload() -> None:
    f = finding()
    burst = ev(2, "alert.auth_failure_spray", ("cluster", "authentication"),
               {"severity": "high", "failed_logins": 20})  # fmt: skip
    alerts = core.alerts_from_events([raise_event(1, f), burst], hold=HOLD)
    now = T0 + timedelta(minutes=10)
    body = core.alertmanager_payload(
        alerts, now, resend_s=60, keep_resolved_s=900, cluster="eu-1",
        generator_url="https://pp.example/",
    )  # fmt: skip
    assert [b["labels"]["alertname"] for b in body] == ["offhours_spike", "auth_failure_spray"]
    spike, spray = body
    assert spike["labels"]["cluster"] == "eu-1" and spike["labels"]["severity"] == "medium"
    assert spike["startsAt"] == "2026-03-02T12:01:00Z"
    assert spike["endsAt"] == "2026-03-02T12:14:00Z"  # now + 4 × 60 s: resent before then
    assert spray["endsAt"] == "2026-03-02T13:02:00Z"  # its hold
    assert spike["annotations"]["runbook"] == "offhours-spike@v1"
    assert spike["annotations"]["fingerprint"] == f.fingerprint
    assert spike["generatorURL"] == "https://pp.example/api/v1/events/1"
    # resolved: sent with its end for keep_resolved_s, then no more
    done = core.alerts_from_events([raise_event(1, f), resolve_event(20, f)], hold=HOLD)
    end = T0 + timedelta(minutes=20)
    sent = core.alertmanager_payload(done, end + timedelta(minutes=5), resend_s=60,
                                     keep_resolved_s=900, cluster="c")  # fmt: skip
    assert sent[0]["endsAt"] == "2026-03-02T12:20:00Z" and "generatorURL" not in sent[0]
    assert core.alertmanager_payload(done, end + timedelta(minutes=16), resend_s=60,
                                     keep_resolved_s=900, cluster="c") == []  # fmt: skip


def test_webhook_payload_is_alertmanagers() -> None:
    f = finding()
    done = core.alerts_from_events([raise_event(1, f), resolve_event(2, f)], hold=HOLD)
    now = T0 + timedelta(minutes=3)
    body = core.webhook_payload(list(done.values()), now, cluster="c")
    assert body["version"] == "4" and body["status"] == "resolved"
    (item,) = body["alerts"]
    assert item["status"] == "resolved" and item["fingerprint"] == f.fingerprint
    assert item["endsAt"] == "2026-03-02T12:02:00Z"
    firing = core.alerts_from_events([raise_event(1, f)], hold=HOLD)
    body = core.webhook_payload(list(firing.values()), now, cluster="c")
    assert body["status"] == "firing" and body["alerts"][0]["endsAt"].startswith("0001-")
    assert core.state_digest(firing.values(), now) == {(f.fingerprint, "firing")}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r", "s", "b"]), st.integers(0, 2)), max_size=30),
       st.integers(0, 30))  # fmt: skip
def test_folding_in_parts_equals_folding_at_once(ops: list[tuple[str, int]], cut: int) -> None:
    """The worker folds new events into what it has; the API folds the whole log: the same."""
    subjects = [finding(f"t{i}") for i in range(3)]
    events: list[Event] = []
    for seq, (op, i) in enumerate(ops, start=1):
        f = subjects[i]
        at = T0 + timedelta(minutes=seq)
        if op == "r":
            events.append(raise_event(seq, f, at))
        elif op == "s":
            events.append(resolve_event(seq, f, at))
        else:
            events.append(ev(seq, "alert.auth_failure_burst", ("user", f"u{i}"), {}, at))
    whole = core.alerts_from_events(events, hold=HOLD)
    parts = core.fold({}, events[:cut], hold=HOLD)
    core.fold(parts, events[cut:], hold=HOLD)
    assert parts == whole


@pytest.mark.parametrize("value", ["CRITICAL", "low", None, 3, "nope"])
def test_severity_of(value: object) -> None:
    got = core.severity_of(value)
    assert got in core.SEVERITIES
