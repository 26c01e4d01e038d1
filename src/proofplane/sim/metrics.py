"""The published CSV's discretisation of the ``(arrived, used)`` event log (notes §10)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_RATIO = 130


def numpy_round(x: float, decimals: int = 2) -> float:
    """NumPy's ``round(x, d)`` for a float64: scale, round half to even, unscale."""
    scale = 10.0**decimals
    return round(x * scale) / scale  # round() of a float is half-even on the exact double


def pairwise_sum(values: Sequence[float]) -> float:
    """NumPy's pairwise summation of a contiguous float64 array (what ``np.sum`` and so
    ``pandas.Series.mean`` do): blocks of ≤ 128 with 8 accumulators, halves above that."""
    n = len(values)
    if n < 8:
        res = -0.0
        for v in values:
            res += v
        return res
    if n <= 128:
        r = list(values[:8])
        i = 8
        end = n - n % 8
        while i < end:
            for j in range(8):
                r[j] += values[i + j]
            i += 8
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        while i < n:
            res += values[i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return pairwise_sum(values[:n2]) + pairwise_sum(values[n2:])


def discretise(
    arrived: Sequence[int], used: Sequence[int], total_gpus: int, max_ratio: int = MAX_RATIO
) -> list[float | None]:
    """Column ``r`` (0..max_ratio): mean allocation % of the events whose arrival % rounds to
    ``r`` (falling back to ``r-1..r+1``), rounded like the published CSV; None when empty."""
    by_ratio: dict[int, list[float]] = {}
    for a, u in zip(arrived, used, strict=True):
        r = round(a / total_gpus / 10)
        by_ratio.setdefault(r, []).append(round(u / total_gpus / 10, 2))
    out: list[float | None] = []
    for r in range(max_ratio + 1):
        vals = by_ratio.get(r)
        if not vals:
            vals = by_ratio.get(r - 1, []) + by_ratio.get(r, []) + by_ratio.get(r + 1, [])
        out.append(numpy_round(pairwise_sum(vals) / len(vals)) if vals else None)
    return out
