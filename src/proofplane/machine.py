"""What a benchmark or simulation ran on, printed with every figure (these machines are noisy:
the load average says how quiet a run was)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """CPU model, cores (all and usable), load average, Python and platform."""
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cores_usable": usable,
        "load_avg": load,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
