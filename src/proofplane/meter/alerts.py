"""Alerts as audit events, with Alertmanager's identity and lifecycle (issue 15, §8). Pure: the
events go in, the alerts and what to send come out; ``now`` is a parameter.

An alert is an event whose action starts with ``alert.``; the rest of the action is its rule
(``alert.offhours_spike`` → ``offhours_spike``). Two kinds:

* **stateful** (the rules the alert worker evaluates: anomalies, failing controls, capacity):
  its raise carries ``details.fingerprint`` and ``details.state = "firing"``; it fires until an
  ``alert.resolve`` event with the same fingerprint. The worker raises an alert only when no
  alert with its fingerprint fires, and resolves it when its rule, evaluated again, no longer
  finds it. So the log holds one raise and one resolve per episode, never one event per pass.
* **one-shot** (alerts other code records as it notices something: ``alert.auth_failure_*``,
  ``alert.change_review_overdue``, ``alert.gpu_health``…): no fingerprint of their own; they
  fire from their event's time for ``hold`` and then end by themselves.

The **fingerprint** is Alertmanager's notion: the identity of an alert is its label set
(``alertname`` = the rule, ``severity``, the subject, and the labels the rule names, e.g.
``tenant``, ``pool``, ``control``), hashed; two raises with the same labels are the same alert.
What goes to Alertmanager (``POST /api/v2/alerts``) is every firing alert with ``endsAt`` a
little ahead (stateful: ``resend_s × 4``, as Prometheus does; one-shot: its hold's end), and
every alert resolved within ``keep_resolved_s`` with ``endsAt`` its resolution time. Sent again
on every pass, so Alertmanager's dedupe does the rest: a restart, a lost request, a second
Alertmanager all converge. Annotations carry the summary, the evidence, the event and the
runbook that answers the alert.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from proofplane.model import Event

PREFIX = "alert."
RESOLVE = "alert.resolve"
SEVERITIES = ("critical", "high", "medium", "low", "info")
DEFAULT_SEVERITY = "high"  # an alert that says none (as the SIEM exports read it too)
FIRING, RESOLVED = "firing", "resolved"
# Details of a one-shot alert that become labels (part of its identity) when present.
LABEL_DETAILS = ("tenant", "pool", "node", "gpu_uuid", "control", "sink", "kind")
MAX_LABEL = 200  # characters of a label value
MAX_ANNOTATION = 4000  # characters of the evidence annotation


def rule_of(action: str) -> str | None:
    """``alert.<rule>`` → the rule; None for any other action (and for ``alert.resolve``)."""
    if not action.startswith(PREFIX) or action == RESOLVE:
        return None
    rule = action[len(PREFIX) :]
    return rule or None


def severity_of(value: object) -> str:
    text = str(value or "").lower()
    return text if text in SEVERITIES else DEFAULT_SEVERITY


def _label(value: object) -> str:
    return str(value)[:MAX_LABEL]


def fingerprint(labels: Mapping[str, str]) -> str:
    """16 hex digits of SHA-256 over the sorted label set (Alertmanager keys alerts the same
    way, on its own hash of the labels)."""
    canonical = json.dumps(sorted(labels.items()), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Finding:
    """What a rule found, before it is an event: the worker raises it unless its fingerprint
    fires already."""

    rule: str
    severity: str
    subject_type: str  # the event's target_type
    subject: str  # the event's target_id
    summary: str
    labels: tuple[tuple[str, str], ...] = ()  # identity beyond rule, severity and subject
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @property
    def all_labels(self) -> dict[str, str]:
        return alert_labels(self.rule, self.severity, self.subject_type, self.subject, self.labels)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.all_labels)

    def details(self, runbook: str | None) -> dict[str, Any]:
        """The raise event's details."""
        out: dict[str, Any] = {
            "rule": self.rule,
            "state": FIRING,
            "severity": self.severity,
            "summary": self.summary,
            "fingerprint": self.fingerprint,
            "labels": dict(self.labels),
            "evidence": dict(self.evidence),
        }
        if runbook is not None:
            out["runbook"] = runbook
        return out


def alert_labels(
    rule: str,
    severity: str,
    subject_type: str,
    subject: str,
    extra: Iterable[tuple[str, str]] = (),
) -> dict[str, str]:
    labels = {
        "alertname": _label(rule),
        "severity": severity_of(severity),
        "subject_type": _label(subject_type),
        "subject": _label(subject),
        "source": "proofplane",
    }
    for k, v in extra:
        if k not in labels:
            labels[k] = _label(v)
    return labels


