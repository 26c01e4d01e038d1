"""The hot read routes (issue 20) render from rows straight to JSON: the bytes they answer are
exactly those the response models would have written (FastAPI's validate-then-dump path over
the ORM-loaded values), a list costs a fixed number of queries whatever its length, and
keyset pages neither skip nor repeat when rows are added between them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from pydantic_core import to_json
from sqlalchemy import event, select

from proofplane.access import SYSTEM
from proofplane.api.schemas import (
    EventOut,
    NodeOut,
    Page,
    WorkloadOut,
    event_json,
)
from proofplane.model import Event, Outcome, Tenant
from proofplane.service import tenants as tenants_svc
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.service.workloads import WorkloadSpec, list_workloads, submit_workload
from proofplane.store.repo import NODE_LOAD, WORKLOAD_LOAD, node_from_row, workload_from_row
from proofplane.store.tables import EventRow, NodeRow, TenantRow, WorkloadRow

API = "/api/v1"


def _dump(model: type, value: object) -> bytes:
    return TypeAdapter(model).dump_json(value)


def _reference_nodes(store: Store) -> list[NodeOut]:
    with store.read() as s:
        rows = s.scalars(select(NodeRow).options(*NODE_LOAD).order_by(NodeRow.name))
        return [NodeOut.of(node_from_row(r)) for r in rows]


def _reference_workloads(store: Store) -> list[WorkloadOut]:
    with store.read() as s:
        rows = s.scalars(
            select(WorkloadRow)
            .options(*WORKLOAD_LOAD)
            .join(TenantRow)
            .order_by(WorkloadRow.name, TenantRow.name)
        )
        return [WorkloadOut.of(workload_from_row(r)) for r in rows]


def test_nodes_answer_the_bytes_the_model_would(demo: Store, client: TestClient) -> None:
    nodes = _reference_nodes(demo)
    assert len(nodes) == 24
    r = client.get(f"{API}/nodes?limit=100")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.content == _dump(Page[NodeOut], Page[NodeOut](items=nodes, next=None))
    r = client.get(f"{API}/nodes?limit=5")
    page = Page[NodeOut](items=nodes[:5], next=r.json()["next"])
    assert page.next is not None
    assert r.content == _dump(Page[NodeOut], page)
    for n in nodes[:3]:
        r = client.get(f"{API}/nodes/{n.name}")
        assert r.content == _dump(NodeOut, n)
    assert client.get(f"{API}/nodes/nope").json()["error"]["code"] == "not_found"


def test_workloads_answer_the_bytes_the_model_would(demo: Store, client: TestClient) -> None:
    submit_workload(demo, SYSTEM, WorkloadSpec(name="fast-1", tenant="research-lab"))
    workloads = _reference_workloads(demo)
    assert len(workloads) > 5
    assert any(w.placement is not None for w in workloads)
    r = client.get(f"{API}/workloads?limit=500")
    assert r.content == _dump(Page[WorkloadOut], Page[WorkloadOut](items=workloads, next=None))
    w = workloads[0]
    r = client.get(f"{API}/workloads/{w.name}", params={"tenant": w.tenant})
    assert r.content == _dump(WorkloadOut, w)


def test_events_answer_the_bytes_the_model_would(demo: Store, client: TestClient) -> None:
    with demo.read() as s:
        rows = list(s.scalars(select(EventRow).order_by(EventRow.seq).limit(50)))
        events = [EventOut.of(event_from_row(r)) for r in rows]
    r = client.get(f"{API}/events?limit=50")
    body = r.json()
    assert body["next"] is not None
    expected = _dump(Page[EventOut], Page[EventOut](items=events, next=body["next"]))
    assert r.content == expected
    r = client.get(f"{API}/events/{events[3].seq}")
    assert r.content == _dump(EventOut, events[3])


def test_odd_values_serialize_as_the_model_does() -> None:
    """Text of every kind, nested details, times with and without microseconds."""
    strings = ["", 'a"b\\c', "\x00\x01\x1f\x7f", "\u2028\u2029", "é€😀", "\ud7ff", "</script>"]
    for i, text in enumerate(strings):
        e = Event(
            seq=2**62 + i,
            ts=datetime(2026, 1, 2, 3, 4, 5, i * 1000, tzinfo=UTC),
            actor=text,
            action="x.y",
            target_type="node",
            target_id=text,
            outcome=Outcome.DENIED,
            details={text: [text, 1, -(2**40), 1.5, True, None, {"k": text}]},
        )
        assert to_json(event_json(e)) == _dump(EventOut, EventOut.of(e))


def _count_queries(store: Store) -> Iterator[list[str]]:
    seen: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", count)


counted = contextmanager(_count_queries)


def test_a_list_costs_the_same_queries_whatever_its_length(demo: Store, client: TestClient) -> None:
    client.get(f"{API}/nodes?limit=1")  # the token check is cached from here
    client.get(f"{API}/nodes?limit=1")
    costs = {}
    for path in ("nodes?limit=1", "nodes?limit=100", "workloads?limit=1", "workloads?limit=100",
                 "events?limit=1", "events?limit=100"):  # fmt: skip
        with counted(demo) as sql:
            assert client.get(f"{API}/{path}").status_code == 200
        costs[path] = len(sql)
    assert costs["nodes?limit=1"] == costs["nodes?limit=100"] == 3
    assert costs["workloads?limit=1"] == costs["workloads?limit=100"] == 1
    assert costs["events?limit=1"] == costs["events?limit=100"] == 1


def test_workload_pages_are_keyed_by_name_and_tenant(demo: Store) -> None:
    """The same name in two tenants, pages of one, a workload added between pages: every
    workload exactly once, none skipped."""
    tenants_svc.create_tenant(demo, SYSTEM, Tenant("other-lab"))
    for tenant in ("research-lab", "other-lab"):
        submit_workload(demo, SYSTEM, WorkloadSpec(name="same-name", tenant=tenant))
    seen: list[tuple[str, str]] = []
    cursor = None
    added = False
    while True:
        page = list_workloads(demo, SYSTEM, limit=1, cursor=cursor)
        seen += [(w.name, w.tenant) for w in page.items]
        if seen[-1][0] == "same-name" and not added:
            # added behind the cursor and ahead of it
            submit_workload(demo, SYSTEM, WorkloadSpec(name="aaa-early", tenant="other-lab"))
            submit_workload(demo, SYSTEM, WorkloadSpec(name="zzz-late", tenant="other-lab"))
            added = True
        if page.next is None:
            break
        cursor = page.next
    assert len(seen) == len(set(seen))
    assert ("same-name", "other-lab") in seen and ("same-name", "research-lab") in seen
    assert ("zzz-late", "other-lab") in seen  # ahead of the cursor: listed
    assert seen == sorted(seen)
    everything = {(w.name, w.tenant) for w in list_workloads(demo, SYSTEM, limit=500).items}
    assert everything - set(seen) == {("aaa-early", "other-lab")}  # behind it: next walk
