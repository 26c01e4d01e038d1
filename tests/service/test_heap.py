"""service.heap (issue 20): a serving worker's garbage collector is frozen after startup and
collects its youngest generation less often; a test's process keeps Python's defaults."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from proofplane.api.app import create_app
from proofplane.service import heap
from proofplane.service.context import Store
from proofplane.store import migrate


@pytest.fixture
def restored() -> Iterator[None]:
    """Whatever a test does to this process's collector is undone after it."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.usefixtures("restored")
def test_settle_freezes_what_is_alive_and_raises_the_first_threshold() -> None:
    kept = _Cycle()  # alive at the time: frozen
    gen1, gen2 = gc.get_threshold()[1:]
    frozen = heap.settle(5_000)
    assert frozen > 0 and gc.get_freeze_count() > 0  # (a frozen object freed leaves the count)
    assert gc.get_threshold() == (5_000, gen1, gen2)
    made = _Cycle()  # the collector still runs: a cycle made after settling is collected
    made_id = id(made)
    del made
    gc.collect()
    assert all(id(o) != made_id for o in gc.get_objects() if isinstance(o, _Cycle))
    assert kept.me is kept


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'h.db'}")
    migrate.upgrade(s.engine)
    return s


@pytest.mark.usefixtures("restored")
@pytest.mark.parametrize("settle", [True, False])
def test_a_served_application_settles_its_heap_once_started(store: Store, settle: bool) -> None:
    threshold = gc.get_threshold()
    app = create_app(store, settle_heap=settle)
    assert gc.get_freeze_count() == 0  # building it settles nothing
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 200
        if settle:
            assert gc.get_freeze_count() > 0
            assert gc.get_threshold()[0] == heap.GEN0_THRESHOLD
        else:
            assert gc.get_freeze_count() == 0
            assert gc.get_threshold() == threshold
    store.dispose()
