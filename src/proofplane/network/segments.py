"""Segment pools: VXLAN VNIs and InfiniBand partition keys, allocated lowest-free with a cool-down.

A tenant's traffic is confined by two identifiers: a VXLAN network identifier (RFC 7348: 24
bits) on the Ethernet fabric and a partition key (PKey, 15 bits) on InfiniBand. Both come from
a pool; a released one *cools down* for a while before it may be handed out again, so that a
late packet (a stale FDB entry on a switch, a retransmission in flight, an SM that has not yet
swept) never reaches the next owner of the number.

Pure: the caller passes what is in use, what was released when, and ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta
from typing import Literal, NamedTuple

from proofplane.errors import Conflict, ValidationFailed

__all__ = [
    "DEFAULT_COOLDOWN",
    "DEFAULT_PKEY",
    "PKEY_MAX",
    "PKEY_MIN",
    "PKEY_POOL",
    "VNI_MAX",
    "VNI_MIN",
    "VNI_POOL",
    "InvalidSegment",
    "Pool",
    "SegmentInUse",
    "SegmentKind",
    "SegmentPoolExhausted",
    "check_manual",
    "cooling_ids",
    "format_pkey",
    "next_free",
    "parse_pool",
]

SegmentKind = Literal["vni", "pkey"]

VNI_MIN, VNI_MAX = 1, (1 << 24) - 1  # RFC 7348: a 24-bit VNI (0 is left unused)
PKEY_MIN, PKEY_MAX = 0x0001, 0x7FFE  # 15-bit PKeys; 0x7FFF is the default partition
DEFAULT_PKEY = 0x7FFF  # the default partition: every port is in it, never a tenant's
DEFAULT_COOLDOWN = timedelta(days=30)  # PROOFPLANE_SEGMENT_COOLDOWN_DAYS' default


class SegmentPoolExhausted(Conflict):
    """409: no identifier of the pool is free (all in use or cooling down)."""

    code = "segment_pool_exhausted"


class SegmentInUse(Conflict):
    """409: a manually assigned identifier is held by another segment or still cooling down."""

    code = "segment_in_use"


class InvalidSegment(ValidationFailed):
    """422: an identifier (or a pool range) outside what the pool or the protocol allows."""

    code = "invalid_segment"


class Pool(NamedTuple):
    """An inclusive range of identifiers: ``lo, hi = pool`` works."""

    lo: int
    hi: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.lo <= value <= self.hi

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1


VNI_POOL = Pool(10_000, 16_000_000)
PKEY_POOL = Pool(PKEY_MIN, PKEY_MAX)

_LIMITS: dict[str, Pool] = {"vni": Pool(VNI_MIN, VNI_MAX), "pkey": Pool(PKEY_MIN, PKEY_MAX)}


def format_pkey(pkey: int) -> str:
    """``0x0012``: how OpenSM and ``ibstat`` print a partition key."""
    return f"0x{pkey:04x}"


def _int(text: str, kind: SegmentKind) -> int:
    text = text.strip()
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text, 10)
    except ValueError:
        raise InvalidSegment(
            f"invalid {kind} {text!r}: a decimal or 0x-hexadecimal number",
            details={"kind": kind, "value": text},
        ) from None


def parse_pool(text: str, *, kind: SegmentKind = "vni") -> Pool:
    """``"10000-16000000"`` (or ``"0x0001-0x7ffe"``) as a :class:`Pool`, checked against the
    protocol's range: VNIs 1..16,777,215; PKeys 0x0001..0x7FFE (the default partition 0x7FFF
    is never in a pool)."""
    lo_text, sep, hi_text = str(text).partition("-")
    if not sep:
        raise InvalidSegment(
            f"invalid {kind} pool {text!r}: write LO-HI",
            details={"kind": kind, "pool": text},
        )
    pool = Pool(_int(lo_text, kind), _int(hi_text, kind))
    limit = _LIMITS[kind]
    if not (limit.lo <= pool.lo <= pool.hi <= limit.hi):
        raise InvalidSegment(
            f"invalid {kind} pool {text!r}: LO <= HI within {limit.lo}..{limit.hi}",
            details={"kind": kind, "pool": text, "limit": [limit.lo, limit.hi]},
        )
    return pool


def cooling_ids(
    cooling: Mapping[int, datetime], now: datetime, cooldown: timedelta
) -> frozenset[int]:
    """The identifiers released less than ``cooldown`` before ``now`` (still cooling down)."""
    if cooldown < timedelta(0):
        raise InvalidSegment(
            "the cool-down cannot be negative", details={"cooldown": str(cooldown)}
        )
    return frozenset(i for i, released in cooling.items() if now - released < cooldown)


def next_free(
    lo: int,
    hi: int,
    in_use: AbstractSet[int],
    cooling: Mapping[int, datetime],
    now: datetime,
    cooldown: timedelta = DEFAULT_COOLDOWN,
    *,
    kind: SegmentKind = "vni",
) -> int:
    """The lowest identifier of ``lo..hi`` that is neither in use nor released within
    ``cooldown`` of ``now`` (``cooling``: identifier → when it was released).

    Lowest-free keeps allocation reproducible (the same history gives the same numbers) and
    costs O(k log k) in the k blocked identifiers, not in the size of the pool. Raises
    :class:`SegmentPoolExhausted` when none is left."""
    blocked = sorted(
        {i for i in in_use if lo <= i <= hi} | {i for i in cooling_ids(cooling, now, cooldown)
                                                if lo <= i <= hi}
    )  # fmt: skip
    candidate = lo
    for b in blocked:
        if b > candidate:
            break
        candidate = b + 1
    if candidate > hi:
        raise SegmentPoolExhausted(
            f"the {kind} pool {lo}-{hi} is exhausted: {len(blocked)} in use or cooling down",
            details={"kind": kind, "pool": [lo, hi], "blocked": len(blocked)},
        )
    return candidate


def check_manual(
    value: int,
    lo: int,
    hi: int,
    in_use: AbstractSet[int],
    cooling: Mapping[int, datetime],
    now: datetime,
    cooldown: timedelta = DEFAULT_COOLDOWN,
    *,
    kind: SegmentKind = "vni",
) -> int:
    """A manually assigned identifier, checked: outside ``lo..hi`` (or the default PKey)
    → :class:`InvalidSegment` (422); held by another segment or cooling down →
    :class:`SegmentInUse` (409). Returns ``value``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidSegment(
            f"{kind} {value!r} is outside the pool {lo}-{hi}",
            details={"kind": kind, "value": value, "pool": [lo, hi]},
        )
    if kind == "pkey" and value == DEFAULT_PKEY:
        raise InvalidSegment(
            "PKey 0x7fff is the default partition and never a tenant's",
            details={"kind": kind, "value": value},
        )
    if value in in_use:
        raise SegmentInUse(
            f"{kind} {value} is assigned to another segment",
            details={"kind": kind, "value": value, "reason": "in_use"},
        )
    released = cooling.get(value)
    if released is not None and value in cooling_ids({value: released}, now, cooldown):
        raise SegmentInUse(
            f"{kind} {value} was released at {released.isoformat()} and cools down until "
            f"{(released + cooldown).isoformat()}",
            details={"kind": kind, "value": value, "reason": "cooling",
                     "until": (released + cooldown).isoformat()},
        )  # fmt: skip
    return value
