"""Anomaly rules (issue 15, §8). Pure: hourly figures and facts in, findings out (each becomes an
``alert.<rule>`` event through ``service.alerts``); the clock and the time zones are passed in.

* ``offhours_spike``: outside its business hours, a tenant holds more GPUs (``allocation``) or
  works them harder (``utilisation``) than its own baseline for that hour of the week. The
  baseline is an exponentially weighted mean and variance (EWMA, ``alpha``) of the same hour of
  the week over the last ``lookback_weeks`` weeks, in the tenant's time zone; the finding needs
  a z-score of at least ``z`` and an absolute floor (``min_gpus``, ``min_utilisation``), so a
  tenant that never works at night is not alerted for one idle slice. With fewer than
  ``min_samples`` weeks for that hour, the tenant's off-hours hours of the whole lookback are
  the baseline; with fewer than that, nothing is said (no baseline, no verdict). A tenant's
  past starts with its first figures: an hour without one after that held nothing (0 GPUs),
  one before it is not part of its baseline.
* ``transfer_volume``: PCIe and NVLink bytes a tenant's devices moved in an hour against its
  baseline for that hour of the week (any time of day: data leaves at noon too), threshold
  ``z`` and ``min_bytes``.
* ``control_failing`` (PCI DSS 10.7.2, failures of critical security controls are detected and
  alerted): a SIEM sink that has not delivered for ``sink_down_after_s`` while failing; the
  checkpoint signer stalled (entries unsigned for ``checkpoint_stall_s``); attestation gone
  stale (nodes in service under an enforcing policy whose last pass is older than the grace
  plus ``attestation_slack_s``: the staleness control did not act).
* Failed-login bursts are today's alerts, raised where the failures are counted (in the same
  transaction as the failed login, ``service.access``): ``alert.auth_failure_burst`` (5
  consecutive failures on one account), ``alert.auth_failure_spray`` (20 across accounts in a
  minute), ``alert.auth_source_throttled`` (an address being made to wait). They are listed in
  :data:`ONE_SHOT_RULES` and reach Alertmanager and webhooks like every alert; no second
  detector here.

The thresholds, business hours and time zones are data (:func:`parse_rules`): the shipped
``data/alert-rules.yaml`` or ``PROOFPLANE_ALERT_RULES``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, time, timedelta, tzinfo
from typing import Any

from proofplane.errors import ValidationFailed
from proofplane.meter.alerts import Finding

HOUR = timedelta(hours=1)
WEEK = timedelta(weeks=1)
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")

OFFHOURS_SPIKE = "offhours_spike"
TRANSFER_VOLUME = "transfer_volume"
CONTROL_FAILING = "control_failing"
CAPACITY_N_PLUS_ONE = "capacity_n_plus_one"
#: the rules the alert worker evaluates (stateful: raised once, resolved when clear)
EVALUATED_RULES = (OFFHOURS_SPIKE, TRANSFER_VOLUME, CONTROL_FAILING, CAPACITY_N_PLUS_ONE)
#: alerts other code raises as events (one-shot: they fire for the hold, then end)
ONE_SHOT_RULES = (
    "auth_failure_burst",
    "auth_failure_spray",
    "auth_source_throttled",
    "change_review_overdue",
    "gpu_health",
)


def invalid(problem: str, **details: Any) -> ValidationFailed:
    return ValidationFailed(
        f"invalid alert rules: {problem}", code="invalid_alert_rules", details=details
    )


# --- business hours --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BusinessHours:
    """Days of the week (0 Monday) and a daily window [start, end) in a time zone; ``end``
    00:00 means midnight at the end of the day."""

    days: frozenset[int]
    start: time
    end: time
    tz: tzinfo
    zone: str = "UTC"

    def contains(self, ts: datetime) -> bool:
        local = ts.astimezone(self.tz)
        if local.weekday() not in self.days:
            return False
        t = local.time().replace(tzinfo=None)
        end_of_day = self.end == time(0)
        return self.start <= t and (end_of_day or t < self.end)

    def to_json(self) -> dict[str, Any]:
        return {
            "days": [DAYS[d] for d in sorted(self.days)],
            "start": self.start.strftime("%H:%M"),
            "end": "24:00" if self.end == time(0) else self.end.strftime("%H:%M"),
            "timezone": self.zone,
        }


def hour_of_week(ts: datetime, tz: tzinfo) -> int:
    """0..167: Monday 00:00–01:00 local time is 0."""
    local = ts.astimezone(tz)
    return local.weekday() * 24 + local.hour


# --- the rules' settings ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpikeRule:
    z: float = 3.0
    alpha: float = 0.3
    lookback_weeks: int = 4
    min_samples: int = 3
    min_gpus: float = 1.0
    min_utilisation: float = 0.2
    std_floor_gpus: float = 0.5
    std_floor_utilisation: float = 0.05


@dataclass(frozen=True, slots=True)
class TransferRule:
    z: float = 4.0
    alpha: float = 0.3
    lookback_weeks: int = 4
    min_samples: int = 3
    min_bytes: float = 1e9
    std_floor_bytes: float = 1e8


@dataclass(frozen=True, slots=True)
class ControlRule:
    sink_down_after_s: float = 300.0
    checkpoint_stall_s: float = 900.0
    attestation_slack_s: float = 300.0


@dataclass(frozen=True, slots=True)
class AlertRules:
    business_hours: BusinessHours
    tenant_hours: Mapping[str, BusinessHours] = field(default_factory=dict)
    offhours: SpikeRule = SpikeRule()
    transfer: TransferRule = TransferRule()
    controls: ControlRule = ControlRule()
    one_shot_hold_s: float = 3600.0
    capacity_interval_s: float = 300.0
    forecast_days: int = 28

    def hours_of(self, tenant: str) -> BusinessHours:
        return self.tenant_hours.get(tenant, self.business_hours)


_HHMM = re.compile(r"([01]\d|2[0-4]):([0-5]\d)")
_KNOWN = {
    "": ("business_hours", "offhours_spike", "transfer_volume", "controls", "one_shot_hold_s",
         "capacity_interval_s", "forecast_days"),
    "business_hours": ("default", "tenants"),
    "hours": ("days", "start", "end", "timezone"),
}  # fmt: skip


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise invalid(f"{where} is a mapping", where=where)
    return value


def _unknown(data: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    extra = sorted(str(k) for k in data if k not in set(known))
    if extra:
        raise invalid(f"{where}: unknown field(s) {', '.join(extra)[:200]}", where=where)


def _number(data: Mapping[str, Any], key: str, default: float, low: float, high: float,
            where: str) -> float:  # fmt: skip
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{where}.{key} is a number", where=f"{where}.{key}")
    if not low <= value <= high:
        raise invalid(f"{where}.{key} must be {low:g}..{high:g}", where=f"{where}.{key}")
    return float(value)


def _hhmm(value: Any, where: str) -> time:
    text = str(value) if isinstance(value, str | int) else ""
    m = _HHMM.fullmatch(text)
    if m is None or (m.group(1) == "24" and m.group(2) != "00"):
        raise invalid(f"{where} is HH:MM (00:00..24:00)", where=where)
    return time(0) if m.group(1) == "24" else time(int(m.group(1)), int(m.group(2)))


def _hours(data: Any, where: str, zone: Callable[[str], tzinfo]) -> BusinessHours:
    d = _mapping(data, where)
    _unknown(d, _KNOWN["hours"], where)
    days_raw = d.get("days", list(DAYS[:5]))
    if not isinstance(days_raw, list) or not days_raw:
        raise invalid(f"{where}.days is a list of days (mon..sun)", where=f"{where}.days")
    days = set()
    for day in days_raw:
        if not isinstance(day, str) or day.lower()[:3] not in DAYS:
            raise invalid(f"{where}.days: {str(day)[:20]!r} is not a day", where=f"{where}.days")
        days.add(DAYS.index(day.lower()[:3]))
    start = _hhmm(d.get("start", "08:00"), f"{where}.start")
    end = _hhmm(d.get("end", "18:00"), f"{where}.end")
    if start == time(0) and str(d.get("start", "")) == "24:00":
        raise invalid(f"{where}.start cannot be 24:00", where=f"{where}.start")
    if end != time(0) and end <= start:
        raise invalid(f"{where}: end must come after start", where=where)
    name = d.get("timezone", "UTC")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise invalid(f"{where}.timezone is an IANA time zone name", where=f"{where}.timezone")
    try:
        tz = zone(name)
    except Exception:
        raise invalid(f"{where}.timezone: unknown time zone {name[:64]!r}",
                      where=f"{where}.timezone") from None  # fmt: skip
    return BusinessHours(frozenset(days), start, end, tz, name)


def parse_rules(data: Any, zone: Callable[[str], tzinfo]) -> AlertRules:
    """The alert rules from their YAML's data; ``zone`` turns a time zone name into a tzinfo
    (``zoneinfo.ZoneInfo``: the caller's, as it reads the time zone database).
    ``invalid_alert_rules`` (422) for anything that is not the form."""
    root = _mapping(data, "the document")
    _unknown(root, _KNOWN[""], "the document")
    bh = _mapping(root.get("business_hours"), "business_hours")
    _unknown(bh, _KNOWN["business_hours"], "business_hours")
    default = _hours(bh.get("default"), "business_hours.default", zone)
    tenants_raw = _mapping(bh.get("tenants"), "business_hours.tenants")
    if len(tenants_raw) > 10_000:
        raise invalid("business_hours.tenants: at most 10000 tenants")
    tenants = {
        str(t): _hours(v, f"business_hours.tenants.{str(t)[:63]}", zone)
        for t, v in tenants_raw.items()
    }
    s = _mapping(root.get("offhours_spike"), "offhours_spike")
    _unknown(s, SpikeRule.__dataclass_fields__, "offhours_spike")
    spike = SpikeRule(
        z=_number(s, "z", 3.0, 0.5, 100, "offhours_spike"),
        alpha=_number(s, "alpha", 0.3, 0.01, 1, "offhours_spike"),
        lookback_weeks=int(_number(s, "lookback_weeks", 4, 1, 52, "offhours_spike")),
        min_samples=int(_number(s, "min_samples", 3, 1, 1000, "offhours_spike")),
        min_gpus=_number(s, "min_gpus", 1.0, 0, 1e6, "offhours_spike"),
        min_utilisation=_number(s, "min_utilisation", 0.2, 0, 1, "offhours_spike"),
        std_floor_gpus=_number(s, "std_floor_gpus", 0.5, 1e-6, 1e6, "offhours_spike"),
        std_floor_utilisation=_number(s, "std_floor_utilisation", 0.05, 1e-6, 1,
                                      "offhours_spike"),
    )  # fmt: skip
    t = _mapping(root.get("transfer_volume"), "transfer_volume")
    _unknown(t, TransferRule.__dataclass_fields__, "transfer_volume")
    transfer = TransferRule(
        z=_number(t, "z", 4.0, 0.5, 100, "transfer_volume"),
        alpha=_number(t, "alpha", 0.3, 0.01, 1, "transfer_volume"),
        lookback_weeks=int(_number(t, "lookback_weeks", 4, 1, 52, "transfer_volume")),
        min_samples=int(_number(t, "min_samples", 3, 1, 1000, "transfer_volume")),
        min_bytes=_number(t, "min_bytes", 1e9, 0, 1e18, "transfer_volume"),
        std_floor_bytes=_number(t, "std_floor_bytes", 1e8, 1, 1e18, "transfer_volume"),
    )
    c = _mapping(root.get("controls"), "controls")
    _unknown(c, ControlRule.__dataclass_fields__, "controls")
    controls = ControlRule(
        sink_down_after_s=_number(c, "sink_down_after_s", 300, 0, 86400, "controls"),
        checkpoint_stall_s=_number(c, "checkpoint_stall_s", 900, 1, 86400 * 7, "controls"),
        attestation_slack_s=_number(c, "attestation_slack_s", 300, 0, 86400, "controls"),
    )
    return AlertRules(
        default,
        tenants,
        spike,
        transfer,
        controls,
        one_shot_hold_s=_number(root, "one_shot_hold_s", 3600, 60, 86400 * 7, "the document"),
        capacity_interval_s=_number(root, "capacity_interval_s", 300, 10, 86400, "the document"),
        forecast_days=int(_number(root, "forecast_days", 28, 1, 365, "the document")),
    )


def default_rules() -> AlertRules:
    """Monday to Friday 08:00–18:00 UTC and the dataclasses' thresholds."""
    return parse_rules({}, lambda _name: UTC)


# --- the baseline ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Baseline:
    mean: float
    std: float
    samples: int


def ewma(values: Sequence[float], alpha: float) -> Baseline:
    """Exponentially weighted mean and standard deviation of ``values`` (oldest first): the
    incremental form (West 1979), the first value seeding the mean."""
    if not values:
        return Baseline(0.0, 0.0, 0)
    mean, var = float(values[0]), 0.0
    for x in values[1:]:
        diff = x - mean
        incr = alpha * diff
        mean += incr
        var = (1 - alpha) * (var + diff * incr)
    return Baseline(mean, math.sqrt(max(var, 0.0)), len(values))


def zscore(x: float, base: Baseline, floor: float) -> float:
    return (x - base.mean) / max(base.std, floor)


def _history(
    series: Mapping[datetime, float],
    hour: datetime,
    weeks: int,
    default: float | None,
    since: datetime,
) -> list[float]:
    """The same hour of the week over the ``weeks`` weeks before ``hour``, oldest first; an
    hour with no figure is ``default`` (None: left out), one before ``since`` (the tenant's
    first figures) left out: a tenant's past starts when it does."""
    out = []
    for k in range(weeks, 0, -1):
        h = hour - k * WEEK
        if h < since:
            continue
        v = series.get(h, default)
        if v is not None:
            out.append(v)
    return out


def _pooled(
    series: Mapping[datetime, float],
    hour: datetime,
    weeks: int,
    keep: Callable[[datetime], bool],
    default: float | None,
    since: datetime,
) -> list[float]:
    """Every hour in the ``weeks`` weeks before ``hour`` (from ``since``) that ``keep`` keeps,
    oldest first."""
    out = []
    h = max(hour - weeks * WEEK, since)
    while h < hour:
        if keep(h):
            v = series.get(h, default)
            if v is not None:
                out.append(v)
        h += HOUR
    return out


@dataclass(frozen=True, slots=True)
class TenantHour:
    """A tenant's figures for one hour: devices it held (any part of the hour), their mean
    graphics-engine activity, and PCIe + NVLink bytes moved."""

    devices: float = 0.0
    utilisation: float | None = None
    transfer_bytes: float = 0.0


def _judge(
    x: float,
    series: Mapping[datetime, float],
    hour: datetime,
    *,
    weeks: int,
    alpha: float,
    min_samples: int,
    floor: float,
    pooled_keep: Callable[[datetime], bool],
    default: float | None,
    since: datetime,
) -> tuple[float, Baseline, str] | None:
    slot = _history(series, hour, weeks, default, since)
    basis = "hour_of_week"
    if len(slot) < min_samples:
        slot = _pooled(series, hour, weeks, pooled_keep, default, since)
        basis = "pooled"
        if len(slot) < min_samples:
            return None
    base = ewma(slot, alpha)
    return zscore(x, base, floor), base, basis


def offhours_spikes(
    figures: Mapping[str, Mapping[datetime, TenantHour]], hour: datetime, rules: AlertRules
) -> list[Finding]:
    """The off-hours spikes of the hour starting at ``hour`` (UTC, on the hour), per tenant."""
    rule = rules.offhours
    out: list[Finding] = []
    for tenant in sorted(figures):
        hours = rules.hours_of(tenant)
        if hours.contains(hour):
            continue
        by_hour = figures[tenant]
        now = by_hour.get(hour, TenantHour())
        since = min(by_hour, default=hour)
        alloc = {h: f.devices for h, f in by_hour.items()}
        util = {h: f.utilisation for h, f in by_hour.items() if f.utilisation is not None}

        def off(h: datetime, hours: BusinessHours = hours) -> bool:
            return not hours.contains(h)

        checks: list[tuple[str, float, Mapping[datetime, float], float, float, float | None]] = [
            ("allocation", now.devices, alloc, rule.min_gpus, rule.std_floor_gpus, 0.0),
        ]
        if now.utilisation is not None:
            checks.append(("utilisation", now.utilisation, util, rule.min_utilisation,
                           rule.std_floor_utilisation, None))  # fmt: skip
        for metric, x, series, minimum, floor, default in checks:
            if x < minimum:
                continue
            judged = _judge(x, series, hour, weeks=rule.lookback_weeks, alpha=rule.alpha,
                            min_samples=rule.min_samples, floor=floor, pooled_keep=off,
                            default=default, since=since)  # fmt: skip
            if judged is None or judged[0] < rule.z:
                continue
            z, base, basis = judged
            unit = "GPUs" if metric == "allocation" else "utilisation"
            out.append(
                Finding(
                    OFFHOURS_SPIKE,
                    "medium",
                    "tenant",
                    tenant,
                    f"tenant {tenant}: off-hours {metric} {x:.3g} {unit} against a baseline of "
                    f"{base.mean:.3g} (z {z:.1f}) at {hour.astimezone(hours.tz):%a %H:00} "
                    f"{hours.zone}",
                    (("tenant", tenant), ("metric", metric)),
                    {
                        "metric": metric,
                        "hour": hour.isoformat(),
                        "value": round(x, 6),
                        "baseline_mean": round(base.mean, 6),
                        "baseline_std": round(base.std, 6),
                        "baseline_samples": base.samples,
                        "baseline": basis,
                        "z": round(z, 3),
                        "threshold_z": rule.z,
                        "business_hours": hours.to_json(),
                    },
                )
            )
    return out


def transfer_spikes(
    figures: Mapping[str, Mapping[datetime, TenantHour]], hour: datetime, rules: AlertRules
) -> list[Finding]:
    """Unusual PCIe/NVLink volume in the hour starting at ``hour``, per tenant."""
    rule = rules.transfer
    out: list[Finding] = []
    for tenant in sorted(figures):
        by_hour = figures[tenant]
        x = by_hour.get(hour, TenantHour()).transfer_bytes
        if x < rule.min_bytes:
            continue
        series = {h: f.transfer_bytes for h, f in by_hour.items()}
        judged = _judge(x, series, hour, weeks=rule.lookback_weeks, alpha=rule.alpha,
                        min_samples=rule.min_samples, floor=rule.std_floor_bytes,
                        pooled_keep=lambda _h: True, default=0.0,
                        since=min(by_hour, default=hour))  # fmt: skip
        if judged is None or judged[0] < rule.z:
            continue
        z, base, basis = judged
        out.append(
            Finding(
                TRANSFER_VOLUME,
                "high",
                "tenant",
                tenant,
                f"tenant {tenant}: {x / 1e9:.3g} GB over PCIe/NVLink in an hour against a "
                f"baseline of {base.mean / 1e9:.3g} GB (z {z:.1f})",
                (("tenant", tenant),),
                {
                    "hour": hour.isoformat(),
                    "bytes": round(x),
                    "baseline_mean_bytes": round(base.mean),
                    "baseline_std_bytes": round(base.std),
                    "baseline_samples": base.samples,
                    "baseline": basis,
                    "z": round(z, 3),
                    "threshold_z": rule.z,
                },
            )
        )
    return out


# --- critical controls -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SinkFacts:
    name: str
    enabled: bool
    consecutive_failures: int
    lag: int
    last_error: str | None
    last_success_at: datetime | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ControlFacts:
    """What the control checks read (the service gathers it in one read)."""

    sinks: Sequence[SinkFacts] = ()
    log_head: int = 0
    checkpoint_size: int = 0
    checkpoint_at: datetime | None = None
    oldest_unsigned_at: datetime | None = None  # the first entry no checkpoint covers
    stale_nodes: Sequence[tuple[str, datetime | None]] = ()  # in service, last pass too old
    attest_grace_s: float = 900.0


MAX_LISTED = 20  # nodes named in one finding's evidence


def control_failures(facts: ControlFacts, rules: AlertRules, now: datetime) -> list[Finding]:
    """The critical controls failing now (see the module docstring)."""
    c = rules.controls
    out: list[Finding] = []
    for sink in sorted(facts.sinks, key=lambda s: s.name):
        if not sink.enabled or sink.consecutive_failures <= 0:
            continue
        down = (now - (sink.last_success_at or sink.created_at)).total_seconds()
        if down < c.sink_down_after_s:
            continue
        out.append(
            Finding(
                CONTROL_FAILING,
                "critical",
                "sink",
                sink.name,
                f"SIEM sink {sink.name} has delivered nothing for {down:.0f} s "
                f"({sink.consecutive_failures} failed passes, {sink.lag} events behind)",
                (("control", "siem_sink"), ("sink", sink.name)),
                {
                    "control": "siem_sink",
                    "consecutive_failures": sink.consecutive_failures,
                    "lag_events": sink.lag,
                    "last_error": (sink.last_error or "")[:300],
                    "last_success_at": sink.last_success_at.isoformat()
                    if sink.last_success_at
                    else None,
                    "threshold_s": c.sink_down_after_s,
                },
            )
        )
    unsigned = facts.log_head - facts.checkpoint_size
    if unsigned > 0:
        known = [t for t in (facts.checkpoint_at, facts.oldest_unsigned_at) if t is not None]
        stalled = (now - max(known)).total_seconds() if known else 0.0
        if stalled >= c.checkpoint_stall_s:
            out.append(
                Finding(
                    CONTROL_FAILING,
                    "critical",
                    "cluster",
                    "audit-checkpoint",
                    f"the audit log's checkpoint signer is stalled: {unsigned} entries unsigned "
                    f"for {stalled:.0f} s",
                    (("control", "audit_checkpoint"),),
                    {
                        "control": "audit_checkpoint",
                        "log_entries": facts.log_head,
                        "checkpoint_tree_size": facts.checkpoint_size,
                        "checkpoint_at": facts.checkpoint_at.isoformat()
                        if facts.checkpoint_at
                        else None,
                        "unsigned_for_s": round(stalled),
                        "threshold_s": c.checkpoint_stall_s,
                    },
                )
            )
    limit = facts.attest_grace_s + c.attestation_slack_s
    stale = [
        (name, last)
        for name, last in sorted(facts.stale_nodes)
        if last is None or (now - last).total_seconds() > limit
    ]
    if stale:
        out.append(
            Finding(
                CONTROL_FAILING,
                "critical",
                "cluster",
                "attestation",
                f"{len(stale)} node(s) in service have no passing attestation within "
                f"{limit:.0f} s, and the staleness check has not quarantined them",
                (("control", "attestation_freshness"),),
                {
                    "control": "attestation_freshness",
                    "nodes": len(stale),
                    "examples": [
                        {"node": n, "last_pass": last.isoformat() if last else None}
                        for n, last in stale[:MAX_LISTED]
                    ],
                    "threshold_s": limit,
                },
            )
        )
    return out
