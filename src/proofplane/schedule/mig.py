"""On-demand MIG repartitioning: which layout an idle GPU should get to serve a request.

NVIDIA's mig-parted applies static layouts; its users' top request (gpu-operator#361) is to
change them on demand. Here the scheduler may give an *idle* MIG-enabled GPU (nothing placed on
any of its instances) a new layout when a pending MIG request fits no existing instance. A GPU
holding work is never touched; that rule lives in the engine, which alone knows usage.

The layout chosen (``layout_for``) is, among every valid layout of the SKU (per
``hardware.skus.layout_errors``) that holds the wanted instances:

1. one with as few instances of the requested profile as still serve the request (the rest of
   the GPU is not carved into small slices nobody asked for);
2. then the one using the most compute slices (nothing stranded);
3. then the one whose other instances are largest (sorted sizes compared from the largest):
   a 4g next to a 1g keeps a 4g-sized request placeable, three 1g would not;
4. then the lowest start slots, so the answer is deterministic.

``+me`` (media-extension) profiles are never added unless asked for.
"""

from __future__ import annotations

from functools import lru_cache

from proofplane.hardware.skus import COMPUTE_SLICES, MEMORY_SLICES, Sku, get_sku
from proofplane.model import MigInstance

Layout = tuple[MigInstance, ...]


@lru_cache(maxsize=32)
def valid_layouts(sku_name: str) -> tuple[Layout, ...]:
    """Every valid non-empty layout of the SKU, each sorted by start slot."""
    sku = get_sku(sku_name)
    profiles = sorted(sku.mig_profiles, key=lambda p: p.name)
    out: list[Layout] = []

    def walk(slot: int, used: list[bool], compute: int, media: int, acc: list[MigInstance]) -> None:
        if slot == MEMORY_SLICES:
            if acc:
                out.append(tuple(acc))
            return
        walk(slot + 1, used, compute, media, acc)  # leave this memory slot empty
        if used[slot]:
            return
        for p in profiles:
            end = slot + p.mem_slices
            if slot not in p.starts or end > MEMORY_SLICES or any(used[slot:end]):
                continue
            if compute + p.compute_slices > COMPUTE_SLICES:
                continue
            if p.media_extensions and media:
                continue
            if sum(1 for i in acc if i.profile == p.name) >= p.max_count:
                continue
            for s in range(slot, end):
                used[s] = True
            acc.append(MigInstance(p.name, slot))
            walk(end, used, compute + p.compute_slices, media + p.media_extensions, acc)
            acc.pop()
            for s in range(slot, end):
                used[s] = False

    walk(0, [False] * MEMORY_SLICES, 0, 0, [])
    # A layout reached twice (an empty slot skipped at different depths) is kept once.
    return tuple(dict.fromkeys(out))


def _compute(sku: Sku, inst: MigInstance) -> int:
    prof = sku.profile(inst.profile)
    return prof.compute_slices if prof is not None else 0


@lru_cache(maxsize=1024)
def layout_for(sku_name: str, profile: str, wanted: int) -> Layout | None:
    """The layout an idle GPU of ``sku_name`` should get to offer ``wanted`` instances of
    ``profile`` (fewer when one GPU cannot hold that many: as many as it can); None when the
    SKU has no such profile. Memoised: a value of its arguments alone (the repartitioning
    step asks it for every idle GPU it considers)."""
    sku = get_sku(sku_name)
    prof = sku.profile(profile)
    if prof is None or wanted < 1:
        return None
    target = min(wanted, prof.max_count)
    best: tuple[tuple[object, ...], Layout] | None = None
    for layout in valid_layouts(sku.name):
        n = sum(1 for i in layout if i.profile == profile)
        if n == 0:
            continue
        if any(i.profile.endswith("+me") and i.profile != profile for i in layout):
            continue
        others = sorted((_compute(sku, i) for i in layout if i.profile != profile), reverse=True)
        key = (
            # as many as wanted (up to target), and no more than that
            -min(n, target),
            n,
            -sum(_compute(sku, i) for i in layout),
            tuple(-c for c in others),
            tuple((i.start, i.profile) for i in layout),
        )
        if best is None or key < best[0]:
            best = (key, layout)
    return best[1] if best is not None else None
