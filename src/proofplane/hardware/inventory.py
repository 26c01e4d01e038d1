"""Checks on a node's GPU inventory, whoever reports it (cluster file, API, later the agent)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from proofplane.errors import ValidationFailed
from proofplane.hardware.skus import ALIASES, PLAIN_MODEL, SKUS, get_sku, layout_errors
from proofplane.model import Gpu

MAX_MEMORY_MB = 16 * 1024 * 1024  # 16 TiB: far beyond any GPU, well inside a 32-bit column


def normalize_gpus(gpus: Sequence[Gpu]) -> tuple[Gpu, ...]:
    """Validate an inventory and fill what the SKU implies (canonical model name, memory).

    Raises ValidationFailed listing every problem, so one round trip fixes a whole file.
    """
    problems: list[str] = []
    out: list[Gpu] = []
    for dup, n in Counter(g.index for g in gpus).items():
        if n > 1:
            problems.append(f"GPU index {dup} appears {n} times")
    for dup, n in Counter(g.uuid for g in gpus).items():
        if n > 1:
            problems.append(f"GPU UUID {dup} appears {n} times")
    for gpu in gpus:
        where = f"GPU {gpu.index}"
        if not 0 <= gpu.index <= 255:
            problems.append(f"{where}: index must be between 0 and 255")
        if not gpu.uuid or len(gpu.uuid) > 64:
            problems.append(f"{where}: uuid must be 1 to 64 characters")
        for what, text in (
            ("vbios_version", gpu.vbios_version),
            ("driver_version", gpu.driver_version),
        ):
            if text is not None and not 1 <= len(text) <= 63:
                problems.append(f"{where}: {what} must be 1 to 63 characters")
        sku = SKUS.get(ALIASES.get(gpu.model, gpu.model))
        if sku is None and (gpu.mig_enabled or not PLAIN_MODEL.fullmatch(gpu.model)):
            try:  # a MIG GPU needs a known SKU; a plain GPU may be any plain model (issue 17)
                get_sku(gpu.model)
            except ValidationFailed as exc:
                known = ", ".join(exc.details["known"])
                problems.append(f"{where}: {exc.message} (known: {known})")
            continue
        if not 0 <= gpu.memory_mb <= MAX_MEMORY_MB:
            problems.append(f"{where}: memory_mb must be between 0 and {MAX_MEMORY_MB}")
        if gpu.mig_instances and not gpu.mig_enabled:
            problems.append(f"{where}: has MIG instances but MIG is not enabled")
        if gpu.mig_enabled and sku is not None:
            problems.extend(f"{where}: {e}" for e in layout_errors(sku, gpu.mig_instances))
        out.append(
            replace(
                gpu,
                model=sku.name if sku is not None else gpu.model,
                memory_mb=gpu.memory_mb or (sku.memory_mb if sku is not None else 0),
                mig_instances=tuple(sorted(gpu.mig_instances, key=lambda i: i.start)),
            )
        )
    if problems:
        raise ValidationFailed("invalid GPU inventory", code="invalid_inventory", details=problems)
    return tuple(sorted(out, key=lambda g: g.index))
