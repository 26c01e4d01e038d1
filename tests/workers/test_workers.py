"""The background loops' one base (issue 18): start and a prompt stop, the interval, jitter
bounds, error backoff that grows and resets, the last-success facts, a failing pass that never
ends the thread; and the server's loops built on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from proofplane.access import SYSTEM
from proofplane.demo.attester import DEMO_INTERVAL_S, DemoAttester
from proofplane.keys import KmsUnavailable
from proofplane.service.audit import AuditKeys
from proofplane.service.context import Store
from proofplane.service.keys import Kms, kms_for
from proofplane.store import migrate
from proofplane.workers import (
    CheckpointWorker,
    ExportWorker,
    StaleWorker,
    SyncWorker,
    Worker,
    checkpoint_worker,
    started,
)


def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Script:
    """A run_once that fails on the passes named in ``fail`` (1-based) and counts passes."""

    def __init__(self, fail: Collection[int] | Callable[[int], bool] = ()) -> None:
        self.fail = fail
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        failing = self.fail(self.calls) if callable(self.fail) else self.calls in self.fail
        if failing:
            raise RuntimeError(f"pass {self.calls} failed")
        return "ok"


def sleeper(passes: int) -> tuple[list[float], Callable[[float], bool]]:
    """A ``sleep`` that records the delays asked for and ends the loop after ``passes``."""
    delays: list[float] = []

    def sleep(delay: float) -> bool:
        delays.append(delay)
        return len(delays) > passes

    return delays, sleep


# --- the loop, on the calling thread: exact and instant -------------------------------------


def test_the_loop_waits_one_interval_before_each_pass() -> None:
    delays, sleep = sleeper(3)
    w = Worker("w", 2.5, target=Script(), sleep=sleep)
    w.run()
    assert delays == [2.5] * 4  # the fourth wait ends the loop
    assert w.passes == 3 and w.consecutive_failures == 0


def test_run_at_start_runs_a_pass_before_the_first_wait() -> None:
    script = Script()
    seen: list[int] = []

    def sleep(delay: float) -> bool:
        seen.append(script.calls)
        return len(seen) > 2

    Worker("w", 1.0, target=script, sleep=sleep, run_at_start=True).run()
    assert seen == [1, 2, 3]


def test_jitter_stays_within_its_bounds() -> None:
    assert Worker("w", 10.0, target=Script(), jitter=0.2, random=lambda: 0.0).next_delay() == (
        pytest.approx(8.0)
    )
    assert Worker("w", 10.0, target=Script(), jitter=0.2, random=lambda: 1.0).next_delay() == (
        pytest.approx(12.0)
    )
    assert Worker("w", 10.0, target=Script(), jitter=0.2, random=lambda: 0.5).next_delay() == (
        pytest.approx(10.0)
    )
    w = Worker("w", 10.0, target=Script(), jitter=0.2)
    samples = [w.next_delay() for _ in range(2000)]
    assert all(8.0 <= d <= 12.0 for d in samples)
    assert min(samples) < 8.5 and max(samples) > 11.5  # it does spread
    assert Worker("w", 10.0, target=Script()).next_delay() == 10.0  # default: none


def test_error_backoff_grows_to_its_cap_and_resets_after_a_success() -> None:
    delays, sleep = sleeper(8)
    script = Script({1, 2, 3, 4, 5, 6})
    w = Worker("w", 1.0, target=script, sleep=sleep, backoff_cap_s=5.0)
    w.run()
    # before pass 1; after 1, 2, 3, 4, 5, 6 failures; after the success of pass 7, pass 8
    assert delays == [1.0, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 1.0, 1.0]
    assert w.consecutive_failures == 0 and w.last_error is None


def test_without_a_cap_a_failed_pass_retries_at_the_interval() -> None:
    delays, sleep = sleeper(4)
    w = Worker("w", 3.0, target=Script(lambda n: True), sleep=sleep)
    w.run()
    assert delays == [3.0] * 5 and w.consecutive_failures == 4


def test_backoff_and_jitter_combine() -> None:
    w = Worker("w", 1.0, target=Script(), jitter=0.5, backoff_cap_s=100.0, random=lambda: 1.0)
    w.consecutive_failures = 4
    assert w.next_delay() == pytest.approx(8.0 * 1.5)


def test_the_last_success_facts() -> None:
    now = [100.0]
    script = Script({2, 3})
    w = Worker("w", 1.0, target=script, clock=lambda: now[0])
    assert (w.last_success_at, w.last_error, w.consecutive_failures) == (None, None, 0)
    assert w.tick() is True
    assert w.last_success_at == 100.0 and w.last_error is None
    now[0] = 200.0
    assert w.tick() is False and w.tick() is False
    assert w.last_success_at == 100.0  # a failure keeps the time of the last success
    assert w.last_error == "pass 3 failed" and w.consecutive_failures == 2
    now[0] = 300.0
    assert w.tick() is True
    assert (w.last_success_at, w.last_error, w.consecutive_failures) == (300.0, None, 0)
    assert w.passes == 4
    status = w.status()
    assert status["name"] == "w" and status["last_success_at"] == 300.0
    assert status["running"] is False and status["passes"] == 4


def test_a_failing_error_hook_is_contained() -> None:
    class Loud(Worker):
        def on_error(self, exc: Exception) -> None:
            raise ValueError("the hook broke too")

    w = Loud("loud", 1.0, target=Script(lambda n: True))
    assert w.tick() is False and w.consecutive_failures == 1


def test_a_worker_without_a_pass_fails_its_passes() -> None:
    w = Worker("nothing", 1.0)
    assert w.tick() is False and "no run_once" in (w.last_error or "")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval_s": 0},
        {"interval_s": -1},
        {"jitter": 1.0},
        {"jitter": -0.1},
        {"backoff_cap_s": 0.5},
    ],  # fmt: skip
)
def test_settings_are_checked(kwargs: dict[str, float]) -> None:
    args: dict[str, float] = {"interval_s": 1.0, **kwargs}
    with pytest.raises(ValueError):
        Worker("w", **args)  # type: ignore[arg-type]


# --- on its thread ------------------------------------------------------------------------


def test_start_runs_passes_on_a_named_daemon_thread_and_stop_ends_it() -> None:
    names: list[str] = []
    w = Worker("named-loop", 0.005, target=lambda: names.append(threading.current_thread().name))
    assert not w.running
    w.start()
    thread = w._thread
    assert thread is not None and thread.daemon and w.running
    w.start()  # already running: no second thread
    assert w._thread is thread
    until(lambda: len(names) >= 3)
    w.stop()
    assert not w.running and not thread.is_alive()
    assert set(names) == {"named-loop"}
    count = len(names)
    time.sleep(0.03)
    assert len(names) == count  # no pass after stop


def test_a_failing_pass_never_kills_the_thread() -> None:
    script = Script(lambda n: n % 2 == 1)  # every other pass raises
    w = Worker("flaky", 0.002, target=script)
    w.start()
    try:
        until(lambda: script.calls >= 6)
        assert w.running
        until(lambda: w.last_success_at is not None)
    finally:
        w.stop()
    assert w.passes >= 6


def test_stop_is_prompt_even_with_a_long_interval() -> None:
    w = Worker("slow", 3600.0, target=Script())
    w.start()
    started_at = time.monotonic()
    w.stop()
    assert time.monotonic() - started_at < 1.0
    assert not w.running and w.passes == 0


def test_stop_waits_for_a_pass_in_progress_at_most_its_timeout() -> None:
    release = threading.Event()
    entered = threading.Event()

    def long_pass() -> None:
        entered.set()
        release.wait(5)

    w = Worker("busy", 0.001, target=long_pass)
    w.start()
    assert entered.wait(5)
    thread = w._thread
    assert thread is not None
    t0 = time.monotonic()
    w.stop(timeout_s=0.05)
    assert time.monotonic() - t0 < 1.0 and thread.is_alive() and w.stopping
    release.set()
    thread.join(5)
    assert not thread.is_alive()  # the pass finished, then the loop saw the stop


def test_a_worker_restarts_after_stop_and_an_old_thread_stays_stopped() -> None:
    script = Script()
    w = Worker("again", 0.002, target=script)
    w.start()
    first = w._thread
    w.stop()
    w.start()
    try:
        assert w._thread is not first and first is not None and not first.is_alive()
        calls = script.calls
        until(lambda: script.calls > calls)
    finally:
        w.stop()


def test_started_holds_a_worker_for_a_block() -> None:
    w = Worker("held", 3600.0, target=Script())
    with started(w) as running:
        assert running is w and w.running
    assert not w.running
    with started(None) as nothing:
        assert nothing is None


# --- the server's loops are workers ---------------------------------------------------------


def _store(tmp_path: Path) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'pp.db'}")
    migrate.upgrade(store.engine)
    return store


def test_the_server_loops_keep_their_names_and_timing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        stale = StaleWorker(store, interval_s=60, grace=timedelta(minutes=2))
        checkpoints = CheckpointWorker(store, AuditKeys(), 30)
        export = ExportWorker(store, interval_s=5)
        sync = SyncWorker(store, object(), 2)  # type: ignore[arg-type]
        demo = DemoAttester(store, [])
        for w, name, interval in (
            (stale, "attest-stale", 60),
            (checkpoints, "audit-checkpoints", 30),
            (export, "siem-export", 5),
            (sync, "proofplane-execution-sync", 2),
            (demo, "demo-attester", DEMO_INTERVAL_S),
        ):
            assert isinstance(w, Worker)
            assert (w.name, w.interval_s, w.jitter, w.backoff_cap_s) == (name, interval, 0, None)
        assert export.run_at_start and export.stop_timeout_s == 30
        assert not any(w.run_at_start for w in (stale, checkpoints, sync, demo))
        assert sync.stop_timeout_s == 7 and stale.stop_timeout_s == 10
    finally:
        store.dispose()


class _DownKms(Kms):
    def sign(self, session: Any, name: str, message: bytes) -> tuple[int, bytes]:
        raise KmsUnavailable("the HSM does not answer")


def test_the_checkpoint_worker_signs_when_the_log_grew_and_keeps_its_error(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    try:
        kms_for(store)
        w = CheckpointWorker(store, AuditKeys(key_file=tmp_path / "audit.key"), 3600)
        assert w.tick() and w.last_success_at is not None
        assert w.run_once() is None  # the log did not grow since
        with store.write(SYSTEM) as tx:
            tx.record("node.heartbeat", "node", "n1")  # the log grew
        working, store.kms = store.kms, _DownKms(store.kms.backend)
        broken = CheckpointWorker(store, AuditKeys(), 3600)  # the KMS cannot sign
        assert broken.tick() is False
        assert broken.last_error and broken.consecutive_failures == 1
        store.kms = working
        with checkpoint_worker(store, AuditKeys(), None) as none:
            assert none is None
        with checkpoint_worker(store, AuditKeys(key_file=tmp_path / "k2"), 3600) as held:
            assert held is not None and held.running
        assert not held.running
    finally:
        store.dispose()


def test_the_demo_attester_stops_its_real_agents_after_its_loop() -> None:
    order: list[str] = []

    class Real:
        node_class = "c"
        nodes = ()

        def stop(self) -> None:
            order.append("real" if not demo.running else "real-while-running")

    demo = DemoAttester(object(), [], real=Real())  # type: ignore[arg-type]
    demo.start(interval_s=3600)
    assert demo.interval_s == 3600 and demo.running
    demo.stop()
    assert order == ["real"]
