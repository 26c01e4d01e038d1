"""Capacity signatures and buckets: the index best fit walks.

A node's *signature* is its idle GPUs and, per capacity class (``schedule.usage``), how much of
that class is free and how much of that is *warm* (on GPUs already in use). ``Buckets`` files
nodes by class → idle GPUs → (free, warm) → names in sorted order, so the search
(``ClusterSnapshot.place``) can walk the request's class from the fewest idle GPUs up, only
through amounts that can hold the request (see ``schedule.snapshot`` for the bound that makes
the walk stop early).
"""

from __future__ import annotations

import bisect

from proofplane.schedule.usage import (
    CLASS_MIG,
    CLASS_SHARE,
    CLASS_WHOLE,
    ClassKey,
    NodeInfo,
    Usage,
)
from proofplane.schedule.values import FULL_GPU_MILLI, Request

Amounts = tuple[int, int]  # (free, warm): capacity in a class, and the part not on idle GPUs
Signature = tuple[int, dict[ClassKey, Amounts]]  # (idle GPUs, amounts per capacity class)


def signature(info: NodeInfo, u: Usage) -> Signature:
    """Idle GPUs, and per class the capacity a request that allows co-residency, of a tenant
    holding nothing that refuses it, could take (GPUs with a holder refusing co-residency
    count as full); other requests are answered by exact scans (``ClusterSnapshot.place``)."""
    whole, shares, busy, mig = u.whole, u.shares, u.busy, u.mig
    private = u.gpu_private
    idle = 0
    for i in info.indexes:
        if i not in whole and i not in busy and not shares.get(i):
            idle += 1
    caps: dict[ClassKey, tuple[int, int]] = {}
    for i, whole_keys, share_keys in info.plain_keys:
        if i in whole:
            continue
        held = shares.get(i, 0)
        room = FULL_GPU_MILLI - held
        if room >= 1 and not (private and i in private):
            for k in share_keys:
                free, warm = caps.get(k, _NONE)
                if held:
                    caps[k] = (room if room > free else free, room if room > warm else warm)
                elif room > free:
                    caps[k] = (room, warm)
        if not held:
            for k in whole_keys:
                caps[k] = (caps.get(k, _NONE)[0] + 1, 0)
    for i, groups in info.mig_gpus:
        if private and i in private:
            continue
        if i in busy:  # some instance on it is held: count the free ones, all warm
            for ks, slots in groups:
                n = 0
                for slot in slots:
                    if slot not in mig:
                        n += 1
                if n:
                    for k in ks:
                        free, warm = caps.get(k, _NONE)
                        caps[k] = (free + n, warm + n)
        else:  # nothing held on it: every instance is free, none warm
            for ks, slots in groups:
                n = len(slots)
                for k in ks:
                    free, warm = caps.get(k, _NONE)
                    caps[k] = (free + n, warm)
    return idle, caps


_NONE = (0, 0)


class Buckets:
    """Nodes by capacity class → idle GPUs → free amount → names, each list kept sorted."""

    __slots__ = ("classes",)

    def __init__(self) -> None:
        self.classes: dict[ClassKey, dict[int, dict[Amounts, list[str]]]] = {}

    def _add(self, name: str, key: ClassKey, idle: int, free: Amounts) -> None:
        by_free = self.classes.setdefault(key, {}).setdefault(idle, {})
        names = by_free.get(free)
        if names is None:
            by_free[free] = [name]
        else:
            bisect.insort(names, name)

    def _discard(self, name: str, key: ClassKey, idle: int, free: Amounts) -> None:
        levels = self.classes[key]
        by_free = levels[idle]
        names = by_free[free]
        del names[bisect.bisect_left(names, name)]
        if not names:
            del by_free[free]
            if not by_free:
                del levels[idle]
                if not levels:
                    del self.classes[key]

    def move(self, name: str, old: Signature | None, new: Signature | None) -> None:
        if old == new:
            return
        if old is not None and new is not None and old[0] == new[0]:
            idle, before, after = new[0], old[1], new[1]
            for key, free in before.items():
                if after.get(key) != free:
                    self._discard(name, key, idle, free)
            for key, free in after.items():
                if before.get(key) != free:
                    self._add(name, key, idle, free)
            return
        if old is not None:
            for key, free in old[1].items():
                self._discard(name, key, old[0], free)
        if new is not None:
            for key, free in new[1].items():
                self._add(name, key, new[0], free)


def request_class(req: Request) -> tuple[ClassKey, int, int] | None:
    """(capacity class, amount needed in it, most GPUs taken), or None for a degenerate shape
    (count or share below 1), which is answered by an exact scan."""
    g = req.gpus
    if g.mig_profile is not None:
        return ((CLASS_MIG, g.mig_profile, g.model), g.count, g.count) if g.count >= 1 else None
    if g.share_milli is not None:
        return ((CLASS_SHARE, g.model), g.share_milli, 1) if g.share_milli >= 1 else None
    return ((CLASS_WHOLE, g.model), g.count, g.count) if g.count >= 1 else None
