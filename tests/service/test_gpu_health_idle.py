"""GPU health drains (service.gpu_health) and idle detection (service.idle), end to end through
the telemetry ingest."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

import telemetry_cluster as tc
from proofplane.access import SYSTEM, Actor, Role
from proofplane.errors import NotFound, ValidationFailed
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import fields as F
from proofplane.model import GpuRequest, NodeState, WorkloadStatus
from proofplane.service import gpu_health, idle
from proofplane.service import nodes as nodes_svc
from proofplane.service import telemetry as tel
from proofplane.service import workloads as wl_svc
from proofplane.service.context import Store
from proofplane.service.workloads import WorkloadSpec
from proofplane.store.tables import EventRow

XID, G = F.XID_ERRORS, F.GR_ENGINE_ACTIVE
WHOLE_GPU = gpu_uuid("n1", 1)  # held by acme/whole


@pytest.fixture
def cluster(store: Store) -> Store:
    tc.load(store)
    return store


def _events(store: Store, action: str) -> list[EventRow]:
    with store.read() as s:
        return list(s.scalars(select(EventRow).where(EventRow.action == action)
                              .order_by(EventRow.seq)))  # fmt: skip


def _post(store: Store, node: str, entries, now=None):
    now = now or datetime.now(UTC)
    return tel.ingest(store, tc.agent(node), node, {"samples": entries}, now=now)


def _workload(store: Store, name: str):
    return wl_svc.get_workload(store, SYSTEM, name)


def test_a_fatal_xid_drains_the_gpu_and_moves_its_work(cluster: Store) -> None:
    now = datetime.now(UTC)
    out = _post(cluster, "n1", [tc.entry(WHOLE_GPU, now, {XID: 48, F.GPU_TEMP: 50})], now)
    assert [d["gpu_uuid"] for d in out.drained] == [WHOLE_GPU]
    assert out.drained[0]["evicted"] == ["whole"] and out.drained[0]["device_lost"]
    (drain,) = _events(cluster, "gpu.drain")
    assert drain.target_id == "n1" and drain.details["xid"] == 48
    assert drain.details["cause"] == "xid" and drain.details["gpu_index"] == 1
    (alert,) = _events(cluster, "alert.gpu_health")
    assert alert.details["severity"] == "critical" and alert.details["action"] == "drain_device"
    (evict,) = _events(cluster, "workload.evict")
    assert evict.details["reason"] == "gpu_unhealthy" and "XID 48" in evict.details["message"]
    moved = _workload(cluster, "whole")
    assert moved.status is WorkloadStatus.PLACED and moved.placement.node == "n2"
    assert [d["gpu_uuid"] for d in gpu_health.list_drained(cluster, SYSTEM)] == [WHOLE_GPU]
    # the exporter repeats the last XID: nothing new happens
    again = _post(cluster, "n1", [tc.entry(WHOLE_GPU, now + timedelta(seconds=15), {XID: 48})],
                  now)  # fmt: skip
    assert again.drained == [] and len(_events(cluster, "gpu.drain")) == 1
    # no new work goes to the drained GPU: n1's only plain GPU is it
    wl_svc.submit_workload(cluster, SYSTEM, WorkloadSpec("w2", "acme", gpus=GpuRequest(count=1)))
    wl_svc.submit_workload(cluster, SYSTEM, WorkloadSpec("w3", "acme", gpus=GpuRequest(count=1)))
    assert _workload(cluster, "w2").placement.node == "n2"
    assert _workload(cluster, "w3").status is WorkloadStatus.PENDING
    # recovery is an operator's action: then pending work may take the GPU
    with pytest.raises(NotFound):
        gpu_health.recover(cluster, SYSTEM, "n1", gpu_uuid("n1", 0))
    rec = gpu_health.recover(cluster, SYSTEM, "n1", WHOLE_GPU)
    assert rec["state"] == "recovered" and _events(cluster, "gpu.recover")
    w3 = _workload(cluster, "w3")
    assert w3.status is WorkloadStatus.PLACED and w3.placement.devices[0].gpu_uuid == WHOLE_GPU
    assert gpu_health.list_drained(cluster, SYSTEM) == []
    # after recovery the repeated XID value is still no new error
    later = _post(cluster, "n1", [tc.entry(WHOLE_GPU, now + timedelta(seconds=30), {XID: 48})],
                  now)  # fmt: skip
    assert later.drained == []


def test_xid_79_cordons_the_node_and_non_lost_drains_keep_work(cluster: Store) -> None:
    now = datetime.now(UTC)
    # XID 63 (row remap event): drained, the work stays where it is
    out = _post(cluster, "n1", [tc.entry(WHOLE_GPU, now, {XID: 63})], now)
    assert out.drained[0]["evicted"] == [] and not out.drained[0]["device_lost"]
    assert _workload(cluster, "whole").placement.node == "n1"
    # now the same GPU is lost (an ECC double-bit error): its work moves
    out = _post(cluster, "n1", [tc.entry(WHOLE_GPU, now + timedelta(seconds=1),
                                         {F.ECC_DBE_VOL_TOTAL: 1})], now)  # fmt: skip
    assert out.drained[0]["evicted"] == ["whole"] and out.drained[0]["cause"] == "ecc_dbe"
    # a GPU of n2 falls off the bus: the node is cordoned
    out = _post(cluster, "n2", [tc.entry(gpu_uuid("n2", 1), now, {XID: 79})], now)
    assert out.drained[0]["cordoned"] is True
    assert nodes_svc.get_node(cluster, SYSTEM, "n2").state is NodeState.CORDONED
    (alert,) = [a for a in _events(cluster, "alert.gpu_health") if a.target_id == "n2"]
    assert alert.details["action"] == "drain_node"
    # thermal: crossing the limit drains, staying above does not drain again
    out = _post(cluster, "n2", [tc.entry(gpu_uuid("n2", 0), now, {F.GPU_TEMP: 95})], now)
    assert out.drained[0]["cause"] == "thermal"
    out = _post(cluster, "n2", [tc.entry(gpu_uuid("n2", 0), now + timedelta(seconds=5),
                                         {F.GPU_TEMP: 96})], now)  # fmt: skip
    assert out.drained == []


def _idle_readings(uuid: str, end: datetime, value: float, **mig) -> list[dict]:
    return [tc.entry(uuid, end - timedelta(minutes=m), {G: value}, **mig) for m in range(0, 36, 2)]


def test_idle_notify_once_per_window(cluster: Store) -> None:
    later = datetime.now(UTC) + timedelta(minutes=40)
    _post(cluster, "n1", _idle_readings(WHOLE_GPU, later, 0.01), later)
    _post(cluster, "n1", _idle_readings(tc.MIG_GPU, later, 0.8, gi_id=1, profile="3g.40gb"),
          later)  # fmt: skip
    done = idle.check_idle(cluster, SYSTEM, later)
    assert [(d["workload"], d["action"]) for d in done] == [("whole", "notified")]
    assert done[0]["peak"] == pytest.approx(0.01) and done[0]["tenant"] == "acme"
    (ev,) = _events(cluster, "workload.idle")
    assert ev.target_id == "whole" and ev.details["policy"] == "notify"
    assert idle.check_idle(cluster, SYSTEM, later + timedelta(minutes=1)) == []
    assert _workload(cluster, "whole").status is WorkloadStatus.PLACED
    # a silent agent is no idleness
    much_later = later + timedelta(hours=2)
    assert idle.check_idle(cluster, SYSTEM, much_later) == []


def test_idle_reclaim_for_preemptible_work(cluster: Store) -> None:
    out = idle.set_idle_policy(cluster, SYSTEM, "acme", {"action": "reclaim", "window_s": 1200,
                                                         "threshold": 0.1})  # fmt: skip
    assert out["idle_policy"]["preemptible_priority"] == 0
    assert idle.get_idle_policy(cluster, SYSTEM, "acme")["default"] is False
    assert idle.get_idle_policy(cluster, SYSTEM, "beta")["idle_policy"]["action"] == "notify"
    later = datetime.now(UTC) + timedelta(minutes=40)
    _post(cluster, "n1", _idle_readings(WHOLE_GPU, later, 0.05), later)
    done = idle.check_idle(cluster, SYSTEM, later)
    assert [(d["workload"], d["action"]) for d in done] == [("whole", "reclaimed")]
    w = _workload(cluster, "whole")
    assert w.status is WorkloadStatus.CANCELLED and w.reason == "idle_reclaimed"
    (evict,) = _events(cluster, "workload.evict")
    assert evict.details["reason"] == "idle_reclaimed" and "reclaim" in evict.details["message"]
    (cancel,) = _events(cluster, "workload.cancel")
    assert cancel.details["reason"] == "idle_reclaimed" and cancel.details["peak"] == 0.05
    assert _events(cluster, "tenant.idle_policy")


def test_idle_reclaim_spares_higher_priority_work(cluster: Store) -> None:
    idle.set_idle_policy(cluster, SYSTEM, "acme", {"action": "reclaim",
                                                    "preemptible_priority": -1})  # fmt: skip
    later = datetime.now(UTC) + timedelta(minutes=40)
    _post(cluster, "n1", _idle_readings(WHOLE_GPU, later, 0.0), later)
    done = idle.check_idle(cluster, SYSTEM, later)
    assert [(d["workload"], d["action"]) for d in done] == [("whole", "notified")]


@pytest.mark.parametrize(
    "policy",
    [None, [], {"action": "kill"}, {"window_s": 5}, {"threshold": 0}, {"threshold": 2},
     {"preemptible_priority": 1.5}, {"extra": 1}, {"window_s": True}],
)  # fmt: skip
def test_idle_policy_validation(cluster: Store, policy) -> None:
    with pytest.raises(ValidationFailed) as err:
        idle.set_idle_policy(cluster, SYSTEM, "acme", policy)
    assert err.value.code == "invalid_idle_policy"


def test_idle_policy_is_the_tenants_business(cluster: Store) -> None:
    ta = Actor("ta", frozenset({Role.TENANT_ADMIN}), frozenset({"acme"}))
    with pytest.raises(Exception) as err:
        idle.set_idle_policy(cluster, ta, "acme", {"action": "reclaim"})
    assert getattr(err.value, "code", "") == "forbidden"  # tenant admins hold no tenants:write
    with pytest.raises(NotFound):
        idle.get_idle_policy(cluster, ta, "beta")
    assert idle.get_idle_policy(cluster, ta, "acme")["tenant"] == "acme"
