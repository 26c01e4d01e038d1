#!/usr/bin/env python3
"""Run the node agent's NVML telemetry collector against this machine's real GPUs, idle and
under a load, and check what it reads against ``nvidia-smi`` (issue 15, rule 6: hardware facts
come from hardware). Run on a node with the NVIDIA driver, ``nvidia-ml-py`` and (for the load)
PyTorch with CUDA::

    PYTHONPATH=src python3 scripts/telemetry_check.py [--json OUT.json] [--load-seconds 8]

It only reads NVML and runs a matrix multiply on GPU 0 for a few seconds; it never changes MIG
mode, clocks, power limits or any other setting. Phases: ``idle`` (two reads, so GPM has a
delta), ``load`` (two reads while the multiply runs) and ``after`` (one read after it stopped).
Each read is the exact body the agent posts (``meter.samples.to_wire``), timed. Exit 1 when a
check fails (printed), 2 when NVML is missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

from proofplane.agent.telemetry import NvmlTelemetry
from proofplane.hardware import nvml
from proofplane.meter import fields as F
from proofplane.meter.samples import Sample, to_wire

LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda:0")
b = a @ a
torch.cuda.synchronize()
print("running", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    b = a @ a
    torch.cuda.synchronize()
"""

SMI = "index,uuid,utilization.gpu,memory.used,power.draw,temperature.gpu,mig.mode.current"


def _smi() -> list[dict[str, str]] | str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"
    keys = SMI.split(",")
    return [
        dict(zip(keys, (v.strip() for v in line.split(",")), strict=False))
        for line in out.splitlines()
        if line.strip()
    ]


def _by_field(samples: list[Sample], uuid: str) -> dict[str, float]:
    return {s.field: s.value for s in samples if s.gpu_uuid == uuid and s.gi_id is None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the readout here")
    ap.add_argument("--load-seconds", type=float, default=8.0)
    args = ap.parse_args()
    try:
        tel = NvmlTelemetry().open()
    except nvml.NvmlError as exc:
        print(f"telemetry_check: {exc}", file=sys.stderr)
        return 2
    phases: list[dict[str, Any]] = []

    def read(phase: str) -> list[Sample]:
        t0 = time.perf_counter()
        samples = tel.read("real-gpu-node", datetime.now(UTC))
        ms = (time.perf_counter() - t0) * 1000
        phases.append(
            {"phase": phase, "read_ms": round(ms, 2), "smi": _smi(), "body": to_wire(samples)}
        )
        return samples

    try:
        inventory = nvml.collect()
        read("idle")
        time.sleep(2)
        idle = read("idle")
        load = subprocess.Popen(
            [sys.executable, "-c", LOAD, str(args.load_seconds)], stdout=subprocess.PIPE, text=True
        )
        assert load.stdout is not None
        started = time.perf_counter()
        line = load.stdout.readline()  # CUDA's start takes seconds: read once it multiplies
        phases.append(
            {
                "phase": "load-start",
                "wait_s": round(time.perf_counter() - started, 2),
                "said": line.strip(),
            }
        )
        time.sleep(min(3.0, args.load_seconds / 2))
        read("load")
        time.sleep(min(2.0, args.load_seconds / 4))
        busy = read("load")
        load.wait(timeout=args.load_seconds + 120)
        time.sleep(3)
        after = read("after")
    finally:
        tel.close()

    problems: list[str] = []
    uuid = inventory["gpus"][0]["uuid"]
    i, b, a = _by_field(idle, uuid), _by_field(busy, uuid), _by_field(after, uuid)
    util = F.GR_ENGINE_ACTIVE if F.GR_ENGINE_ACTIVE in b else F.GPU_UTIL
    if load.returncode != 0:
        problems.append(f"the load exited {load.returncode}")
    for name, got in (("idle", i), ("load", b), ("after", a)):
        for f in (F.FB_USED, F.POWER_USAGE, F.GPU_TEMP, F.TOTAL_ENERGY):
            if f not in got:
                problems.append(f"{name}: {f} missing")
    if b.get(util, 0.0) < 0.5:
        problems.append(f"load: {util} {b.get(util)} < 0.5 while a multiply ran")
    if i.get(util, 1.0) > 0.1:
        problems.append(f"idle: {util} {i.get(util)} > 0.1")
    if b.get(F.FB_USED, 0) <= i.get(F.FB_USED, 0):
        problems.append("load: FB_USED did not grow with the multiply's buffers")
    if b.get(F.POWER_USAGE, 0) <= i.get(F.POWER_USAGE, 0):
        problems.append("load: power did not rise")
    if not i.get(F.TOTAL_ENERGY, 0) < b.get(F.TOTAL_ENERGY, 0) <= a.get(F.TOTAL_ENERGY, 0):
        problems.append("energy is not increasing across the phases")
    smi = phases[4]["smi"]
    if isinstance(smi, list) and smi:
        used = float(smi[0]["memory.used"])
        if abs(used - b.get(F.FB_USED, 0)) > max(64.0, 0.05 * used):
            problems.append(f"load: FB_USED {b.get(F.FB_USED)} MiB, nvidia-smi {used} MiB")
    out = {
        "captured": datetime.now(UTC).isoformat(timespec="seconds"),
        "inventory": inventory,
        "util_field": util,
        "phases": phases,
        "problems": problems,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, sort_keys=True)
    for p in phases:
        if "body" not in p:
            print(p)
            continue
        got = next(
            (
                g["values"]
                for g in p["body"]["samples"]
                if g["gpu_uuid"] == uuid and g["gi_id"] is None
            ),
            {},
        )
        print(p["phase"], f"{p['read_ms']} ms", json.dumps(got, sort_keys=True))
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
