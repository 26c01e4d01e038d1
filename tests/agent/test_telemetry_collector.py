"""The agent's telemetry collectors: NVML (against the NVML-shaped fake of an 8 x H100 node)
and a dcgm-exporter scrape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pynvml
import pytest

from fake_nvml import FakeNvml, h100_node
from proofplane.agent.telemetry import DcgmScrape, NvmlTelemetry, mig_starts
from proofplane.hardware import nvml
from proofplane.meter import fields as F
from proofplane.meter.samples import parse_batch, to_wire

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
MIB = 1024 * 1024


def _by(samples):
    return {(s.gpu_uuid[-1], s.gi_id, s.field): s for s in samples}


def test_memory_is_read_v1_where_the_bindings_have_no_v2():
    class OldBindings(FakeNvml):
        nvmlMemory_v2 = None

    with NvmlTelemetry(OldBindings(h100_node())) as t:
        got = _by(t.read("n1", NOW))
    assert got[("0", None, F.FB_USED)].value == 512  # v1's used, reserve included
    assert got[("0", None, F.FB_FREE)].value == 81559 - 512


def test_nvml_reads_gpus_and_mig_instances():
    gpus = h100_node()
    gpus[2].gpm_mig = {1: {1: 75.0, 2: 70.0, 10: 30.0}, 7: {1: 1.0}}
    gpus[2].mig_fb_used = {1: 20000}
    fake = FakeNvml(gpus)
    with NvmlTelemetry(fake) as t:
        first = _by(t.read("n1", NOW))
        second = t.read("n1", NOW + timedelta(seconds=15))
    got = _by(second)
    # a whole GPU: NVML readings at every read, GPM from the second read on
    assert got[("0", None, F.GPU_UTIL)].value == 37
    assert got[("0", None, F.POWER_USAGE)].value == 312.5
    assert got[("0", None, F.TOTAL_ENERGY)].value == 1e9
    assert got[("0", None, F.GPU_TEMP)].value == 55
    assert got[("0", None, F.FB_USED)].value == 32  # v2: without the driver's 480 MiB reserve
    assert got[("0", None, F.XID_ERRORS)].value == 0
    assert got[("0", None, F.ECC_DBE_VOL_TOTAL)].value == 0
    assert got[("0", None, F.ROW_REMAP_FAILURE)].value == 0
    assert got[("0", None, F.GR_ENGINE_ACTIVE)].value == pytest.approx(0.42)
    assert got[("0", None, F.SM_ACTIVE)].value == pytest.approx(0.40)
    assert got[("0", None, F.PCIE_TX_BYTES)].value == 100 * MIB
    assert got[("0", None, F.NVLINK_TX_BYTES)].value == 400 * MIB
    assert ("0", None, F.GR_ENGINE_ACTIVE) not in first  # GPM needs two samples
    # ECC off on GPU 3: no ECC counts; MIG GPU 2: no GPU_UTIL, per-instance readings
    assert ("3", None, F.ECC_DBE_VOL_TOTAL) not in got
    assert ("2", None, F.GPU_UTIL) not in got
    inst = got[("2", 1, F.GR_ENGINE_ACTIVE)]
    assert inst.value == pytest.approx(0.75) and inst.profile == "3g.40gb" and inst.mig_start == 0
    assert got[("2", 1, F.FB_USED)].value == 20000
    assert got[("2", 7, F.GR_ENGINE_ACTIVE)].value == pytest.approx(0.01)
    assert got[("2", 7, F.FB_USED)].profile == "1g.10gb" and got[("2", 7, F.FB_USED)].mig_start == 4
    assert ("2", 8, F.GR_ENGINE_ACTIVE) not in got  # that instance reports no GPM metric
    assert {s.gi_id for s in second if s.gpu_uuid == gpus[5].uuid} == {None, 3, 9, 13}
    # every reading is one the server takes
    batch = parse_batch(to_wire(second), node="n1", now=NOW + timedelta(seconds=15),
                        oldest=NOW - timedelta(hours=1))  # fmt: skip
    assert batch.ignored == {} and len(batch.samples) == len(second)
    assert fake.initialized == 0 and fake.shutdowns == 1


def test_nvml_xid_events_and_no_gpm():
    gpus = h100_node()
    gpus[1].xids = [48]
    gpus[4].gpm = None  # an A100-like GPU: utilisation from nvmlDeviceGetUtilizationRates
    gpus[4].util = 80
    gpus[6].ecc_errors = (5, 2)
    gpus[6].remapped = (1, 2, 0, 1)
    with NvmlTelemetry(FakeNvml(gpus)) as t:
        got = _by(t.read("n1", NOW))
        later = _by(t.read("n1", NOW + timedelta(seconds=15)))
    assert got[("1", None, F.XID_ERRORS)].value == 48
    assert got[("0", None, F.XID_ERRORS)].value == 0
    assert later[("1", None, F.XID_ERRORS)].value == 0  # one event, one reading
    assert got[("4", None, F.GR_ENGINE_ACTIVE)].value == pytest.approx(0.8)
    assert got[("4", None, F.PCIE_TX_BYTES)].value == 1000 * 1024
    assert got[("6", None, F.ECC_DBE_VOL_TOTAL)].value == 2
    assert got[("6", None, F.ECC_SBE_VOL_TOTAL)].value == 5
    assert got[("6", None, F.ROW_REMAP_FAILURE)].value == 1
    assert got[("6", None, F.UNCORRECTABLE_REMAPPED_ROWS)].value == 2


def test_nvml_errors_leave_fields_out_and_init_errors_say_why():
    gpus = h100_node()
    gpus[0].fails = {"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_UNKNOWN}
    gpus[0].not_supported = {"nvmlDeviceGetTotalEnergyConsumption"}
    with NvmlTelemetry(FakeNvml(gpus)) as t:
        got = _by(t.read("n1", NOW))
    assert ("0", None, F.POWER_USAGE) not in got and ("0", None, F.TOTAL_ENERGY) not in got
    assert ("1", None, F.POWER_USAGE) in got
    with pytest.raises(nvml.NvmlUnavailable):
        NvmlTelemetry(FakeNvml(gpus, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)).open()


DCGM = """\
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="2",UUID="GPU-x",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",Hostname="h"} 0.5
DCGM_FI_DEV_POWER_USAGE{gpu="2",UUID="GPU-x",Hostname="h"} 300
"""  # noqa: E501


def test_dcgm_scrape_names_instances_by_start_where_nvml_knows():
    def get(url, timeout):
        assert url == "http://127.0.0.1:9400/metrics" and timeout == 5.0
        return httpx.Response(200, text=DCGM, request=httpx.Request("GET", url))

    scrape = DcgmScrape("http://127.0.0.1:9400/metrics", get=get,
                        starts={("GPU-x", 1): 4})  # fmt: skip
    samples = scrape.read("n1", NOW)
    assert [(s.node, s.gi_id, s.mig_start, s.field) for s in samples] == [
        ("n1", 1, 4, F.GR_ENGINE_ACTIVE), ("n1", None, None, F.POWER_USAGE)]  # fmt: skip
    assert all(s.ts == NOW for s in samples)

    def down(url, timeout):
        return httpx.Response(503, text="no", request=httpx.Request("GET", url))

    with pytest.raises(httpx.HTTPStatusError):
        DcgmScrape("http://x/metrics", get=down).read("n1", NOW)


def test_mig_starts_from_an_inventory():
    inv = nvml.collect(FakeNvml(h100_node()))
    starts = mig_starts(inv)
    uuid2 = h100_node()[2].uuid
    assert starts[(uuid2, 1)] == 0 and starts[(uuid2, 7)] == 4 and starts[(uuid2, 8)] == 5
    assert mig_starts(None) == {}
