"""``submit_workloads`` / ``POST /api/v1/workloads/batch``: many workloads in one transaction.

The batch must write what the same specs submitted one by one write (rows, placements, the
event sequence with preemptions and repartitions; the network bookkeeping aside, which each
transaction does once at its end), refuse everything when one item is bad,
and leave the scheduler cache agreeing with a fresh load."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from dbtest import demo_text
from dbtest import pg_admin as _admin
from dbtest import pg_url as _pg_url
from proofplane.access import SYSTEM
from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import GpuRequest, Workload
from proofplane.service import workloads as workloads_svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.scheduling import ClusterView, scheduler_cache
from proofplane.service.workloads import WorkloadSpec
from proofplane.store import migrate
from proofplane.store.tables import EndpointRow, EventRow, PlacementRow, WorkloadRow

API = "/api/v1"
TENANTS = ("st-marys-hospital", "nordbank", "berlin-telco", "paris-insurance", "research-lab")


def _specs(seed: int, n: int, prefix: str = "b") -> list[WorkloadSpec]:
    """A mix the demo cluster's tenants accept: whole GPUs, MIG (A100 and any), shares, with
    priorities that make later items preempt earlier ones and MIG asks that repartition."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tenant = rng.choice(TENANTS)
        r = rng.random()
        if tenant == "nordbank":
            gpus = GpuRequest(rng.choice([1, 2, 8]))
        elif tenant in ("st-marys-hospital", "berlin-telco") or r < 0.4:
            profile = rng.choice(["1g.10gb", "3g.40gb", "2g.20gb", "1g.20gb"])
            gpus = GpuRequest(rng.choice([1, 1, 2]), "A100-80GB", mig_profile=profile)
        elif r < 0.7:
            gpus = GpuRequest(rng.choice([1, 2, 4, 8]))
        else:
            gpus = GpuRequest(1, share_milli=rng.choice([250, 500]))
        priority = rng.choice([0, 0, 10, 100])
        out.append(WorkloadSpec(f"{prefix}{i:03d}", tenant, gpus=gpus, priority=priority))
    return out


