"""Real software TPMs for tests and benchmarks: swtpm (socket mode) driven with tpm2-tools.

The harness lives in :mod:`proofplane.agent.tpm.swtpm` (``proofplane up`` runs its demo's swtpm
nodes with it); this module keeps the names the tests and ``bench/attest.py`` import.
"""

from __future__ import annotations

from typing import Any

from proofplane.agent.tpm.swtpm import (
    AK_HANDLES,
    EK_HANDLE,
    TOOLS,
    SwtpmNode,
    TpmToolError,
    boot_log,
    manufacture,
    measure,
    missing_tools,
)
from proofplane.attest import eventlog as el

# A node's GPU inventory as the agent reports it: one H100 on the allow-listed VBIOS/driver.
INVENTORY = {
    "driver_version": "550.54.15",
    "gpus": [{"index": 0, "uuid": "GPU-a0", "name": "NVIDIA H100 80GB HBM3",
              "vbios_version": "96.00.99.00.01", "driver_version": "550.54.15"}],
}  # fmt: skip


def golden_policy(log: bytes) -> dict[str, Any]:
    parsed = el.parse_eventlog(log)
    golden = el.replay(parsed, ["sha256"])["sha256"]
    apps = sorted(
        e.digests["sha256"].hex()
        for e in parsed.events
        if e.type == el.EV_EFI_BOOT_SERVICES_APPLICATION
    )
    return {
        "id": "h100-golden",
        "node_class": "default",
        "golden_pcrs": {str(i): [v.hex()] for i, v in golden.items()},
        "allowed_boot_apps": apps,
        "allowed_vbios": ["96.00.99.00.01"],
        "min_driver": "550.54.0",
        "max_quote_age_s": 60,
    }


def node_body(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "region": "eu-frankfurt",
        "zone": "eu-frankfurt-1a",
        "gpus": [{"index": 0, "uuid": f"GPU-{name}-0", "model": "H100-80GB"}],
    }


__all__ = [
    "AK_HANDLES",
    "INVENTORY",
    "golden_policy",
    "node_body",
    "EK_HANDLE",
    "TOOLS",
    "SwtpmNode",
    "TpmToolError",
    "boot_log",
    "manufacture",
    "measure",
    "missing_tools",
]
