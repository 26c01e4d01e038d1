"""GPU SKUs and their MIG profile tables (versioned data, pure lookups).

On a real node the agent reads the profiles through NVML; these tables serve simulation, the
demo cluster and tests. Geometry follows NVIDIA's MIG user guide: 7 compute slices and 8 memory
slices per GPU; a profile may start only at its listed memory slots and occupies ``mem_slices``
consecutive memory slots from there.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from proofplane.errors import ValidationFailed
from proofplane.model.node import MigInstance

TABLE_VERSION = "2026.11-1"
COMPUTE_SLICES = 7
MEMORY_SLICES = 8


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str
    profile_id: int  # the ID `nvidia-smi mig -lgip` prints and `-cgi` accepts
    compute_slices: int
    mem_slices: int
    max_count: int
    starts: tuple[int, ...]

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")


@dataclass(frozen=True, slots=True)
class Sku:
    name: str
    memory_mb: int
    mig_profiles: tuple[MigProfile, ...]

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, name: str) -> MigProfile | None:
        for p in self.mig_profiles:
            if p.name == name:
                return p
        return None


def _profiles(gb1: int, gb2: int, gb3: int, gb7: int) -> tuple[MigProfile, ...]:
    """The seven-profile family every supported SKU shares, named by its memory sizes."""
    return (
        MigProfile(f"1g.{gb1}gb", 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile(f"1g.{gb1}gb+me", 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile(f"1g.{gb2}gb", 15, 1, 2, 4, (0, 2, 4, 6)),
        MigProfile(f"2g.{gb2}gb", 14, 2, 2, 3, (0, 2, 4)),
        MigProfile(f"3g.{gb3}gb", 9, 3, 4, 2, (0, 4)),
        MigProfile(f"4g.{gb3}gb", 5, 4, 4, 1, (0,)),
        MigProfile(f"7g.{gb7}gb", 0, 7, 8, 1, (0,)),
    )


SKUS: dict[str, Sku] = {
    s.name: s
    for s in (
        Sku("A100-40GB", 40_960, _profiles(5, 10, 20, 40)),
        Sku("A100-80GB", 81_920, _profiles(10, 20, 40, 80)),
        Sku("H100-80GB", 81_920, _profiles(10, 20, 40, 80)),
        Sku("H100-NVL-94GB", 96_256, _profiles(12, 24, 47, 94)),
        Sku("H200-141GB", 144_384, _profiles(18, 35, 71, 141)),
        Sku("B200-180GB", 184_320, _profiles(23, 45, 90, 180)),
    )
}
# Short names people type (the issue texts and cluster files say "B200").
ALIASES = {"B200": "B200-180GB", "H200": "H200-141GB", "H100": "H100-80GB"}


PLAIN_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,62}")


def plain_model(name: str) -> str:
    """A GPU model that is not one of the MIG SKUs (issue 17: the openb trace's T4, P100, …),
    allowed as a plain (non-MIG) model: the name as given, if it is a plain identifier (1 to
    63 letters, digits, ``._+-``); ValidationFailed ``unknown_gpu_model`` otherwise."""
    if not PLAIN_MODEL.fullmatch(name):
        raise ValidationFailed(
            f"unknown GPU model {name!r}: not a known SKU, nor a plain model name (1 to 63 "
            "letters, digits, '._+-')",
            code="unknown_gpu_model",
            details={"model": name, "known": sorted(SKUS)},
        )
    return name


def canonical_model(name: str) -> str:
    """A SKU's canonical name, or a plain model's own (``plain_model``)."""
    sku = SKUS.get(ALIASES.get(name, name))
    return sku.name if sku is not None else plain_model(name)


def get_sku(name: str) -> Sku:
    """Look a SKU up by its name or alias; ValidationFailed lists the known ones."""
    sku = SKUS.get(ALIASES.get(name, name))
    if sku is None:
        raise ValidationFailed(
            f"unknown GPU model {name!r}",
            code="unknown_gpu_model",
            details={"model": name, "known": sorted(SKUS)},
        )
    return sku


def layout_errors(sku: Sku, instances: Iterable[MigInstance]) -> list[str]:
    """Every reason ``instances`` is not a layout the GPU can hold (empty list: valid)."""
    errors: list[str] = []
    if not sku.mig_capable:
        return [f"{sku.name} does not support MIG"]
    used_mem = [False] * MEMORY_SLICES
    compute = 0
    counts: Counter[str] = Counter()
    media = 0
    for inst in instances:
        prof = sku.profile(inst.profile)
        if prof is None:
            known = ", ".join(p.name for p in sku.mig_profiles)
            errors.append(f"{inst.profile!r} is not a MIG profile of {sku.name} ({known})")
            continue
        if inst.start not in prof.starts:
            errors.append(f"{prof.name} cannot start at slot {inst.start} (allowed {prof.starts})")
            continue
        counts[prof.name] += 1
        compute += prof.compute_slices
        media += prof.media_extensions
        for slot in range(inst.start, inst.start + prof.mem_slices):
            if used_mem[slot]:
                errors.append(f"{prof.name}@{inst.start} overlaps memory slot {slot}")
                break
            used_mem[slot] = True
    for name, n in counts.items():
        prof = sku.profile(name)
        assert prof is not None
        if n > prof.max_count:
            errors.append(f"{n} x {name} exceeds the maximum of {prof.max_count}")
    if compute > COMPUTE_SLICES:
        errors.append(f"layout uses {compute} compute slices, more than {COMPUTE_SLICES}")
    if media > 1:
        errors.append("at most one +me instance per GPU")
    return errors
