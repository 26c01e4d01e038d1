"""The agent's NVML telemetry collector as a real H100 answered it (captured with
``scripts/telemetry_check.py --json`` on an NVIDIA H100 80GB HBM3, driver 580, MIG off: two idle
reads, two while a matrix multiply ran on the GPU, one after; ``nvidia-smi`` read beside each).
Rule 6: the collector's readings are checked against what the hardware and NVIDIA's own tool
say, and the server takes every one of them."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from proofplane.meter import fields as F
from proofplane.meter.samples import parse_batch, parse_ts

READOUT = json.loads((Path(__file__).parent / "data" / "h100_80gb_hbm3_telemetry.json").read_text())
READS = [p for p in READOUT["phases"] if "body" in p]


def _gpu(read: dict[str, Any]) -> dict[str, float]:
    (device,) = read["body"]["samples"]  # one GPU, MIG off: one device
    assert device["gi_id"] is None
    return device["values"]


def test_the_readout_is_what_the_check_found_clean() -> None:
    assert READOUT["problems"] == []
    assert [p["phase"] for p in READS] == ["idle", "idle", "load", "load", "after"]
    assert READOUT["inventory"]["gpus"][0]["model"] == "H100-80GB"


@pytest.mark.parametrize("read", READS, ids=[f"{i}-{p['phase']}" for i, p in enumerate(READS)])
def test_the_server_takes_every_reading(read: dict[str, Any]) -> None:
    ts = parse_ts(read["body"]["samples"][0]["ts"])
    batch = parse_batch(read["body"], node="real-gpu-node", now=ts, oldest=ts - timedelta(hours=1))
    assert batch.ignored == {} and not batch.simulated
    assert len(batch.samples) == len(_gpu(read))
    assert {s.field for s in batch.samples} <= set(F.FIELDS)


def test_utilisation_follows_the_load() -> None:
    idle, busy, after = _gpu(READS[1]), _gpu(READS[3]), _gpu(READS[4])
    assert F.GR_ENGINE_ACTIVE not in _gpu(READS[0])  # GPM needs two samples
    assert idle[F.GR_ENGINE_ACTIVE] == 0.0 and idle[F.GPU_UTIL] == 0.0
    assert busy[F.GR_ENGINE_ACTIVE] > 0.95 and busy[F.SM_ACTIVE] > 0.9
    # GPM is the mean since the last read: the window ending after the load holds some of it
    assert 0.05 < after[F.GR_ENGINE_ACTIVE] < busy[F.GR_ENGINE_ACTIVE]


def test_readings_agree_with_nvidia_smi() -> None:
    for read in READS:
        got, (smi,) = _gpu(read), read["smi"]
        assert got[F.FB_USED] == pytest.approx(float(smi["memory.used"]), abs=1.0)
        assert got[F.POWER_USAGE] == pytest.approx(float(smi["power.draw"]), rel=0.05, abs=5)
        assert abs(got[F.GPU_TEMP] - float(smi["temperature.gpu"])) <= 2
        assert abs(got[F.GPU_UTIL] - float(smi["utilization.gpu"])) <= 5
        assert smi["uuid"] == READOUT["inventory"]["gpus"][0]["uuid"]


def test_energy_is_a_counter_that_the_power_explains() -> None:
    energy = [_gpu(r)[F.TOTAL_ENERGY] for r in READS]
    assert energy == sorted(energy) and len(set(energy)) == len(energy)
    # between the two load reads the GPU drew ~675 W: the counter's mJ agree within 20 %
    t0, t1 = (parse_ts(r["body"]["samples"][0]["ts"]) for r in READS[2:4])
    joules = (energy[3] - energy[2]) / 1000
    watts = (_gpu(READS[2])[F.POWER_USAGE] + _gpu(READS[3])[F.POWER_USAGE]) / 2
    assert joules == pytest.approx(watts * (t1 - t0).total_seconds(), rel=0.2)


def test_health_counters_are_clean() -> None:
    for read in READS:
        got = _gpu(read)
        for f in (F.XID_ERRORS, F.ECC_DBE_VOL_TOTAL, F.ROW_REMAP_FAILURE):
            assert got[f] == 0.0
