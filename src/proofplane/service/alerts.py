"""Alerts (issue 15, §8): evaluate the rules, record what starts and ends as audit events, and
deliver to Alertmanager and webhooks. The rules are pure (``meter.anomaly``,
``meter.capacity``); the lifecycle is pure (``meter.alerts``); this module reads the facts,
writes the events, and speaks HTTP.

**Events.** A rule's finding is raised as ``alert.<rule>`` (outcome failure; details: rule,
severity, summary, fingerprint, labels, evidence, and the runbook that answers it) on its
subject, only when no alert with its fingerprint fires; when the rule, evaluated again, no
longer finds it, ``alert.resolve`` (details: the fingerprint, the raise's seq) on the same
subject. Both in one write transaction per pass, and none when nothing changed. Alerts other
code raises as events (``alert.auth_failure_burst``, ``alert.gpu_health``…) are delivered the
same way and fire for the rules file's ``one_shot_hold_s``.

**Cadence.** Each pass (``PROOFPLANE_ALERT_INTERVAL_SECONDS``) checks the critical controls
and looks for off-hours spikes in the newest readings (against this hour of the week's
baseline); the anomaly rules judge each whole hour once it is over (and ``SETTLE`` has passed
for late readings), and what that hour showed stands until the next one is judged; the N+1
check runs every ``capacity_interval_s``. A rule resolves its alerts only in a pass that
evaluated it.

**Delivery.** Every pass posts the firing alerts and those resolved in the last
``KEEP_RESOLVED_S`` to each Alertmanager (``POST /api/v2/alerts``; Alertmanager deduplicates
by label set, so re-sending is how it keeps them firing and how a restarted Alertmanager
learns them again), and notifies each webhook of what changed since its last successful
notification (Alertmanager's webhook body): at least once, since what a webhook was told is
kept in this process only (after a restart it is told the current alerts again).

The worker runs in the process that holds the leader lease (``workers.alerts``); every
process serves ``GET /api/v1/alerts`` from the log.
"""

from __future__ import annotations

import logging
import os
import threading
import zoneinfo
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import yaml
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from proofplane.access import SYSTEM, Actor, Permission, authorize
from proofplane.config import AlertSettings
from proofplane.errors import ValidationFailed
from proofplane.meter import alerts as core
from proofplane.meter import anomaly
from proofplane.meter.capacity import n_plus_one_finding
from proofplane.meter.fields import (
    GR_ENGINE_ACTIVE,
    NVLINK_RX_BYTES,
    NVLINK_TX_BYTES,
    PCIE_RX_BYTES,
    PCIE_TX_BYTES,
)
from proofplane.model import KEEPS_WORK, Event, Outcome
from proofplane.service import capacity as capacity_svc
from proofplane.service import instruments, telemetry
from proofplane.service.attestation import node_class
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.service.runbooks import with_runbook
from proofplane.store.tables import (
    AttestationPolicyRow,
    AuditCheckpointRow,
    EventRow,
    NodeAttestationRow,
    NodeRow,
    SinkRow,
)

log = logging.getLogger("proofplane.alerts")

RULES_ENV = "PROOFPLANE_ALERT_RULES"
SHIPPED_RULES = "alert-rules.yaml"
KEEP_RESOLVED_S = 900.0  # resolved alerts are re-sent this long (Prometheus: 15 minutes)
SETTLE = timedelta(minutes=5)  # an hour is judged this long after it ended (late readings)
HTTP_TIMEOUT_S = 5.0
TRANSFER_FIELDS = (PCIE_TX_BYTES, PCIE_RX_BYTES, NVLINK_TX_BYTES, NVLINK_RX_BYTES)
# The alert events: every action in [ALERT_LOW, ALERT_HIGH) starts with "alert." (an index range)
ALERT_LOW, ALERT_HIGH = "alert.", "alert/"
STATUSES = ("firing", "resolved", "all")


# --- the rules file ----------------------------------------------------------------------------


def _zone(name: str) -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(name)


