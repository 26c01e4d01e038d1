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
    slack = max(window / 10, timedelta(minutes=1))
    inside = [(ts, v) for ts, v in readings if start <= ts <= now]
    peak = max((v for _, v in inside), default=None)
    n = len(inside)
    if held_since > start:
        return IdleVerdict(False, peak, n, "held for less than the window")
    if not inside:
        return IdleVerdict(False, None, 0, "no readings in the window")
    first = min(ts for ts, _ in inside)
    last = max(ts for ts, _ in inside)
    if first > start + slack or last < now - slack:
        return IdleVerdict(False, peak, n, "the readings do not cover the window")
    assert peak is not None
    if peak >= threshold:
        return IdleVerdict(False, peak, n, f"active: peak {peak:.3f} >= {threshold:g}")
    return IdleVerdict(True, peak, n, f"idle: peak {peak:.3f} < {threshold:g} over {window}")