@pytest.fixture
def twin_url(db_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A second fresh database of the same kind as ``db_url``."""
    if db_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'twin.db'}"
        store = Store(url)
        migrate.upgrade(store.engine)
        store.dispose()
        yield url
        return
    template = request.getfixturevalue("pg_template")
    name = f"{db_url.rsplit('/', 1)[1]}_twin"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    yield _pg_url(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _load(url: str) -> Store:
    store = Store(url)
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    return store


def _events(store: Store, after: int = 0) -> list[tuple[Any, ...]]:
    with store.read() as session:
        rows = session.scalars(select(EventRow).where(EventRow.seq > after).order_by(EventRow.seq))
        return [(e.seq, e.action, e.target_type, e.target_id, e.outcome, e.details) for e in rows]


def _decisions(store: Store, after: int = 0) -> list[tuple[Any, ...]]:
    """The events without their sequence numbers and without the network bookkeeping, which
    a transaction writes once at its end (issue 14: one ``network.endpoints`` per tenant and
    transaction, so a batch writes fewer of them than one submission per workload)."""
    return [e[1:] for e in _events(store, after) if not e[1].startswith("network.")]


def _endpoints_follow_placements(store: Store) -> None:
    """Every placed workload has one endpoint per node it holds, on that node; a waiting one
    keeps its endpoints (if it had any) on no node."""
    with store.read() as session:
        placed = {
            w.id: [m["node"] for m in w.placement.members] if w.placement.members
            else [w.placement.node.name]
            for w in session.scalars(select(WorkloadRow)) if w.placement is not None
        }  # fmt: skip
        eps: dict[int, dict[int, str | None]] = {}
        for ep in session.scalars(select(EndpointRow)):
            eps.setdefault(ep.workload_id, {})[ep.member] = ep.node
    for wid, nodes in placed.items():
        assert eps.get(wid) == dict(enumerate(nodes)), wid
    for wid, members in eps.items():
        if wid not in placed:
            assert set(members.values()) == {None}, wid


def _count(store: Store, what: Any) -> int:
    with store.read() as session:
        return session.scalar(select(func.count()).select_from(what)) or 0


def _plain(w: Workload) -> Workload:
    return dataclasses.replace(w, created_at=None, updated_at=None)


def _final(store: Store, specs: list[WorkloadSpec]) -> list[Workload]:
    return [
        _plain(workloads_svc.get_workload(store, SYSTEM, s.name, tenant=s.tenant)) for s in specs
    ]


def _fresh_equals_cache(store: Store) -> None:
    cache = scheduler_cache(store.engine)
    assert cache.scheduler is not None
    with store.read() as session:
        fresh = {k: h.placement for k, h in ClusterView(session).scheduler.held.items()}
    assert {k: h.placement for k, h in cache.scheduler.held.items()} == fresh


def _one_by_one(store: Store, spec: WorkloadSpec) -> None:
    """The reference: ``insert_workload`` (ORM objects, one flush per step) in a transaction of
    its own. (A submit goes the batch's way since issue 20; a cluster file's workloads go
    this one.)"""
    gpus = workloads_svc._check_spec(spec)
    with store.write(SYSTEM) as tx:
        workloads_svc.insert_workload(tx, spec, gpus)


@pytest.mark.parametrize("seed", [2, 5])
def test_a_batch_writes_what_one_by_one_writes(db_url: str, twin_url: str, seed: int) -> None:
    one, many = _load(db_url), _load(twin_url)
    try:
        start = len(_events(one))
        specs = _specs(seed, 60)
        for spec in specs:
            _one_by_one(one, spec)
        out = workloads_svc.submit_workloads(many, SYSTEM, specs)
        events_one, events_many = _decisions(one, start), _decisions(many, start)
        assert events_many == events_one
        actions = {e[0] for e in events_one}
        # the slow paths are exercised, not only the bulk one
        assert {"workload.evict", "node.gpu.repartition", "workload.pending"} <= actions
        # the batch answers each workload as the batch left it
        assert [_plain(w) for w in out] == _final(many, specs) == _final(one, specs)
        assert _count(many, PlacementRow) == _count(one, PlacementRow)
        _fresh_equals_cache(many)
        # and the cache keeps deciding like a fresh load afterwards
        more = _specs(seed + 100, 20, prefix="m")
        workloads_svc.submit_workloads(many, SYSTEM, more)
        for spec in more:
            _one_by_one(one, spec)
        assert _decisions(many, start) == _decisions(one, start)
        _fresh_equals_cache(many)
        _endpoints_follow_placements(one)
        _endpoints_follow_placements(many)
    finally:
        one.dispose()
        many.dispose()


def test_a_plain_batch_answers_with_its_placements(demo: Store) -> None:
    specs = [WorkloadSpec(f"p{i}", "research-lab", gpus=GpuRequest(1)) for i in range(10)]
    out = workloads_svc.submit_workloads(demo, SYSTEM, specs)
    assert all(w.placement is not None for w in out)
    assert [_plain(w) for w in out] == _final(demo, specs)
    _fresh_equals_cache(demo)


def _nothing_written(store: Store, before: int, work: int) -> None:
    assert len(_events(store)) == before
    assert _count(store, WorkloadRow) == work


@pytest.mark.parametrize(
    ("bad", "error", "code"),
    [
        (WorkloadSpec("x", "no-such-tenant"), NotFound, "not_found"),
        (WorkloadSpec("Bad Name!", "research-lab"), ValidationFailed, "invalid_name"),
        (WorkloadSpec("x", "research-lab", gpus=GpuRequest(0)), ValidationFailed, None),
        (WorkloadSpec("ok-0", "research-lab"), Conflict, "duplicate_in_batch"),
        (WorkloadSpec("taken", "research-lab"), Conflict, "conflict"),
        (
            WorkloadSpec("x", "nordbank", gpus=GpuRequest(1, share_milli=500)),
            ValidationFailed,
            "isolation_conflict",
        ),
    ],
)
def test_one_bad_item_refuses_the_batch(
    demo: Store, bad: WorkloadSpec, error: type[Exception], code: str | None
) -> None:
    workloads_svc.submit_workload(demo, SYSTEM, WorkloadSpec("taken", "research-lab"))
    before, work = len(_events(demo)), _count(demo, WorkloadRow)
    specs = [WorkloadSpec(f"ok-{i}", "research-lab") for i in range(3)]
    specs.insert(2, bad)
    with pytest.raises(error) as info:
        workloads_svc.submit_workloads(demo, SYSTEM, specs)
    exc = info.value
    assert exc.message.startswith("items[2]: ") and exc.details["index"] == 2  # type: ignore[attr-defined]
    if code is not None:
        assert exc.code == code  # type: ignore[attr-defined]
    _nothing_written(demo, before, work)
    # a refused batch leaves a usable, correct cache
    workloads_svc.submit_workloads(demo, SYSTEM, [WorkloadSpec("after", "research-lab")])
    _fresh_equals_cache(demo)


def test_the_same_name_in_two_tenants_is_two_workloads(demo: Store) -> None:
    out = workloads_svc.submit_workloads(
        demo,
        SYSTEM,
        [WorkloadSpec("same", "research-lab"), WorkloadSpec("same", "paris-insurance")],
    )
    assert [(w.tenant, w.name) for w in out] == [
        ("research-lab", "same"),
        ("paris-insurance", "same"),
    ]


def test_too_many_items(demo: Store) -> None:
    specs = [WorkloadSpec(f"t{i}", "research-lab") for i in range(workloads_svc.MAX_BATCH + 1)]
    with pytest.raises(ValidationFailed) as info:
        workloads_svc.submit_workloads(demo, SYSTEM, specs)
    assert info.value.code == "batch_too_large"


# --- the API ---------------------------------------------------------------------------------


def _item(name: str, tenant: str = "research-lab", **extra: Any) -> dict[str, Any]:
    return {"name": name, "tenant": tenant, "gpus": {"count": 1}, **extra}


@pytest.fixture
def api(client: TestClient) -> TestClient:
    return client


def test_api_batch(api: TestClient, store: Store) -> None:
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    r = api.post(f"{API}/workloads/batch", json={"items": [_item("a"), _item("batch")]})
    assert r.status_code == 201, r.text
    items = r.json()["items"]
    assert [w["name"] for w in items] == ["a", "batch"]
    assert all(w["status"] == "placed" and w["placement"] for w in items)
    # a workload called "batch" is still read at its own path
    assert api.get(f"{API}/workloads/batch").json()["name"] == "batch"
    before = len(_events(store))
    r = api.post(f"{API}/workloads/batch", json={"items": [_item("c"), _item("d", "ghost")]})
    assert r.status_code == 404 and r.json()["error"]["details"]["index"] == 1
    assert r.json()["error"]["message"] == "items[1]: tenant 'ghost' not found"
    r = api.post(f"{API}/workloads/batch", json={"items": [_item("e"), _item("e")]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_in_batch"
    r = api.post(f"{API}/workloads/batch", json={"items": [_item(f"n{i}") for i in range(1001)]})
    assert r.status_code == 422
    assert api.post(f"{API}/workloads/batch", json={"items": []}).status_code == 422
    assert len(_events(store)) == before


def _grouped(
    store: Store,
    items: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    apply: str = "_submit_in_group",
    send: Callable[[Store, Any], Any] = lambda store, spec: workloads_svc.submit_workload(
        store, SYSTEM, spec
    ),
) -> tuple[list[Any], list[list[str]]]:
    """``send`` ``items[0]``, hold it under the write lock (in ``workloads_svc.<apply>``) until
    every other item is queued behind it (in order), then let them go: each one's answer (or
    its ``Conflict``/``InvalidState``), and the workloads each write transaction applied."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    inner = getattr(workloads_svc, apply)
    groups: list[list[Any]] = []
    queued = threading.Event()

    def name(item: Any) -> str:
        return str(item[0] if isinstance(item[0], str) else item[0].name)

    def held(tx: Any, item: Any) -> Any:
        if not groups or groups[-1][0] is not tx:
            groups.append([tx])
        groups[-1].append(name(item))
        if len(groups) == 1:
            assert queued.wait(10)  # the others queue meanwhile
        return inner(tx, item)

    monkeypatch.setattr(workloads_svc, apply, held)
    # a run of one actor's writes is applied at once
    many = {"_submit_in_group": "_submit_many", "_cancel_in_group": "_cancel_many"}[apply]
    inner_many = getattr(workloads_svc, many)

    def held_many(tx: Any, run: list[Any]) -> Any:
        noted = sum(map(len, groups))
        out = inner_many(tx, run)  # refused: each is applied alone, and noted then
        if sum(map(len, groups)) == noted:  # applied at once (one at a time notes itself)
            if not groups or groups[-1][0] is not tx:
                groups.append([tx])
            groups[-1].extend(name(item) for item in run)
        return out

    monkeypatch.setattr(workloads_svc, many, held_many)

    def answer(item: Any) -> Any:
        try:
            return send(store, item)
        except (Conflict, InvalidState) as exc:
            return exc

    with ThreadPoolExecutor(len(items)) as pool:
        first = pool.submit(answer, items[0])
        while not groups:
            threading.Event().wait(0.01)
        rest = []
        group = store._groups[held]
        for item in items[1:]:  # queued one after another: taken in this order
            rest.append(pool.submit(answer, item))
            while len(group.queue) < len(rest):
                threading.Event().wait(0.005)
        queued.set()
        out = [first.result(), *(f.result() for f in rest)]
    return out, [g[1:] for g in groups]