def load_rules(path: str | None = None) -> anomaly.AlertRules:
    """The alert rules of ``path``, else of ``PROOFPLANE_ALERT_RULES``, else the shipped file.
    A file that cannot be read or is not the form: ``invalid_alert_rules``."""
    chosen = path or os.environ.get(RULES_ENV) or None
    if chosen is None:
        text = (resources.files("proofplane") / "data" / SHIPPED_RULES).read_text("utf-8")
    else:
        try:
            text = Path(chosen).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise anomaly.invalid(f"cannot read {chosen}: {type(exc).__name__}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise anomaly.invalid(f"not YAML: {str(exc).splitlines()[0][:200]}") from None
    return anomaly.parse_rules(data, _zone)


# --- the state one worker keeps ----------------------------------------------------------------


@dataclass
class AlertState:
    """What the alert worker keeps between passes (one per worker; rebuilt from the log)."""

    alerts: dict[str, core.Alert] = field(default_factory=dict)
    cursor: int = 0  # the newest alert event folded into ``alerts``
    figures: dict[str, dict[datetime, anomaly.TenantHour]] = field(default_factory=dict)
    figures_from: datetime | None = None  # hours in [figures_from, figures_to) are loaded
    figures_to: datetime | None = None
    judged_hour: datetime | None = None  # the newest hour the anomaly rules judged
    hour_findings: list[core.Finding] = field(default_factory=list)  # what that hour showed
    capacity_at: datetime | None = None  # when the N+1 check last ran
    notified: dict[str, frozenset[tuple[str, str]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _alert_events(session: Session, after: int) -> list[Event]:
    rows = session.scalars(
        select(EventRow)
        .where(EventRow.action >= ALERT_LOW, EventRow.action < ALERT_HIGH, EventRow.seq > after)
        .order_by(EventRow.seq)
    )
    return [event_from_row(r) for r in rows]


def fold_new(session: Session, state: AlertState, hold: timedelta) -> None:
    """Fold the alert events recorded since ``state.cursor`` into ``state.alerts``."""
    events = _alert_events(session, state.cursor)
    if events:
        core.fold(state.alerts, events, hold=hold)
        state.cursor = events[-1].seq


def prune(state: AlertState, now: datetime) -> None:
    """Forget alerts that ended longer ago than they are re-sent."""
    keep = timedelta(seconds=KEEP_RESOLVED_S)
    for fp in [
        fp for fp, a in state.alerts.items() if a.ends_at is not None and a.ends_at < now - keep
    ]:
        del state.alerts[fp]


# --- facts ------------------------------------------------------------------------------------


def control_facts(session: Session, now: datetime, grace_s: float) -> anomaly.ControlFacts:
    """SIEM sinks, the audit log against its newest checkpoint, and nodes in service whose
    attestation is stale under an enforcing policy."""
    head = session.scalar(select(func.max(EventRow.seq))) or 0
    sinks = [
        anomaly.SinkFacts(name, enabled, fails, max(0, head - cursor), err, ok, created)
        for name, enabled, fails, cursor, err, ok, created in session.execute(
            select(
                SinkRow.name,
                SinkRow.enabled,
                SinkRow.consecutive_failures,
                SinkRow.cursor,
                SinkRow.last_error,
                SinkRow.last_success_at,
                SinkRow.created_at,
            )
        )
    ]
    newest = session.execute(
        select(AuditCheckpointRow.tree_size, AuditCheckpointRow.created_at)
        .order_by(AuditCheckpointRow.tree_size.desc(), AuditCheckpointRow.id.desc())
        .limit(1)
    ).first()
    size = int(newest[0]) if newest else 0
    first_unsigned = (
        session.scalar(select(EventRow.ts).where(EventRow.seq == size + 1)) if head > size else None
    )
    stale: list[tuple[str, datetime | None]] = []
    enforcing = set(
        session.scalars(
            select(AttestationPolicyRow.node_class).where(AttestationPolicyRow.enforce.is_(True))
        )
    )
    if enforcing:
        limit = now - timedelta(seconds=grace_s)
        rows = session.execute(
            select(NodeRow, NodeAttestationRow.last_passed_at)
            .outerjoin(NodeAttestationRow, NodeAttestationRow.node_id == NodeRow.id)
            .where(NodeRow.state.in_([s.value for s in KEEPS_WORK]))
        )
        for node, last in rows:
            if node_class(node) in enforcing and (last is None or last < limit):
                stale.append((node.name, last))
    return anomaly.ControlFacts(
        sinks=sinks,
        log_head=head,
        checkpoint_size=size,
        checkpoint_at=newest[1] if newest else None,
        oldest_unsigned_at=first_unsigned,
        stale_nodes=stale,
        attest_grace_s=grace_s,
    )


def _hour(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def tenant_figures(
    store: Store, state: AlertState, judged: datetime, rules: anomaly.AlertRules
) -> dict[str, dict[datetime, anomaly.TenantHour]]:
    """Per tenant and hour, up to and including the hour ``judged``: devices held, their mean
    activity, PCIe + NVLink bytes (mean rate × 3600 s per device), from the hourly rollups.
    Loaded once for the lookback, then an hour at a time."""
    weeks = max(rules.offhours.lookback_weeks, rules.transfer.lookback_weeks)
    start = judged - timedelta(weeks=weeks)
    end = judged + anomaly.HOUR
    if state.figures_from is None or state.figures_to is None or state.figures_from > start:
        load_from = start
        state.figures = {}
    else:
        load_from = max(state.figures_to, start)
    if load_from < end:
        acc: dict[tuple[str, datetime], list[float]] = {}
        for h in telemetry.hourly_rows(
            store, start=load_from, end=end, field_name=GR_ENGINE_ACTIVE
        ):
            if h.tenant is None:
                continue
            a = acc.setdefault((h.tenant, h.hour), [0.0, 0.0, 0.0, 0.0])
            a[0] += 1
            a[1] += h.sum
            a[2] += h.count
        for name in TRANSFER_FIELDS:
            for h in telemetry.hourly_rows(store, start=load_from, end=end, field_name=name):
                if h.tenant is None or h.count <= 0:
                    continue
                a = acc.setdefault((h.tenant, h.hour), [0.0, 0.0, 0.0, 0.0])
                a[3] += h.sum / h.count * 3600.0
        for (tenant, hour), (devices, total, count, moved) in acc.items():
            state.figures.setdefault(tenant, {})[hour] = anomaly.TenantHour(
                devices, total / count if count else None, moved
            )
        state.figures_to = end
    state.figures_from = start
    for by_hour in state.figures.values():
        for old in [h for h in by_hour if h < start]:
            del by_hour[old]
    return state.figures


def current_spikes(
    store: Store, state: AlertState, rules: anomaly.AlertRules, now: datetime
) -> list[core.Finding]:
    """Off-hours spikes seen in the newest readings (``telemetry.tenant_latest``: the devices
    each tenant holds now and their mean activity), against the baseline of this hour of the
    week: a spike raises within a pass or two instead of after its hour. Its alert is the
    hourly rule's (same labels); it ends when neither the newest readings nor the last whole
    hour show it. Only the figures already loaded for the hourly rule are the baseline."""
    hour = _hour(now)
    since = now - timedelta(minutes=5)
    try:
        rows = telemetry.tenant_latest(store, fields=[GR_ENGINE_ACTIVE], since=since)
    except Exception:
        log.warning("alerts: reading the newest telemetry failed", exc_info=True)
        return []
    figures: dict[str, dict[datetime, anomaly.TenantHour]] = {}
    for row in rows:
        tenant, devices = row.get("tenant"), int(row.get("devices") or 0)
        if not tenant or devices <= 0 or tenant not in state.figures:
            continue  # no past: no verdict
        figures[tenant] = {
            **state.figures[tenant],
            hour: anomaly.TenantHour(devices, float(row["sum"]) / devices),
        }
    out = []
    for f in anomaly.offhours_spikes(figures, hour, rules):
        out.append(replace(f, evidence={**f.evidence, "window": "newest readings"}))
    return out


# --- a pass ---------------------------------------------------------------------------------------


@dataclass
class PassResult:
    raised: list[int] = field(default_factory=list)  # seqs of alert.<rule> events
    resolved: list[int] = field(default_factory=list)  # seqs of alert.resolve events
    evaluated: list[str] = field(default_factory=list)
    delivered: dict[str, bool] = field(default_factory=dict)  # receiver URL → acknowledged


def evaluate(
    store: Store,
    state: AlertState,
    rules: anomaly.AlertRules,
    now: datetime,
    *,
    attest_grace_s: float = 900.0,
    capacity: bool | None = None,
) -> PassResult:
    """Run the rules that are due, and record what starts and what ends (one transaction,
    none when nothing changed). ``capacity``: run the N+1 check now (None: when due)."""
    hold = timedelta(seconds=rules.one_shot_hold_s)
    found: list[core.Finding] = []
    evaluated: list[str] = []
    with store.read() as session:
        fold_new(session, state, hold)
        facts = control_facts(session, now, attest_grace_s)
    found += anomaly.control_failures(facts, rules, now)
    evaluated.append(anomaly.CONTROL_FAILING)

    judged = _hour(now - SETTLE) - anomaly.HOUR
    if state.judged_hour is None or judged > state.judged_hour:
        figures = tenant_figures(store, state, judged, rules)
        state.hour_findings = [
            *anomaly.offhours_spikes(figures, judged, rules),
            *anomaly.transfer_spikes(figures, judged, rules),
        ]
        state.judged_hour = judged
    found += state.hour_findings
    found += current_spikes(store, state, rules, now)
    evaluated += [anomaly.OFFHOURS_SPIKE, anomaly.TRANSFER_VOLUME]

    due = state.capacity_at is None or (now - state.capacity_at).total_seconds() >= (
        rules.capacity_interval_s
    )
    if capacity if capacity is not None else due:
        for checked in capacity_svc.capacity_checks(store):
            finding = n_plus_one_finding(checked)
            if finding is not None:
                found.append(finding)
        evaluated.append(anomaly.CAPACITY_N_PLUS_ONE)
        state.capacity_at = now

    result = PassResult(evaluated=evaluated)
    plan = core.reconcile(state.alerts, found, evaluated, now)
    if plan.raise_ or plan.resolve:
        with store.write(SYSTEM, now) as tx:
            fold_new(tx.session, state, hold)  # whatever was recorded meanwhile
            plan = core.reconcile(state.alerts, found, evaluated, now)
            for f in plan.raise_:
                action = f"{core.PREFIX}{f.rule}"
                details = with_runbook(f.details(None), action, Outcome.FAILURE, tx.session)
                event = tx.record(action, f.subject_type, f.subject, outcome=Outcome.FAILURE,
                                  details=details)  # fmt: skip
                result.raised.append(event.seq)
            for a in plan.resolve:
                event = tx.record(
                    core.RESOLVE,
                    a.labels.get("subject_type", "cluster"),
                    a.labels.get("subject", a.rule),
                    details={
                        "rule": a.rule,
                        "fingerprint": a.fingerprint,
                        "severity": a.severity,
                        "raised_seq": a.seq,
                        "summary": f"resolved: {a.summary}",
                        "labels": {k: v for k, v in a.labels.items() if k not in _BUILT_IN},
                    },
                )
                result.resolved.append(event.seq)
        with store.read() as session:
            fold_new(session, state, hold)
    prune(state, now)
    return result


_BUILT_IN = frozenset({"alertname", "severity", "subject_type", "subject", "source"})


# --- delivery ----------------------------------------------------------------------------------


def _token(settings: AlertSettings) -> str | None:
    if settings.webhook_token_file is None:
        return None
    try:
        return Path(settings.webhook_token_file).read_text("utf-8").strip() or None
    except OSError:
        log.warning("alerts: cannot read PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE")
        return None


def _post(client: httpx.Client, url: str, body: Any, headers: Mapping[str, str]) -> bool:
    try:
        r = client.post(url, json=body, headers=dict(headers))
    except httpx.HTTPError as exc:
        log.warning("alerts: %s unreachable (%s)", url, type(exc).__name__)
        return False
    if r.status_code // 100 != 2:
        log.warning("alerts: %s answered %d", url, r.status_code)
        return False
    return True


def deliver(
    state: AlertState,
    settings: AlertSettings,
    now: datetime,
    *,
    cluster: str,
    client: httpx.Client | None = None,
) -> dict[str, bool]:
    """Send the alerts to every Alertmanager and webhook (see the module docstring); receiver
    URL → whether it acknowledged (a receiver with nothing to be told is left out)."""
    out: dict[str, bool] = {}
    if not settings.alertmanagers and not settings.webhooks:
        return out
    own = client is None
    http = client or httpx.Client(timeout=HTTP_TIMEOUT_S)
    try:
        payload = core.alertmanager_payload(
            state.alerts, now, resend_s=settings.interval_s or 60.0,
            keep_resolved_s=KEEP_RESOLVED_S, cluster=cluster,
            generator_url=settings.external_url,
        )  # fmt: skip
        for base in settings.alertmanagers:
            if not payload:
                continue
            ok = _post(http, f"{base}/api/v2/alerts", payload, {})
            instruments.count_delivery("alertmanager", ok)
            out[base] = ok
        keep = timedelta(seconds=KEEP_RESOLVED_S)
        current = [
            a
            for a in state.alerts.values()
            if a.status(now) == core.FIRING or (a.ends_at is not None and now - a.ends_at <= keep)
        ]
        pairs = core.state_digest(current, now)
        headers = {}
        token = _token(settings) if settings.webhooks else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        for url in settings.webhooks:
            told = state.notified.get(url, frozenset())
            news = pairs - told
            if not news:
                state.notified[url] = told & pairs
                continue
            changed = sorted(
                (a for a in current if (a.fingerprint, a.status(now)) in news),
                key=lambda a: a.seq,
            )
            ok = _post(http, url, core.webhook_payload(changed, now, cluster=cluster), headers)
            instruments.count_delivery("webhook", ok)
            out[url] = ok
            if ok:
                state.notified[url] = (told & pairs) | news
    finally:
        if own:
            http.close()
    return out


# --- reading -------------------------------------------------------------------------------------


def list_alerts(
    store: Store,
    actor: Actor,
    now: datetime,
    *,
    status: str = "firing",
    hold: timedelta | None = None,
) -> list[dict[str, Any]]:
    """The alerts the log describes (the newest episode of each): ``firing``, ``resolved`` or
    ``all``, oldest first. Alerts are events: who reads the event log reads them."""
    authorize(actor, Permission.EVENTS_READ)
    if status not in STATUSES:
        raise ValidationFailed(
            f"status is one of {', '.join(STATUSES)}",
            code="invalid_status",
            details={"status": str(status)[:40]},
        )
    if hold is None:
        hold = timedelta(seconds=load_rules().one_shot_hold_s)
    with store.read() as session:
        alerts = core.alerts_from_events(_alert_events(session, 0), hold=hold)
    out = [
        a.to_json(now)
        for a in sorted(alerts.values(), key=lambda a: (a.starts_at, a.seq))
        if status == "all" or a.status(now) == status
    ]
    return out


def firing_fingerprints(alerts: Iterable[core.Alert], now: datetime) -> set[str]:
    return {a.fingerprint for a in alerts if a.status(now) == core.FIRING}


def check_rules_file(path: str | None) -> Sequence[str]:
    """Parse the rules file at start (a mistake stops the server, never a default); the
    tenants it names, for the start-up line."""
    return sorted(load_rules(path).tenant_hours)
