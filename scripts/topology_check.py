#!/usr/bin/env python3
"""Read this machine's NVLink fabric through NVML as the agent's inventory collector does
(issue 17 §4: a node's ``nvlink_domain`` comes from hardware) and print what it found beside
the raw ``nvmlDeviceGetGpuFabricInfo`` answer per GPU. Read-only. Run on a node with the NVIDIA
driver and ``nvidia-ml-py``::

    PYTHONPATH=src python3 scripts/topology_check.py

A GPU outside a multi-node NVLink system answers NOT_SUPPORTED (an error, or success with
state NVML_GPU_FABRIC_STATE_NOT_SUPPORTED): the inventory then carries no ``fabric`` and no
``topology``, and the collector must not fail. On the lent H100 80GB HBM3 (driver 580.159.04,
2026-11-27) the raw call succeeded with state 0 (NOT_SUPPORTED), clique 0 and a zero cluster
UUID, as ``nvidia-smi -q`` (Fabric State N/A) says; ``tests/hardware/test_nvml.py`` replays it.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from proofplane.hardware import nvml


def raw() -> list[dict[str, Any]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = pynvml.c_nvmlGpuFabricInfo_t()
            try:
                pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
                out.append({"index": i, "cluster_uuid": bytes(info.clusterUuid).hex(),
                            "clique_id": info.cliqueId, "state": info.state,
                            "status": info.status})  # fmt: skip
            except pynvml.NVMLError as exc:
                out.append({"index": i, "error": str(exc)})
        return out
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    inv = nvml.collect()
    doc = {
        "raw_fabric": raw(),
        "inventory_topology": inv.get("topology"),
        "gpus": [
            {"index": g["index"], "name": g["name"], "fabric": g.get("fabric")} for g in inv["gpus"]
        ],  # fmt: skip
    }
    json.dump(doc, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