@dataclass(frozen=True, slots=True)
class Alert:
    """An alert as the log says it is: firing, or resolved at ``ends_at``."""

    fingerprint: str
    rule: str
    severity: str
    labels: dict[str, str]
    summary: str
    starts_at: datetime
    seq: int  # the raise (or the one-shot) event
    stateful: bool
    runbook: str | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    ends_at: datetime | None = None  # resolved (stateful) or expiring (one-shot) at
    resolved_seq: int | None = None

    def status(self, now: datetime) -> str:
        return RESOLVED if self.ends_at is not None and self.ends_at <= now else FIRING

    def to_json(self, now: datetime) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "rule": self.rule,
            "status": self.status(now),
            "severity": self.severity,
            "labels": dict(self.labels),
            "summary": self.summary,
            "runbook": self.runbook,
            "evidence": dict(self.evidence),
            "starts_at": self.starts_at.isoformat(),
            "ends_at": self.ends_at.isoformat() if self.ends_at else None,
            "event_seq": self.seq,
            "resolved_seq": self.resolved_seq,
            "stateful": self.stateful,
        }


def _one_shot(event: Event, rule: str, hold: timedelta) -> Alert:
    d = event.details if isinstance(event.details, Mapping) else {}
    severity = severity_of(d.get("severity"))
    extra = [(k, str(d[k])) for k in LABEL_DETAILS if d.get(k) not in (None, "")]
    labels = alert_labels(rule, severity, event.target_type, event.target_id, extra)
    evidence = {k: v for k, v in d.items() if k not in ("runbook", "severity")}
    summary = d.get("summary") or d.get("message") or f"{event.action} on {event.target_type} "
    if not d.get("summary") and not d.get("message"):
        summary += event.target_id
    return Alert(
        fingerprint(labels),
        rule,
        severity,
        labels,
        str(summary)[: MAX_LABEL * 2],
        event.ts,
        event.seq,
        False,
        d.get("runbook") if isinstance(d.get("runbook"), str) else None,
        evidence,
        event.ts + hold,
    )


def _stateful(event: Event, rule: str) -> Alert:
    d = event.details
    raw = d.get("labels")
    raw_labels: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    severity = severity_of(d.get("severity"))
    labels = alert_labels(
        rule, severity, event.target_type, event.target_id,
        sorted((str(k), str(v)) for k, v in raw_labels.items()),
    )  # fmt: skip
    found = d.get("evidence")
    evidence: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    return Alert(
        str(d["fingerprint"]),
        rule,
        severity,
        labels,
        str(d.get("summary") or event.action),
        event.ts,
        event.seq,
        True,
        d.get("runbook") if isinstance(d.get("runbook"), str) else None,
        evidence,
    )


def alerts_from_events(events: Iterable[Event], *, hold: timedelta) -> dict[str, Alert]:
    """Every alert the events (in ``seq`` order) describe, by fingerprint: the newest episode
    of each (a stateful alert raised again after its resolve is a new episode; a one-shot
    alert raised again within its hold extends it)."""
    return fold({}, events, hold=hold)


def fold(out: dict[str, Alert], events: Iterable[Event], *, hold: timedelta) -> dict[str, Alert]:
    """:func:`alerts_from_events` continued: fold later events into ``out`` (changed in place
    and returned)."""
    for e in events:
        if e.action == RESOLVE:
            fp = e.details.get("fingerprint") if isinstance(e.details, Mapping) else None
            current = out.get(str(fp))
            if current is not None and current.stateful and current.ends_at is None:
                out[current.fingerprint] = _replace(current, ends_at=e.ts, resolved_seq=e.seq)
            continue
        rule = rule_of(e.action)
        if rule is None:
            continue
        d = e.details if isinstance(e.details, Mapping) else {}
        if isinstance(d.get("fingerprint"), str) and d.get("state") == FIRING:
            alert = _stateful(e, rule)
            current = out.get(alert.fingerprint)
            if current is not None and current.stateful and current.ends_at is None:
                continue  # raised twice: the first raise stands
            out[alert.fingerprint] = alert
        else:
            alert = _one_shot(e, rule, hold)
            current = out.get(alert.fingerprint)
            if current is not None and current.ends_at is not None and current.ends_at > e.ts:
                alert = _replace(alert, starts_at=current.starts_at)  # the same episode, longer
            out[alert.fingerprint] = alert
    return out


def _replace(alert: Alert, **changes: Any) -> Alert:
    from dataclasses import replace

    return replace(alert, **changes)


