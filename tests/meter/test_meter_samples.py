"""meter.fields and meter.samples: the field table, the posted form, dcgm-exporter's text."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from proofplane.errors import ValidationFailed
from proofplane.meter import fields as F
from proofplane.meter.samples import Sample, parse_batch, parse_dcgm_text, parse_ts, to_wire

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
OLDEST = NOW - timedelta(hours=48)


def _batch(body, **kw):
    return parse_batch(body, node="n1", now=NOW, oldest=OLDEST, **kw)


def test_field_table_is_consistent():
    assert F.GR_ENGINE_ACTIVE in F.MIG_FIELDS and F.GPU_UTIL not in F.MIG_FIELDS
    assert F.TOTAL_ENERGY in F.COUNTERS and F.FIELDS[F.TOTAL_ENERGY].unit == "mJ"
    assert F.POWER_USAGE not in F.MIG_FIELDS and F.FIELDS[F.POWER_USAGE].kind == "gauge"
    for f in F.FIELDS.values():
        assert f.name.startswith("DCGM_FI_") and f.low < f.high and f.help
    # the fatal classes are all in the table, with NVIDIA's meanings
    for xid in (48, 63, 64, 74, 79, 92, 94, 95):
        assert F.XID_CLASSES[xid].fatal and F.XID_CLASSES[xid].meaning
    assert F.XID_CLASSES[79].action == "drain_node"
    assert not F.XID_CLASSES[13].fatal and F.XID_CLASSES[13].action == "none"
    assert F.field("nope") is None


def test_parse_batch_groups_and_times():
    body = {
        "samples": [
            {"gpu_uuid": "GPU-a", "ts": "2026-05-01T11:59:45Z",
             "values": {F.POWER_USAGE: 300, F.GPU_TEMP: 61.5}},
            {"gpu_uuid": "GPU-a", "gi_id": 2, "profile": "3g.40gb", "mig_start": 4,
             "ts": NOW.timestamp(), "values": {F.GR_ENGINE_ACTIVE: 0.5}},
        ],
    }  # fmt: skip
    b = _batch(body)
    assert not b.simulated and b.ignored == {}
    assert b.samples == [
        Sample("n1", "GPU-a", None, None, F.POWER_USAGE, NOW - timedelta(seconds=15), 300.0),
        Sample("n1", "GPU-a", None, None, F.GPU_TEMP, NOW - timedelta(seconds=15), 61.5),
        Sample("n1", "GPU-a", 2, "3g.40gb", F.GR_ENGINE_ACTIVE, NOW, 0.5, 4),
    ]
    assert _batch(to_wire(b.samples, simulated=True)).samples == b.samples
    assert _batch(to_wire(b.samples, simulated=True)).simulated


def test_parse_batch_leaves_out_odd_readings_and_counts_them():
    body = {
        "simulated": True,
        "samples": [
            {"gpu_uuid": "GPU-a", "ts": NOW.isoformat(),
             "values": {"DCGM_FI_DEV_NEW_THING": 1, F.GR_ENGINE_ACTIVE: 7.0, F.GPU_TEMP: 40}},
            {"gpu_uuid": "GPU-a", "gi_id": 1, "ts": NOW.isoformat(),
             "values": {F.POWER_USAGE: 10, F.FB_USED: 100}},
            {"gpu_uuid": "GPU-a", "ts": (NOW + timedelta(hours=1)).isoformat(),
             "values": {F.GPU_TEMP: 40}},
            {"gpu_uuid": "GPU-a", "ts": (NOW - timedelta(days=3)).isoformat(),
             "values": {F.GPU_TEMP: 40}},
        ],
    }  # fmt: skip
    b = _batch(body)
    assert b.simulated
    assert [(s.field, s.gi_id) for s in b.samples] == [(F.GPU_TEMP, None), (F.FB_USED, 1)]
    assert b.ignored == {"unknown_field": 1, "out_of_range": 1, "not_for_mig": 1,
                         "in_future": 1, "too_old": 1}  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [
        None, [], "x", {"samples": {}}, {"samples": [1]}, {"nope": []},
        {"samples": [], "simulated": "yes"},
        {"samples": [{"gpu_uuid": "", "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU a", "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "x" * 65, "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": "yesterday", "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": "2026-05-01T12:00:00", "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": [1], "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": True, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1e300, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1, "values": []}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1, "values": {F.GPU_TEMP: "hot"}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1, "values": {F.GPU_TEMP: True}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1, "values": {F.GPU_TEMP: float("nan")}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1, "values": {F.GPU_TEMP: float("inf")}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "gi_id": -1, "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "gi_id": 1.5, "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "profile": "1g", "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "gi_id": 1, "profile": 3, "ts": 1, "values": {}}]},
        {"samples": [{"gpu_uuid": "GPU-a", "ts": 1, "values": {}, "extra": 1}]},
    ],
)  # fmt: skip
def test_parse_batch_refuses_malformed_bodies(body):
    with pytest.raises(ValidationFailed) as err:
        _batch(body)
    assert err.value.code == "invalid_telemetry"


def test_parse_batch_refuses_huge_batches():
    entry = {"gpu_uuid": "GPU-a", "ts": 1, "values": {F.GPU_TEMP: 1, F.POWER_USAGE: 1}}
    with pytest.raises(ValidationFailed) as err:
        _batch({"samples": [entry] * 6}, max_samples=11)
    assert err.value.code == "too_many_samples"
    assert err.value.details == {"readings": 12, "max": 11}


def test_parse_ts_forms():
    assert parse_ts("2026-05-01T12:00:00+02:00") == NOW - timedelta(hours=2)
    assert parse_ts(0) == datetime(1970, 1, 1, tzinfo=UTC)
    for bad in ("", "x" * 41, -1, float("nan"), None, "2026-05-01"):
        with pytest.raises(ValueError):
            parse_ts(bad)


DCGM_TEXT = """\
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="fra-h100-01",DCGM_FI_DRIVER_VERSION="570.133.20"} 312.5
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-b",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",Hostname="fra-h100-01"} 200
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-b",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="fra-h100-01"} 200
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="1",UUID="GPU-b",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",Hostname="fra-h100-01"} 0.75
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="1",UUID="GPU-b",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="fra-h100-01"} 0.01
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-a",Hostname="fra-h100-01"} 1980
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-a",Hostname="fra-h100-01"} 123456789 1777636800000
"""  # noqa: E501


def test_parse_dcgm_text():
    samples = parse_dcgm_text(DCGM_TEXT, ts=NOW)
    got = [(s.node, s.gpu_uuid, s.gi_id, s.profile, s.field, s.value) for s in samples]
    assert got == [
        ("fra-h100-01", "GPU-a", None, None, F.POWER_USAGE, 312.5),
        # a whole-GPU field repeated on each instance's series is kept once, for the GPU
        ("fra-h100-01", "GPU-b", None, None, F.POWER_USAGE, 200.0),
        ("fra-h100-01", "GPU-b", 2, "3g.40gb", F.GR_ENGINE_ACTIVE, 0.75),
        ("fra-h100-01", "GPU-b", 9, "1g.10gb", F.GR_ENGINE_ACTIVE, 0.01),
        ("fra-h100-01", "GPU-a", None, None, F.TOTAL_ENERGY, 123456789.0),
    ]
    assert samples[0].ts == NOW
    assert samples[-1].ts == datetime.fromtimestamp(1777636800, UTC)  # the sample's own time
    assert {s.node for s in parse_dcgm_text(DCGM_TEXT, node="other", ts=NOW)} == {"other"}


@pytest.mark.parametrize(
    ("text", "kw"),
    [
        ('DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a"} {{{', {"node": "n", "ts": NOW}),
        ('DCGM_FI_DEV_GPU_TEMP{gpu="0"} 40', {"node": "n", "ts": NOW}),  # no UUID
        ('DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a"} 40', {"ts": NOW}),  # no node
        ('DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a",Hostname="h"} 40', {}),  # no time
        ('DCGM_FI_PROF_GR_ENGINE_ACTIVE{UUID="GPU-a",GPU_I_ID="x"} 1', {"node": "n", "ts": NOW}),
    ],
)
def test_parse_dcgm_text_refuses(text, kw):
    with pytest.raises(ValueError):
        parse_dcgm_text(text, **kw)


def test_parse_dcgm_text_skips_nan():
    assert parse_dcgm_text('DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a"} NaN', node="n", ts=NOW) == []
