"""The NVML GPU inventory collector, against an NVML-shaped fake of an 8 x H100 node.

The fake follows pynvml's real API (nvidia-ml-py): the same function names and argument order,
opaque ctypes handles, the real ctypes structures as return values, strings as ``str`` (or
``bytes``, as bindings before 11.515 returned them), the C-style out-parameters of
``nvmlDeviceGetGpuInstances``, and pynvml's own NVMLError with the real error codes.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

import pynvml
import pytest
from typer.testing import CliRunner

from fake_nvml import DRIVER, MIB, VBIOS, FakeGpu, FakeNvml, h100_node
from proofplane.attest import Expected, Policy, verify
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.cli import agent as agent_cli
from proofplane.cli.main import app
from proofplane.hardware import nvml
from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model import MigInstance, validate_name


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(h100_node())


def test_collects_every_field(fake: FakeNvml):
    inv = nvml.collect(fake)
    assert fake.initialized == 0 and fake.shutdowns == 1  # NVML shut down again
    assert inv["source"] == "nvml"
    assert inv["driver_version"] == DRIVER
    assert inv["cuda_driver_version"] == "12.4"
    assert inv["nvml_version"] == f"12.{DRIVER}"
    assert inv["unsupported"] == []
    assert [g["index"] for g in inv["gpus"]] == list(range(8))
    assert inv["gpus"][0] == {
        "index": 0,
        "uuid": "GPU-4f6c2d1a-0000-0000-0000-000000000000",
        "serial": "1654922012340",
        "name": "NVIDIA H100 80GB HBM3",
        "model": "H100-80GB",
        "memory_mb": 81559,
        "pci_bus_id": "00000000:18:00.0",
        "vbios_version": VBIOS,
        "driver_version": DRIVER,
        "ecc_enabled": True,
        "ecc_pending": True,
        "mig_enabled": False,
        "mig_pending": False,
        "mig_instances": [],
        "unsupported": [],
    }
    assert inv["gpus"][3]["ecc_enabled"] is False and inv["gpus"][3]["ecc_pending"] is False
    assert inv["gpus"][7]["mig_enabled"] is False and inv["gpus"][7]["mig_pending"] is True
    json.dumps(inv)  # plain JSON, no ctypes values left


def test_mig_instances_and_placements_are_mapped_to_our_profiles(fake: FakeNvml):
    gpus = nvml.collect(fake)["gpus"]
    assert gpus[2]["mig_enabled"] is True
    assert gpus[2]["mig_instances"] == [
        {"profile": "3g.40gb", "profile_id": 9, "start": 0, "size": 4, "gpu_instance_id": 1},
        {"profile": "1g.10gb", "profile_id": 19, "start": 4, "size": 1, "gpu_instance_id": 7},
        {"profile": "1g.10gb", "profile_id": 19, "start": 5, "size": 1, "gpu_instance_id": 8},
    ]
    assert [(i["profile"], i["start"]) for i in gpus[5]["mig_instances"]] == [
        ("2g.20gb", 0), ("1g.20gb", 4), ("1g.10gb+me", 6),
    ]  # fmt: skip
    # what NVML reports is a layout our own MIG geometry accepts, by the same names
    sku = get_sku(gpus[2]["model"])
    for g in (gpus[2], gpus[5]):
        insts = [MigInstance(i["profile"], i["start"]) for i in g["mig_instances"]]
        assert layout_errors(sku, insts) == []
        for i in g["mig_instances"]:
            assert sku.profile(i["profile"]).mem_slices == i["size"]


def test_not_supported_is_null_not_a_crash(fake: FakeNvml):
    fake.gpus[4].not_supported = {"nvmlDeviceGetEccMode", "nvmlDeviceGetVbiosVersion"}
    gpus = nvml.collect(fake)["gpus"]
    assert gpus[6]["serial"] is None and gpus[6]["unsupported"] == ["serial"]
    assert gpus[6]["uuid"].startswith("GPU-") and gpus[6]["vbios_version"] == VBIOS
    assert gpus[4]["vbios_version"] is None and gpus[4]["ecc_enabled"] is None
    assert sorted(gpus[4]["unsupported"]) == ["ecc_enabled", "ecc_pending", "vbios_version"]


def test_a_gpu_without_mig_or_ecc_support():
    l40s = FakeGpu(uuid="GPU-l40s", name="NVIDIA L40S", memory_total=46068 * MIB,
                   not_supported={"nvmlDeviceGetMigMode"})  # fmt: skip
    (gpu,) = nvml.collect(FakeNvml([l40s]))["gpus"]
    assert gpu["model"] is None  # not in our SKU table
    assert gpu["mig_enabled"] is None and gpu["mig_instances"] == []
    assert sorted(gpu["unsupported"]) == ["mig_enabled", "mig_pending"]


def test_unknown_sku_profiles_keep_the_nvml_name():
    gh = FakeGpu(uuid="GPU-gh200", name="NVIDIA GH200 480GB", memory_total=97871 * MIB,
                 mig=(1, 1), instances=[(2, 19, 0, 1)])  # fmt: skip
    profiles = {pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 7, 11776, "MIG 1g.12gb")}
    (gpu,) = nvml.collect(FakeNvml([gh], profiles=profiles))["gpus"]
    assert gpu["model"] is None  # GH200 is not an H200
    assert gpu["mig_instances"] == [
        {"profile": "1g.12gb", "profile_id": 19, "start": 0, "size": 1, "gpu_instance_id": 2}
    ]


def test_bytes_from_older_bindings_read_the_same(fake: FakeNvml):
    old = FakeNvml(h100_node(), legacy_bytes=True)
    assert nvml.collect(old) == nvml.collect(fake)


def test_drivers_without_the_v2_profile_info_read_the_same(fake: FakeNvml):
    old = FakeNvml(h100_node(), old_driver=True)
    assert nvml.collect(old) == nvml.collect(fake)


@pytest.mark.parametrize(
    ("name", "memory_mb", "sku"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-NVL-94GB"),
        ("NVIDIA A100-SXM4-40GB", 40536, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA B200", 183359, "B200-180GB"),
        ("NVIDIA GH200 480GB", 97871, None),
        ("Tesla V100-SXM2-32GB", 32768, None),
        (None, None, None),
    ],
)
def test_sku_for_nvml_names(name, memory_mb, sku):
    found = nvml.sku_for(name, memory_mb)
    assert (found and found.name) == sku


def test_other_nvml_errors_raise_and_still_shut_down(fake: FakeNvml):
    fake.gpus[1].fails = {"nvmlDeviceGetVbiosVersion": pynvml.NVML_ERROR_GPU_IS_LOST}
    with pytest.raises(nvml.NvmlError, match="vbios_version: GPU is lost"):
        nvml.collect(fake)
    assert fake.initialized == 0 and fake.shutdowns == 1


def test_no_driver_is_a_clear_error():
    fake = FakeNvml(h100_node(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(nvml.NvmlUnavailable, match=r"libnvidia-ml\.so\.1.*driver installed"):
        nvml.collect(fake)
    fake = FakeNvml(h100_node(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(nvml.NvmlUnavailable, match="driver is not loaded"):
        nvml.collect(fake)


def test_the_real_bindings_without_a_driver_say_so():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a machine with a GPU driver
        pynvml.nvmlShutdown()
        inv = nvml.collect()
        assert all(g["uuid"] for g in inv["gpus"])
        return
    with pytest.raises(nvml.NvmlUnavailable, match="NVML is not available"):
        nvml.collect()


def test_missing_bindings_are_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(nvml.NvmlUnavailable, match=r"pip install 'proofplane\[nvml\]'"):
        nvml.collect()


# --- the verifier reads the collected inventory ---------------------------------------------
def _verdict(inventory: dict | None, **policy: Any):
    node = SimulatedAttester.create()
    node.boot(demo_boot_log(b"vmlinuz-6.1"))
    nonce = b"\x07" * 32
    ev = node.evidence(nonce, list(range(10)), inventory=inventory)
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    exp = Expected(nonce, now, node.ak_public, node.ek_public)
    return verify(ev, exp, Policy(id="gpu", require_secure_boot=False, **policy), now)


def test_collected_inventory_passes_the_gpu_allow_list(fake: FakeNvml):
    inv = nvml.collect(fake)
    ok = _verdict(inv, allowed_vbios=frozenset({VBIOS}), min_driver="550.54.0")
    assert ok.ok, ok.reasons
    old = _verdict(inv, allowed_vbios=frozenset({VBIOS}), min_driver="555.0")
    assert list(old.reasons) == ["driver_too_old"]
    fake.gpus[4].vbios = "96.00.30.00.01"
    fake.gpus[6].not_supported = {"nvmlDeviceGetVbiosVersion"}  # null VBIOS: fail-closed
    bad = _verdict(nvml.collect(fake), allowed_vbios=frozenset({VBIOS}))
    assert list(bad.reasons) == ["vbios_not_allowed"]
    msg = bad.messages["vbios_not_allowed"]
    assert "96.00.30.00.01" in msg and "None" in msg


# --- the agent ------------------------------------------------------------------------------
runner = CliRunner()


def test_agent_collect_inventory_prints_json(monkeypatch, fake: FakeNvml):
    monkeypatch.setattr(nvml, "load", lambda: fake)
    result = runner.invoke(app, ["agent", "--collect-inventory"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == nvml.collect(fake)


def test_agent_collect_inventory_without_nvml_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = runner.invoke(app, ["agent", "--collect-inventory"])
    assert result.exit_code == 1
    assert "proofplane[nvml]" in result.stderr and "Traceback" not in result.output


def test_agent_attesting_needs_server_token_and_node():
    result = runner.invoke(app, ["agent", "--once"], env={"PROOFPLANE_SERVER": ""})
    assert result.exit_code == 2
    assert "missing --server, --token, --node" in result.stderr


def test_agent_inventory_each_round(tmp_path, fake: FakeNvml, capsys):
    # a recording is replayed as it is
    rec = tmp_path / "inv.json"
    rec.write_text(json.dumps({"gpus": []}))
    assert agent_cli.gpu_inventory(rec, fake) == {"gpus": []}
    # otherwise NVML is read
    assert agent_cli.gpu_inventory(None, fake) == nvml.collect(fake)
    # no NVML: nothing is sent, and stderr says why (the server's policy decides)
    gone = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert agent_cli.gpu_inventory(None, gone) is None
    assert "sending no GPU inventory: NVML is not available" in capsys.readouterr().err
    assert list(_verdict(None, allowed_vbios=frozenset({VBIOS})).reasons) == ["inventory_missing"]


def test_nvlink_fabric_gives_the_nodes_nvlink_domain(fake: FakeNvml):
    """A GB200-style node (issue 17 §4): every GPU reports the same NVLink cluster and clique,
    so the inventory names the node's nvlink_domain; a partial or mixed fabric names none."""
    cluster = bytes.fromhex("0123456789abcdef0123456789abcdef")
    done = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    for g in fake.gpus:
        g.fabric = (cluster, 7, done)
    inv = nvml.collect(fake)
    assert inv["gpus"][0]["fabric"] == {"cluster_uuid": cluster.hex(), "clique_id": 7}
    assert inv["topology"] == {"nvlink_domain": f"nvl-{cluster.hex()}-7"}
    validate_name(inv["topology"]["nvlink_domain"], "topology nvlink_domain")
    fake.gpus[1].fabric = (cluster, 8, done)  # another clique: no single domain
    assert "topology" not in nvml.collect(fake)
    fake.gpus[1].fabric = (cluster, 7, pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    inv = nvml.collect(fake)
    assert "fabric" not in inv["gpus"][1] and "topology" not in inv
    # what a real H100 80GB HBM3 (driver 580.159.04, outside any NVLink fabric) answered on the
    # lent device (scripts/topology_check.py): success, state NOT_SUPPORTED, a zero UUID
    for g in fake.gpus:
        g.fabric = (bytes(16), 0, pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED)
    inv = nvml.collect(fake)
    assert all("fabric" not in g for g in inv["gpus"]) and "topology" not in inv
