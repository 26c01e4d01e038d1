#!/usr/bin/env python3
"""Check the shipped SKU and MIG tables (``hardware/skus.py``) against this machine's GPUs.

Rule 6 of the house: hardware facts come from hardware, and the shipped per-SKU tables are
checked against what a real GPU reports. Run on a node with the NVIDIA driver and
``nvidia-ml-py``::

    PYTHONPATH=src python3 scripts/nvml_check.py [--json]

It only reads (NVML queries; it never changes MIG mode, instances or any other setting) and
prints, per GPU: the node agent's inventory (``hardware.nvml.collect``), which SKU the name and
memory map to, and for every GPU instance profile the driver knows: its ID, slices, memory,
instance count and possible placements, next to the table's entry. Exit 1 when a profile the
table ships disagrees with the GPU (ID, slices, count or placements), 2 when NVML is missing.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from proofplane.hardware import nvml
from proofplane.hardware.skus import MEMORY_SLICES


def _profiles(nv: Any, handle: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Every GPU instance profile the driver reports for ``handle`` (read-only queries)."""
    out: list[dict[str, Any]] = []
    notes: list[str] = []
    seen: set[int] = set()
    for index in range(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 8)):
        try:
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfoV(handle, index)
            except (AttributeError, TypeError):
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except nv.NVMLError as exc:
            notes.append(f"profile index {index}: {exc}")
            continue
        if int(info.id) in seen:
            continue
        seen.add(int(info.id))
        name = getattr(info, "name", b"")
        name = name.decode() if isinstance(name, bytes) else str(name)
        entry: dict[str, Any] = {
            "index": index,
            "id": int(info.id),
            "name": name.removeprefix("MIG "),
            "slices": int(info.sliceCount),
            "instances": int(info.instanceCount),
            "memory_mb": int(info.memorySizeMB),
            "multiprocessors": int(info.multiprocessorCount),
        }
        try:  # the C signature: a caller-sized array and a count (nvidia-ml-py passes it on)
            places = (nv.c_nvmlGpuInstancePlacement_t * MEMORY_SLICES)()  # at most one a slot
            count = ctypes.c_uint(len(places))
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(
                handle, int(info.id), places, ctypes.byref(count)
            )
            entry["placements"] = sorted(
                (int(places[k].start), int(places[k].size)) for k in range(count.value)
            )
        except Exception as exc:  # MIG off, or an older binding: say so, keep going
            entry["placements_error"] = str(exc)
        out.append(entry)
    return out, notes


def _compare(sku_profiles: Any, real: list[dict[str, Any]]) -> list[str]:
    problems = []
    by_id = {p["id"]: p for p in real}
    for p in sku_profiles:
        got = by_id.get(p.profile_id)
        if got is None:
            problems.append(f"{p.name}: profile id {p.profile_id} not reported by the GPU")
            continue
        if got["name"] and got["name"] != p.name:
            problems.append(f"{p.name}: the GPU names profile {p.profile_id} {got['name']!r}")
        if got["slices"] != p.compute_slices:
            problems.append(f"{p.name}: {got['slices']} slices, table {p.compute_slices}")
        if got["instances"] != p.max_count:
            problems.append(f"{p.name}: at most {got['instances']}, table {p.max_count}")
        if "placements" in got:  # (start, size) pairs; lists when read back from JSON
            have = sorted((int(s), int(n)) for s, n in got["placements"])
            want = sorted((s, p.mem_slices) for s in p.starts)
            if have != want:
                problems.append(f"{p.name}: placements {have}, table {want}")
    return problems


def main(argv: list[str]) -> int:
    try:
        nv = nvml.load()
        inventory = nvml.collect(nv)
    except nvml.NvmlUnavailable as exc:
        print(f"nvml_check: {exc.message}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"inventory": inventory, "gpus": []}
    failed = False
    nv.nvmlInit()
    try:
        for gpu in inventory["gpus"]:
            handle = nv.nvmlDeviceGetHandleByIndex(gpu["index"])
            sku = nvml.sku_for(gpu["name"], gpu["memory_mb"])
            real, notes = _profiles(nv, handle)
            problems = _compare(sku.mig_profiles, real) if sku is not None else []
            failed |= bool(problems)
            report["gpus"].append({
                "index": gpu["index"], "name": gpu["name"], "memory_mb": gpu["memory_mb"],
                "sku": None if sku is None else sku.name,
                "sku_memory_mb": None if sku is None else sku.memory_mb,
                "memory_slices": MEMORY_SLICES, "profiles": real, "notes": notes,
                "problems": problems,
            })  # fmt: skip
    finally:
        nv.nvmlShutdown()
    if "--json" in argv:
        print(json.dumps(report, indent=2, default=str))
    else:
        for g in report["gpus"]:
            print(f"GPU {g['index']}: {g['name']} ({g['memory_mb']} MiB) -> SKU {g['sku']}")
            for p in g["profiles"]:
                where = p.get("placements", p.get("placements_error"))
                print(f"  {p['id']:>3} {p['name']:<14} slices {p['slices']} x{p['instances']}"
                      f" {p['memory_mb']} MiB placements {where}")  # fmt: skip
            for problem in g["problems"]:
                print(f"  MISMATCH {problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
