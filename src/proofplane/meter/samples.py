"""Telemetry samples: the value type, the agent's wire form, and dcgm-exporter's text format.

A :class:`Sample` is one reading of one field of one device at one time: a whole GPU
(``gi_id`` None) or a MIG instance (``gi_id``: the GPU instance ID NVML and dcgm-exporter's
``GPU_I_ID`` label give, ``profile`` its ``GPU_I_PROFILE``, ``mig_start`` its first memory
slot where the agent knows it: the control plane names MIG instances by profile and start).

The agent posts samples grouped by device and time (``POST /api/v1/nodes/{name}/telemetry``)::

    {"simulated": false,
     "samples": [{"gpu_uuid": "GPU-…", "gi_id": null, "profile": null, "mig_start": null,
                  "ts": "2026-05-01T12:00:00Z",
                  "values": {"DCGM_FI_DEV_POWER_USAGE": 312.5, "DCGM_FI_DEV_GPU_TEMP": 61}}]}

:func:`parse_batch` checks that form (a malformed body is refused: ``invalid_telemetry``; more
than ``max_samples`` values: ``too_many_samples``) and leaves out, counting them by reason, the
readings a well-formed body may still hold that are not kept: a field proofplane does not know
(``unknown_field``: a newer agent), a value outside the field's bounds (``out_of_range``), a
field not valid for a MIG instance (``not_for_mig``), a time too far in the future
(``in_future``) or older than the raw retention (``too_old``). One odd reading never costs a
node its whole batch.

:func:`parse_dcgm_text` reads a dcgm-exporter scrape (the Prometheus text format, through
``prometheus_client``'s own parser) into samples of the known fields.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from proofplane.errors import ValidationFailed
from proofplane.meter.fields import FIELDS, MIG_FIELDS

#: The most readings one request may carry (a node of 8 GPUs with 7 MIG instances each and
#: every field is well under 2,000 per interval: this leaves room for a backlog; 20,000
#: readings in the grouped form fit the API's 1 MiB body limit).
MAX_SAMPLES = 20_000
#: How far ahead of the server's clock a sample's time may be (clock skew).
MAX_SKEW = timedelta(minutes=5)
MAX_UUID = 64  # the gpus.uuid column
MAX_PROFILE = 32
MAX_GI_ID = 1 << 16
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
IGNORE_REASONS = ("unknown_field", "out_of_range", "not_for_mig", "in_future", "too_old")


class Sample(NamedTuple):
    """One reading of one field of one device (a GPU, or a MIG instance of it). A named
    tuple: a batch makes thousands, and a tuple is the cheapest immutable value to make."""

    node: str
    gpu_uuid: str
    gi_id: int | None
    profile: str | None
    field: str
    ts: datetime
    value: float
    mig_start: int | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """What a posted body holds: the samples kept, whether they are simulated, and how many
    readings were left out, by reason."""

    samples: list[Sample]
    simulated: bool = False
    ignored: dict[str, int] = field(default_factory=dict)


def _refuse(message: str, index: int | None = None, **details: Any) -> ValidationFailed:
    if index is not None:
        details = {"index": index, **details}
    return ValidationFailed(message, code="invalid_telemetry", details=details or None)


def _int_or_none(value: Any, name: str, index: int, high: int) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < high:
        raise _refuse(f"samples[{index}].{name} must be null or a whole number 0..{high - 1}",
                      index)  # fmt: skip
    return value


def parse_ts(value: Any) -> datetime:
    """A sample time: ISO 8601 with a UTC offset (``Z`` or ``+00:00``), or Unix seconds."""
    if isinstance(value, str) and 0 < len(value) <= 40:
        try:
            ts = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if ts.tzinfo is not None:
                return ts.astimezone(UTC)
    elif type(value) in (int, float) and math.isfinite(value) and 0 <= value < 1e11:
        return datetime.fromtimestamp(value, UTC)
    raise ValueError("not a time")


class DeviceSample(NamedTuple):
    """One device's readings at one time (a GPU, or a MIG instance of it): what one entry of
    the posted body holds once checked, ``values`` the kept readings by field name. The unit
    the store keeps (one row per device and time) and the issue's "sample"."""

    gpu_uuid: str
    gi_id: int | None
    profile: str | None
    mig_start: int | None
    ts: datetime
    values: dict[str, float]


@dataclass(frozen=True, slots=True)
class DeviceBatch:
    """What a posted body holds, per device: the device samples with readings kept, whether
    they are simulated, how many readings were kept and how many were left out, by reason."""

    devices: list[DeviceSample]
    simulated: bool = False
    ignored: dict[str, int] = field(default_factory=dict)
    readings: int = 0


