"""The node page's MIG picture as values: instances over the 8 memory slots with their compute
slices, holders named only inside the reader's tenants, a legend of the tenants shown."""

from __future__ import annotations

from proofplane.model import (
    Gpu,
    GpuRequest,
    MigInstance,
    Node,
    PlacedDevice,
    Placement,
    Workload,
    WorkloadStatus,
)
from proofplane.service.console import (
    FREE,
    HIDDEN,
    OTHER_TENANT,
    attestation_of,
    mig_picture,
    tenant_colour,
)

GPU0 = Gpu(0, "GPU-0", "H100-80GB", 81_920, mig_enabled=True,
           mig_instances=(MigInstance("4g.40gb", 0), MigInstance("2g.20gb", 4),
                          MigInstance("1g.10gb", 6)))  # fmt: skip
GPU1 = Gpu(1, "GPU-1", "H100-80GB", 81_920)
GPU2 = Gpu(2, "GPU-2", "H100-80GB", 81_920)
NODE = Node("n1", "r", "z", gpus=(GPU0, GPU1, GPU2))


def _wl(name: str, tenant: str, *devices: PlacedDevice) -> Workload:
    return Workload(name, tenant, gpus=GpuRequest(), status=WorkloadStatus.RUNNING,
                    placement=Placement("n1", devices))  # fmt: skip


WORK = [
    _wl("scan", "hospital", PlacedDevice(0, "GPU-0", "4g.40gb", 0)),
    _wl("fraud", "bank", PlacedDevice(0, "GPU-0", "1g.10gb", 6)),
    _wl("nb-a", "lab", PlacedDevice(1, "GPU-1", share_milli=500)),
    _wl("nb-b", "bank", PlacedDevice(1, "GPU-1", share_milli=500)),
]


def test_the_geometry_of_a_mig_gpu() -> None:
    gpus, legend = mig_picture(NODE, WORK, None)
    slots = gpus[0].slots
    assert [(s.label, s.start, s.width, s.compute) for s in slots] == [
        ("4g.40gb", 0, 4, 4), ("2g.20gb", 4, 2, 2), ("1g.10gb", 6, 1, 1),
    ]  # fmt: skip
    assert gpus[0].free_slots == [7]  # the 8th memory slot no instance covers
    assert [s.holder for s in slots] == ["scan", None, "fraud"]
    assert slots[0].colour == tenant_colour("hospital") and slots[1].colour == FREE
    assert legend == {t: tenant_colour(t) for t in ("hospital", "bank", "lab")}
    assert gpus[1].slots[0].label == "shared: 50%, 50%"
    assert gpus[1].slots[0].holder == "nb-a, nb-b" and gpus[1].slots[0].tenant == "bank, lab"
    assert gpus[2].slots[0].label == "whole GPU" and gpus[2].slots[0].holder is None


def test_other_tenants_are_not_named() -> None:
    gpus, legend = mig_picture(NODE, WORK, frozenset({"bank"}))
    held = [s for g in gpus for s in g.slots if s.holder]
    assert {s.holder for s in held} == {OTHER_TENANT, "fraud", f"{OTHER_TENANT}, nb-b"}
    named = " ".join(f"{s.holder} {s.tenant}" for g in gpus for s in g.slots)
    assert "hospital" not in named and "lab" not in named and "scan" not in named
    assert gpus[0].slots[0].colour == HIDDEN
    assert set(legend) == {"bank", OTHER_TENANT}


def test_tenant_colours_are_stable_and_attestation_states() -> None:
    from datetime import UTC, datetime, timedelta

    assert tenant_colour("hospital") == tenant_colour("hospital")
    now = datetime(2026, 11, 27, tzinfo=UTC)
    stale_before = now - timedelta(minutes=15)
    assert attestation_of(None, stale_before) == "none"
    assert attestation_of((True, now, False), stale_before) == "failed"
    assert attestation_of((False, now - timedelta(hours=1), False), stale_before) == "stale"
    assert attestation_of((False, now, True), stale_before) == "simulated"
    assert attestation_of((False, now, False), stale_before) == "passed"
