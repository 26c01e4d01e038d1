"""service.instruments (issue 15, §3): counters of recorded facts count only what committed;
labels stay bounded; the KMS counts its operations."""

from __future__ import annotations

from pathlib import Path

import pytest

from proofplane.access import SYSTEM
from proofplane.service import instruments
from proofplane.service.context import Store
from proofplane.store import migrate


def value(name: str, labels: dict[str, str]) -> float:
    return instruments.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'i.db'}")
    migrate.upgrade(s.engine)
    return s


def test_on_commit_counts_only_committed_facts(sqlite_store: Store) -> None:
    labels = {"verdict": "fail", "reason": "pcr_mismatch"}
    before = value("proofplane_attestation_verdicts_total", labels)
    with pytest.raises(RuntimeError), sqlite_store.write(SYSTEM) as tx:
        instruments.on_commit(
            tx.session, lambda: instruments.count_verdict(False, ["pcr_mismatch"])
        )
        tx.record("test.fact", "cluster", "c")
        raise RuntimeError("rolled back")
    assert value("proofplane_attestation_verdicts_total", labels) == before
    with sqlite_store.write(SYSTEM) as tx:
        instruments.on_commit(
            tx.session, lambda: instruments.count_verdict(False, ["pcr_mismatch"])
        )
        tx.record("test.fact", "cluster", "c")
    assert value("proofplane_attestation_verdicts_total", labels) == before + 1


def test_verdict_and_method_labels_are_bounded() -> None:
    ok = {"verdict": "pass", "reason": "none"}
    before = value("proofplane_attestation_verdicts_total", ok)
    instruments.count_verdict(True, ["ignored"])
    assert value("proofplane_attestation_verdicts_total", ok) == before + 1
    dup = {"verdict": "fail", "reason": "nonce_replayed"}
    before = value("proofplane_attestation_verdicts_total", dup)
    instruments.count_verdict(False, ["nonce_replayed", "nonce_replayed"])
    assert value("proofplane_attestation_verdicts_total", dup) == before + 1
    assert instruments.method_label("GET") == "GET"
    assert instruments.method_label("PROPFIND") == instruments.method_label("x") == "OTHER"


def test_kms_operations_are_counted(sqlite_store: Store) -> None:
    from proofplane.service import keys as keys_svc

    kms = keys_svc.kms_for(sqlite_store)
    labels = {"backend": kms.backend.kind, "key": "secrets", "operation": "encrypt",
              "outcome": "success"}  # fmt: skip
    before = value("proofplane_kms_operations_total", labels)
    with sqlite_store.write(SYSTEM) as tx:
        sealed = keys_svc.seal_secret(kms, tx, "s3cret", b"aad")
    assert value("proofplane_kms_operations_total", labels) == before + 1
    failed = {**labels, "operation": "decrypt", "outcome": "failure"}
    before = value("proofplane_kms_operations_total", failed)
    with sqlite_store.read() as session, pytest.raises(Exception):  # noqa: B017
        keys_svc.open_secret(kms, session, sealed, b"other aad")
    assert value("proofplane_kms_operations_total", failed) == before + 1


def _lag_count(le: str) -> float:
    return value("proofplane_event_loop_lag_seconds_bucket", {"loop": "http", "le": le})


def test_the_loop_lag_probe_sees_a_loop_held_by_blocking_work() -> None:
    import asyncio
    import time

    async def run() -> None:
        probe = asyncio.create_task(instruments.probe_loop_lag(0.01))
        await asyncio.sleep(0.05)  # on time: the loop is free
        time.sleep(0.06)  # the loop cannot run its timer: a probe wakes >= 50 ms late
        await asyncio.sleep(0.03)
        probe.cancel()

    total, within_20ms = _lag_count("+Inf"), _lag_count("0.02")
    asyncio.run(run())
    probes = _lag_count("+Inf") - total
    assert probes >= 3
    late = probes - (_lag_count("0.02") - within_20ms)
    assert late >= 1  # the one the blocking call held back
    assert late < probes  # and only that one


def test_garbage_collections_are_timed_by_generation() -> None:
    import gc

    instruments.watch_gc()
    instruments.watch_gc()  # once per process, however often it is called
    assert gc.callbacks.count(instruments._on_gc) == 1
    name = "proofplane_gc_pause_seconds_count"
    full, young = value(name, {"generation": "2"}), value(name, {"generation": "0"})
    total = value("proofplane_gc_pause_seconds_sum", {"generation": "2"})
    gc.collect()  # a full collection
    gc.collect(0)
    assert value(name, {"generation": "2"}) == full + 1
    assert value(name, {"generation": "0"}) >= young + 1
    assert value("proofplane_gc_pause_seconds_sum", {"generation": "2"}) > total