def parse_batch(
    body: Any,
    *,
    node: str,
    now: datetime,
    oldest: datetime,
    max_samples: int = MAX_SAMPLES,
    max_skew: timedelta = MAX_SKEW,
) -> Batch:
    """The samples of a posted body, one per reading (see the module's docstring for the form
    and what is refused or left out). ``now`` and ``oldest`` bound the sample times."""
    batch = parse_devices(body, now=now, oldest=oldest, max_samples=max_samples,
                          max_skew=max_skew)  # fmt: skip
    out = [
        Sample(node, d.gpu_uuid, d.gi_id, d.profile, name, d.ts, value, d.mig_start)
        for d in batch.devices
        for name, value in d.values.items()
    ]
    return Batch(out, batch.simulated, batch.ignored)


def parse_devices(
    body: Any,
    *,
    now: datetime,
    oldest: datetime,
    max_samples: int = MAX_SAMPLES,
    max_skew: timedelta = MAX_SKEW,
) -> DeviceBatch:
    """The device samples of a posted body (what :func:`parse_batch` checks and leaves out,
    kept grouped as the body groups them: ingest stores one row per device and time). An
    entry none of whose readings is kept is left out."""
    if not isinstance(body, Mapping):
        raise _refuse("the body must be a JSON object with a 'samples' list")
    unknown = set(body) - {"samples", "simulated"}
    if unknown:
        raise _refuse(f"unknown key(s) {sorted(unknown)[:5]}: send 'samples' and 'simulated'")
    simulated = body.get("simulated", False)
    if type(simulated) is not bool:
        raise _refuse("'simulated' must be true or false")
    entries = body.get("samples")
    if not isinstance(entries, list):
        raise _refuse("'samples' must be a list")
    total = 0
    for e in entries:
        values = e.get("values") if type(e) is dict or isinstance(e, Mapping) else None
        total += len(values) if type(values) is dict or isinstance(values, Mapping) else 1
    if total > max_samples:
        raise ValidationFailed(
            f"{total} readings in one request: at most {max_samples}; send smaller batches",
            code="too_many_samples",
            details={"readings": total, "max": max_samples},
        )
    latest = now + max_skew
    ignored: dict[str, int] = {}
    out: list[DeviceSample] = []
    kept_total = 0
    times: dict[Any, datetime] = {}
    checks = _CHECKS
    isfinite = math.isfinite
    keys = _ENTRY_KEYS
    for i, e in enumerate(entries):
        if type(e) is not dict and not isinstance(e, Mapping):
            raise _refuse(f"samples[{i}] must be an object", i)
        if not keys.issuperset(e):
            extra = set(e) - keys
            raise _refuse(f"samples[{i}] has unknown key(s) {sorted(extra)[:5]}", i)
        uuid = e.get("gpu_uuid")
        if not isinstance(uuid, str) or not _UUID.fullmatch(uuid):
            raise _refuse(f"samples[{i}].gpu_uuid must be a GPU UUID (up to {MAX_UUID} "
                          "letters, digits and -_.:)", i)  # fmt: skip
        gi_id = _int_or_none(e.get("gi_id"), "gi_id", i, MAX_GI_ID)
        start = _int_or_none(e.get("mig_start"), "mig_start", i, 64)
        profile = e.get("profile")
        if profile is not None and (
            not isinstance(profile, str) or not 0 < len(profile) <= MAX_PROFILE
            or not profile.isprintable()
        ):  # fmt: skip
            raise _refuse(f"samples[{i}].profile must be null or a MIG profile name", i)
        if gi_id is None and (profile is not None or start is not None):
            raise _refuse(f"samples[{i}]: profile and mig_start describe a MIG instance: "
                          "give its gi_id", i)  # fmt: skip
        raw_ts = e.get("ts")
        try:
            ts = times[raw_ts]
        except KeyError:
            try:
                ts = parse_ts(raw_ts)
            except (ValueError, TypeError, OverflowError):
                raise _refuse(f"samples[{i}].ts must be an ISO 8601 time with a UTC offset "
                              "or Unix seconds", i) from None  # fmt: skip
            if isinstance(raw_ts, str):
                times[raw_ts] = ts
        except TypeError:  # an unhashable ts (a list, an object)
            raise _refuse(f"samples[{i}].ts must be a time", i) from None
        values = e.get("values")
        if type(values) is not dict and not isinstance(values, Mapping):
            raise _refuse(f"samples[{i}].values must be an object of field: number", i)
        late = ts > latest
        old = ts < oldest
        mig = gi_id is not None
        kept: dict[str, float] = {}
        for name, value in values.items():
            kind = type(value)
            if (kind is not float and kind is not int) or not isfinite(value):
                raise _refuse(f"samples[{i}].values[{str(name)[:64]!r}] must be a finite "
                              "number", i)  # fmt: skip
            check = checks.get(name)
            if check is None:
                reason = "unknown_field"
            elif not check[0] <= value <= check[1]:
                reason = "out_of_range"
            elif mig and not check[2]:
                reason = "not_for_mig"
            elif late:
                reason = "in_future"
            elif old:
                reason = "too_old"
            else:
                kept[name] = value if kind is float else float(value)
                continue
            ignored[reason] = ignored.get(reason, 0) + 1
        if kept:
            kept_total += len(kept)
            out.append(DeviceSample(uuid, gi_id, profile, start, ts, kept))
    return DeviceBatch(out, simulated, ignored, kept_total)