def test_submits_sent_together_commit_together_and_decide_as_one_by_one(
    db_url: str, twin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit (``Store.write_grouped``): submits that wait while one holds the write lock
    are placed in one transaction after it, through one view; they decide what the same
    submits one by one decide, in the order they were taken, and the cache still agrees with
    a fresh load. A submit refused in the group (its name taken) is refused alone; the group
    commits the others."""
    one, many = _load(db_url), _load(twin_url)
    try:
        start = len(_events(one))
        specs = _specs(7, 12)
        specs.insert(7, dataclasses.replace(specs[3], gpus=GpuRequest(1)))  # its name is taken
        out, groups = _grouped(many, specs, monkeypatch)
        assert [isinstance(w, Conflict) for w in out] == [i == 7 for i in range(len(specs))]
        # the first alone; the rest as one group: the refused one (a check, before it wrote
        # anything) fails alone and the group commits the others
        names = [s.name for s in specs]
        assert groups == [names[:1], names[1:]]
        for spec in specs:
            if spec is specs[7]:
                with pytest.raises(Conflict):
                    workloads_svc.submit_workload(one, SYSTEM, spec)
            else:
                workloads_svc.submit_workload(one, SYSTEM, spec)
        placed = specs[:7] + specs[8:]
        assert _decisions(many, start) == _decisions(one, start)
        assert [_plain(w) for w in out[:7] + out[8:]] == _final(many, placed) == _final(one, placed)
        _fresh_equals_cache(many)
        _endpoints_follow_placements(many)
    finally:
        one.dispose()
        many.dispose()


def test_submits_grouped_without_a_refusal_share_one_transaction(
    db_url: str, twin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, many = _load(db_url), _load(twin_url)
    try:
        start = len(_events(one))
        specs = _specs(11, 10)
        loads = scheduler_cache(many.engine).loads
        out, groups = _grouped(many, specs, monkeypatch)
        assert [len(g) for g in groups] == [1, len(specs) - 1]
        # the group's submits after the first placed through its view: no cluster load
        assert scheduler_cache(many.engine).loads - loads <= 1
        for spec in specs:
            workloads_svc.submit_workload(one, SYSTEM, spec)
        assert _decisions(many, start) == _decisions(one, start)
        assert [_plain(w) for w in out] == _final(many, specs) == _final(one, specs)
        _fresh_equals_cache(many)
    finally:
        one.dispose()
        many.dispose()


def _submitted_to_both(one: Store, many: Store, seed: int) -> tuple[list[Any], int, dict[str, Any]]:
    """40 specs (more than the demo cluster holds: some wait) submitted to both stores one by
    one: the specs, the events before what follows, and each workload as ``one`` has it."""
    specs = _specs(seed, 40)
    for store in (one, many):
        for spec in specs:
            workloads_svc.submit_workload(store, SYSTEM, spec)
    return specs, len(_events(one)), {w.name: w for w in _final(one, specs)}


def test_cancels_sent_together_commit_together_and_decide_as_one_by_one(
    db_url: str, twin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancels grouped (``_cancel_in_group``): the capacity each frees is offered to pending
    work through the group's one view, with the same decisions as one cancel at a time; a
    cancel refused in the group (already cancelled) is refused alone and the group commits
    the others; the cache agrees with a fresh load afterwards."""
    one, many = _load(db_url), _load(twin_url)
    try:
        specs, start, final = _submitted_to_both(one, many, 13)
        placed = [s for s in specs if final[s.name].placement is not None]
        assert any(final[s.name].placement is None for s in specs)  # pending work to offer to
        targets = [(s.name, s.tenant) for s in placed[:8]]
        targets.insert(5, targets[2])  # cancelled twice: the second is refused

        def cancel(store: Store, target: tuple[str, str]) -> Any:
            return workloads_svc.cancel_workload(store, SYSTEM, target[0], tenant=target[1])

        loads = scheduler_cache(many.engine).loads
        out, groups = _grouped(many, targets, monkeypatch, "_cancel_in_group", cancel)
        assert [isinstance(w, InvalidState) for w in out] == [i == 5 for i in range(len(out))]
        names = [t[0] for t in targets]
        assert groups == [names[:1], names[1:]]  # the refused one alone, the group goes on
        for i, target in enumerate(targets):
            if i == 5:
                with pytest.raises(InvalidState):
                    cancel(one, target)
            else:
                cancel(one, target)
        assert _decisions(many, start) == _decisions(one, start)
        assert {"workload.cancel", "workload.place"} <= {e[0] for e in _decisions(one, start)}
        assert _final(many, specs) == _final(one, specs)
        _fresh_equals_cache(many)
        _endpoints_follow_placements(many)
        assert scheduler_cache(many.engine).loads - loads <= 1
    finally:
        one.dispose()
        many.dispose()


@pytest.mark.parametrize("with_pending", [False, True])
def test_a_run_of_cancels_decides_as_the_run_one_at_a_time(
    db_url: str, twin_url: str, monkeypatch: pytest.MonkeyPatch, with_pending: bool
) -> None:
    """A run of one actor's cancels applied at once (``_cancel_many``) gives the events,
    decisions and final state that the same group gives cancelling one at a time
    (``_cancel_in_group`` for each), pending work offered the capacity after each release;
    with pending workloads' cancels among placed ones' (whose release may place them first,
    one at a time), as well."""
    one, many = _load(db_url), _load(twin_url)
    try:
        specs, start, final = _submitted_to_both(one, many, 17)
        placed = [(s.name, s.tenant) for s in specs if final[s.name].placement is not None]
        waiting = [(s.name, s.tenant) for s in specs if final[s.name].placement is None]
        assert waiting  # pending work to offer to
        targets = placed[:6]
        if with_pending:
            targets[2:2] = waiting[:3]

        def cancel(store: Store, target: tuple[str, str]) -> Any:
            return workloads_svc.cancel_workload(store, SYSTEM, target[0], tenant=target[1])

        names = [t[0] for t in targets]
        with monkeypatch.context() as alone:
            alone.setattr(
                workloads_svc,
                "_cancel_many",
                lambda tx, run: [workloads_svc._cancel_in_group(tx, item) for item in run],
            )
            _, groups = _grouped(one, targets, alone, "_cancel_in_group", cancel)
        out, groups_many = _grouped(many, targets, monkeypatch, "_cancel_in_group", cancel)
        assert not [w for w in out if isinstance(w, Exception)]
        assert groups == groups_many == [names[:1], names[1:]]  # the rest in one transaction
        assert _decisions(many, start) == _decisions(one, start)
        assert {"workload.cancel", "workload.place"} <= {e[0] for e in _decisions(one, start)}
        assert _final(many, specs) == _final(one, specs)
        _fresh_equals_cache(many)
        _endpoints_follow_placements(many)
    finally:
        one.dispose()
        many.dispose()
