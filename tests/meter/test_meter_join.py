"""Metering the log in consecutive ranges and joining them (meter.usage.join_ranges) adds up to
exactly what one meter over the whole log in order adds up: for any stream of placements and
releases, with namesakes across tenants, placements again without a release, double releases,
releases of holds placed before the window, and cuts at any events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.meter.usage import (
    PLACE_ACTION,
    RELEASE_ACTIONS,
    Meter,
    Metered,
    RangePart,
    join_ranges,
    micros,
)

START = datetime(2026, 1, 1, tzinfo=UTC)
END = START + timedelta(hours=40)
CUT = START + timedelta(hours=17)
MODELS = {"GPU-a": "H100-80GB", "GPU-b": "A100-80GB"}
TENANTS = ("acme", "beta")
NAMES = ("train", "infer", "eval")
NODES = ("n1", "n2")

Event = tuple[Any, ...]


def place(t: datetime, name: str, tenant: str, node: str, uuid: str, n: int) -> Event:
    return (PLACE_ACTION, t, name, tenant, node, None, None, None, n, uuid, None, None)


def release(t: datetime, name: str, tenant: str | None, node: str | None, action: str) -> Event:
    return (action, t, name, tenant, node, None, None, None, None, None, None, None)


@st.composite
def streams(draw: st.DrawFn, tenantless: bool = False) -> list[Event]:
    """Events every 30 min from 2 h before the window, in log order."""
    count = draw(st.integers(min_value=0, max_value=60))
    events: list[Event] = []
    t = START - timedelta(hours=2)
    for _ in range(count):
        t += timedelta(minutes=draw(st.integers(min_value=0, max_value=60)))
        name = draw(st.sampled_from(NAMES))
        tenant = draw(st.sampled_from(TENANTS))
        node = draw(st.sampled_from(NODES))
        if draw(st.booleans()):
            uuid = draw(st.sampled_from(sorted(MODELS)))
            events.append(place(t, name, tenant, node, uuid, draw(st.integers(1, 8))))
        else:
            who = None if tenantless and draw(st.integers(0, 4)) == 0 else tenant
            action = draw(st.sampled_from(RELEASE_ACTIONS))
            events.append(release(t, name, who, node, action))
    return events


def one_pass(events: list[Event], tracked: frozenset[tuple[str, str]]) -> Metered:
    meter = Meter(START, END, MODELS, cuts=(CUT,), tracked=tracked)
    meter.feed(events)
    return meter.finish()


def in_ranges(
    events: list[Event], edges: list[int], tracked: frozenset[tuple[str, str]]
) -> tuple[Metered | None, list[tuple[int, str, str]]]:
    bounds = [0, *sorted(edges), len(events)]
    ranges = [events[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    parts: list[RangePart] = []
    for chunk in ranges:
        meter = Meter(START, END, MODELS, cuts=(CUT,), tracked=tracked, ranged=True)
        meter.feed(chunk)
        parts.append(meter.hand_over())
    asked: list[tuple[int, str, str]] = []

    def first_event(j: int, tenant: str, name: str) -> int | None:
        asked.append((j, tenant, name))
        for e in ranges[j]:
            if e[2] == name and e[3] == tenant:
                return micros(e[1])
        return None

    joiner = Meter(START, END, MODELS, cuts=(CUT,), tracked=tracked)
    return join_ranges(joiner, parts, first_event), asked


@settings(max_examples=300, deadline=None)
@given(
    events=streams(),
    edges=st.lists(st.integers(min_value=0, max_value=60), max_size=4),
    track=st.booleans(),
)
def test_ranges_joined_add_up_to_one_pass(
    events: list[Event], edges: list[int], track: bool
) -> None:
    edges = [min(e, len(events)) for e in edges]
    tracked = frozenset({("acme", "train"), ("beta", "train")}) if track else frozenset()
    whole = one_pass(events, tracked)
    joined, _asked = in_ranges(events, edges, tracked)
    assert joined is not None  # no release without a tenant: always joinable
    assert joined.usage == whole.usage
    assert joined.tracked == whole.tracked
    assert joined.events == whole.events == len(events)


@settings(max_examples=300, deadline=None)
@given(events=streams(tenantless=True), edges=st.lists(st.integers(0, 60), max_size=3))
def test_a_release_without_tenant_joins_or_says_it_cannot(
    events: list[Event], edges: list[int]
) -> None:
    edges = [min(e, len(events)) for e in edges]
    whole = one_pass(events, frozenset())
    joined, _asked = in_ranges(events, edges, frozenset())
    if joined is not None:
        assert joined.usage == whole.usage
        assert joined.releases_matched_by_name == whole.releases_matched_by_name
    else:  # only when such a release meets a hold from an earlier range of its name
        assert any(e[3] is None for e in events)


def test_a_hold_across_ranges_ends_at_the_next_ranges_release() -> None:
    t = START + timedelta(hours=1)
    events = [
        place(t, "train", "acme", "n1", "GPU-a", 2),
        release(t + timedelta(hours=3), "train", "acme", "n1", "workload.succeeded"),
    ]
    joined, asked = in_ranges(events, [1], frozenset())
    assert joined is not None
    ((_seg, key), units), *rest = sorted(joined.usage.items())
    assert not rest and key.tenant == "acme" and key.sku == "H100-80GB"
    assert units == 2 * 3 * 3_600_000_000  # 2 GPUs for 3 hours, in GPU-microseconds
    assert asked == []  # the orphan release said it: no lookup


def test_a_hold_placed_again_in_the_next_range_is_looked_up() -> None:
    t = START + timedelta(hours=1)
    events = [
        place(t, "train", "acme", "n1", "GPU-a", 1),
        place(t + timedelta(hours=2), "train", "acme", "n2", "GPU-a", 1),  # again, no release
        release(t + timedelta(hours=3), "train", "acme", "n2", "workload.succeeded"),
        release(t + timedelta(hours=4), "train", "acme", "n2", "workload.succeeded"),
    ]
    joined, asked = in_ranges(events, [1], frozenset())
    assert joined is not None and asked == [(1, "acme", "train")]
    assert sum(joined.usage.values()) == 3 * 3_600_000_000  # 2 h, then 1 h
    assert joined.usage == one_pass(events, frozenset()).usage


def test_a_release_without_tenant_meeting_an_earlier_ranges_hold_is_not_joined() -> None:
    t = START + timedelta(hours=1)
    events = [
        place(t, "train", "acme", "n1", "GPU-a", 1),
        release(t + timedelta(hours=2), "train", None, "n1", "workload.cancel"),
    ]
    joined, _asked = in_ranges(events, [1], frozenset())
    assert joined is None
    whole = one_pass(events, frozenset())
    assert whole.releases_matched_by_name == 1 and sum(whole.usage.values()) == 7_200_000_000