def firing(alerts: Mapping[str, Alert], now: datetime) -> list[Alert]:
    return sorted(
        (a for a in alerts.values() if a.status(now) == FIRING), key=lambda a: (a.starts_at, a.seq)
    )


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What the worker must record after evaluating rules."""

    raise_: tuple[Finding, ...]
    resolve: tuple[Alert, ...]


def reconcile(
    alerts: Mapping[str, Alert], found: Sequence[Finding], evaluated: Iterable[str], now: datetime
) -> Reconciled:
    """Raise what was found and does not fire; resolve the firing stateful alerts of the rules
    just ``evaluated`` that were not found again (a rule not evaluated this pass keeps its
    alerts). Each finding once, by fingerprint."""
    rules = set(evaluated)
    seen: dict[str, Finding] = {}
    for f in found:
        seen.setdefault(f.fingerprint, f)
    fire = {a.fingerprint for a in alerts.values() if a.stateful and a.status(now) == FIRING}
    raise_ = tuple(f for fp, f in seen.items() if fp not in fire)
    resolve = tuple(
        a
        for a in sorted(alerts.values(), key=lambda a: a.seq)
        if a.stateful and a.status(now) == FIRING and a.rule in rules and a.fingerprint not in seen
    )
    return Reconciled(raise_, resolve)


def _iso(ts: datetime) -> str:
    return ts.isoformat().replace("+00:00", "Z")


def alertmanager_payload(
    alerts: Mapping[str, Alert],
    now: datetime,
    *,
    resend_s: float,
    keep_resolved_s: float,
    cluster: str,
    generator_url: str | None = None,
) -> list[dict[str, Any]]:
    """The body of ``POST /api/v2/alerts``: every alert firing now, and every alert resolved
    within ``keep_resolved_s`` (see the module docstring)."""
    out = []
    for a in sorted(alerts.values(), key=lambda a: a.seq):
        if a.status(now) == FIRING:
            ends = a.ends_at if a.ends_at is not None else now + timedelta(seconds=4 * resend_s)
        elif a.ends_at is not None and (now - a.ends_at).total_seconds() <= keep_resolved_s:
            ends = a.ends_at
        else:
            continue
        item: dict[str, Any] = {
            "labels": {**a.labels, "cluster": _label(cluster)},
            "annotations": annotations_of(a),
            "startsAt": _iso(a.starts_at),
            "endsAt": _iso(ends),
        }
        if generator_url:
            item["generatorURL"] = f"{generator_url.rstrip('/')}/api/v1/events/{a.seq}"
        out.append(item)
    return out


def annotations_of(a: Alert) -> dict[str, str]:
    out = {
        "summary": a.summary,
        "fingerprint": a.fingerprint,
        "event_seq": str(a.seq),
        "evidence": json.dumps(a.evidence, sort_keys=True, default=str)[:MAX_ANNOTATION],
    }
    if a.runbook:
        out["runbook"] = a.runbook
    return out


def webhook_payload(
    alerts: Sequence[Alert], now: datetime, *, cluster: str, receiver: str = "proofplane"
) -> dict[str, Any]:
    """Alertmanager's webhook body (version 4), so anything that reads Alertmanager's webhooks
    reads ours: one notification for a group of alerts (here: everything that changed)."""
    items = []
    for a in alerts:
        status = a.status(now)
        items.append(
            {
                "status": status,
                "labels": {**a.labels, "cluster": _label(cluster)},
                "annotations": annotations_of(a),
                "startsAt": _iso(a.starts_at),
                "endsAt": _iso(a.ends_at) if a.ends_at is not None and status == RESOLVED
                else "0001-01-01T00:00:00Z",
                "fingerprint": a.fingerprint,
            }
        )  # fmt: skip
    any_firing = any(i["status"] == FIRING for i in items)
    return {
        "version": "4",
        "groupKey": f"{{}}:{{cluster={json.dumps(cluster)}}}",
        "status": FIRING if any_firing else RESOLVED,
        "receiver": receiver,
        "groupLabels": {"cluster": cluster},
        "commonLabels": {"cluster": cluster, "source": "proofplane"},
        "commonAnnotations": {},
        "externalURL": "",
        "truncatedAlerts": 0,
        "alerts": items,
    }


def state_digest(alerts: Iterable[Alert], now: datetime) -> frozenset[tuple[str, str]]:
    """(fingerprint, status) of each alert: a webhook is notified when this changes."""
    return frozenset((a.fingerprint, a.status(now)) for a in alerts)
