"""Real software TPMs for tests and benchmarks: swtpm (socket mode) driven with tpm2-tools.

The harness lives in :mod:`proofplane.agent.tpm.swtpm` (``proofplane up`` runs its demo's swtpm
nodes with it); this module keeps the names the tests and ``bench/attest.py`` import.
"""

from __future__ import annotations

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

__all__ = [
    "AK_HANDLES",
    "EK_HANDLE",
    "TOOLS",
    "SwtpmNode",
    "TpmToolError",
    "boot_log",
    "manufacture",
    "measure",
    "missing_tools",
]
