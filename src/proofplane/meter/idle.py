"""Idle detection: a device a workload holds is idle when the highest
``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` it reported over a window stays below a threshold
(defaults: 30 minutes, 0.05), as Run:ai's "idle GPU time limit" does.

Missing readings are not idleness: a window counts only when it is covered, that is the
workload held the device for the whole window and readings exist near both of its ends
(within a tenth of the window, at least a minute): a silent agent never gets work reclaimed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

WINDOW = timedelta(minutes=30)
THRESHOLD = 0.05


@dataclass(frozen=True, slots=True)
class IdleVerdict:
    """Whether the window shows the workload idle, and what it saw."""

    idle: bool
    peak: float | None  # the highest reading in the window (None: no reading)
    readings: int
    why: str


def judge(
    readings: Iterable[tuple[datetime, float]],
    *,
    now: datetime,
    held_since: datetime,
    window: timedelta = WINDOW,
    threshold: float = THRESHOLD,
) -> IdleVerdict:
    """Judge the workload's utilisation readings (time, ratio 0..1) over ``[now - window,
    now]``; readings outside the window are ignored."""
    start = now - window
    inside = [(ts, v) for ts, v in readings if start <= ts <= now]
    if not inside:
        return judge_summary(None, now=now, held_since=held_since, window=window,
                             threshold=threshold)  # fmt: skip
    summary = (min(ts for ts, _ in inside), max(ts for ts, _ in inside),
               max(v for _, v in inside), len(inside))  # fmt: skip
    return judge_summary(summary, now=now, held_since=held_since, window=window,
                         threshold=threshold)  # fmt: skip


def judge_summary(
    summary: tuple[datetime, datetime, float, int] | None,
    *,
    now: datetime,
    held_since: datetime,
    window: timedelta = WINDOW,
    threshold: float = THRESHOLD,
) -> IdleVerdict:
    """``judge`` from the window's readings summed up: (first time, last time, peak, count),
    or None without readings (what a database aggregate answers)."""
    start = now - window
    slack = max(window / 10, timedelta(minutes=1))
    peak = summary[2] if summary is not None else None
    n = summary[3] if summary is not None else 0
    if held_since > start:
        return IdleVerdict(False, peak, n, "held for less than the window")
    if summary is None or n == 0:
        return IdleVerdict(False, None, 0, "no readings in the window")
    first, last = summary[0], summary[1]
    if first > start + slack or last < now - slack:
        return IdleVerdict(False, peak, n, "the readings do not cover the window")
    assert peak is not None
    if peak >= threshold:
        return IdleVerdict(False, peak, n, f"active: peak {peak:.3f} >= {threshold:g}")
    return IdleVerdict(True, peak, n, f"idle: peak {peak:.3f} < {threshold:g} over {window}")