_ENTRY_KEYS = frozenset({"gpu_uuid", "gi_id", "profile", "mig_start", "ts", "values"})
#: Per field: its bounds and whether a MIG instance may report it (one lookup per reading).
_CHECKS: Mapping[str, tuple[float, float, bool]] = {
    name: (f.low, f.high, name in MIG_FIELDS) for name, f in FIELDS.items()
}


def to_wire(samples: list[Sample], *, simulated: bool = False) -> dict[str, Any]:
    """Samples in the posted form (grouped by device and time): what the agent sends."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for s in samples:
        key = (s.gpu_uuid, s.gi_id, s.profile, s.mig_start, s.ts)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {
                "gpu_uuid": s.gpu_uuid,
                "gi_id": s.gi_id,
                "profile": s.profile,
                "mig_start": s.mig_start,
                "ts": s.ts.astimezone(UTC).isoformat().replace("+00:00", "Z"),
                "values": {},
            }
        g["values"][s.field] = s.value
    return {"simulated": simulated, "samples": list(groups.values())}


# --- dcgm-exporter's scrape --------------------------------------------------------------------


def _label_int(labels: Mapping[str, str], name: str) -> int | None:
    raw = labels.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) >= MAX_GI_ID:
        raise ValueError(f"label {name}={raw[:32]!r} is not a GPU instance ID")
    return int(raw)


def parse_dcgm_text(
    text: str, *, node: str | None = None, ts: datetime | None = None
) -> list[Sample]:
    """The samples of a dcgm-exporter scrape (Prometheus text format), for the fields
    proofplane keeps (others are skipped). Labels: ``UUID`` the GPU, ``GPU_I_ID`` and
    ``GPU_I_PROFILE`` a MIG instance (a field valid only per GPU is kept once per GPU even
    where the exporter repeats it on each instance's series), ``Hostname`` the node unless
    ``node`` is given. The time is the sample's own timestamp, else ``ts`` (the exporter
    writes none by default: the caller passes when it scraped). ``ValueError`` on text that
    is not the format, or a sample without a GPU, a node or a time."""
    out: list[Sample] = []
    seen: set[tuple[str, int | None, str]] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name not in FIELDS and family.type == "counter" and name.endswith("_total"):
                # the parser names a counter's samples <name>_total (the OpenMetrics rule);
                # dcgm-exporter's counters (energy, ECC) carry no such suffix
                name = name[: -len("_total")]
            if name not in FIELDS:
                continue
            labels = s.labels
            value = float(s.value)
            if not math.isfinite(value):
                continue
            uuid = labels.get("UUID") or labels.get("uuid")
            if not uuid:
                raise ValueError(f"{name}: a sample without a UUID label")
            host = node or labels.get("Hostname")
            if not host:
                raise ValueError(f"{name}: no node (no Hostname label and none given)")
            when = (
                datetime.fromtimestamp(float(s.timestamp), UTC)
                if s.timestamp is not None
                else ts.astimezone(UTC)
                if ts is not None
                else None
            )
            if when is None:
                raise ValueError(f"{name}: a sample without a timestamp and no scrape time")
            gi_id = _label_int(labels, "GPU_I_ID")
            profile = labels.get("GPU_I_PROFILE") or None
            if gi_id is not None and name not in MIG_FIELDS:
                gi_id, profile = None, None  # a whole-GPU field, repeated per instance
            key = (uuid, gi_id, name)
            if key in seen:
                continue
            seen.add(key)
            out.append(Sample(host, uuid, gi_id, profile, name, when, value))
    return out
