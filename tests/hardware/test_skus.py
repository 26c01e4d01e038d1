"""SKU tables and MIG layout validation."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.errors import ValidationFailed
from proofplane.hardware.skus import (
    ALIASES,
    COMPUTE_SLICES,
    MEMORY_SLICES,
    SKUS,
    MigProfile,
    Sku,
    get_sku,
    layout_errors,
)
from proofplane.model import MigInstance

H100 = SKUS["H100-80GB"]


def mig(*items: str) -> list[MigInstance]:
    """``mig("3g.40gb@0", "3g.40gb@4")``"""
    out = []
    for item in items:
        profile, _, start = item.partition("@")
        out.append(MigInstance(profile, int(start)))
    return out


# --------------------------------------------------------------------------- get_sku


@pytest.mark.parametrize("name", sorted(SKUS))
def test_get_sku_by_name(name):
    sku = get_sku(name)
    assert sku is SKUS[name]
    assert sku.name == name


@pytest.mark.parametrize(
    ("alias", "name"), [("B200", "B200-180GB"), ("H200", "H200-141GB"), ("H100", "H100-80GB")]
)
def test_get_sku_by_alias(alias, name):
    assert get_sku(alias).name == name
    assert ALIASES[alias] == name


@pytest.mark.parametrize("name", ["H300", "", "A100", "h100-80gb", "H100-80GB ", "RTX4090"])
def test_get_sku_unknown(name):
    with pytest.raises(ValidationFailed) as exc:
        get_sku(name)
    err = exc.value
    assert err.code == "unknown_gpu_model"
    assert err.details["model"] == name
    assert err.details["known"] == sorted(SKUS)
    assert repr(name) in err.message


def test_aliases_point_at_real_skus():
    assert set(ALIASES.values()) <= set(SKUS)
    assert not set(ALIASES) & set(SKUS)


# --------------------------------------------------------------------------- SKU tables


@pytest.mark.parametrize("sku", list(SKUS.values()), ids=list(SKUS))
def test_every_sku_has_the_seven_profile_family(sku):
    assert sku.mig_capable
    assert len(sku.mig_profiles) == 7
    names = [p.name for p in sku.mig_profiles]
    assert len(set(names)) == 7
    assert len({p.profile_id for p in sku.mig_profiles}) == 7
    media = [p for p in sku.mig_profiles if p.media_extensions]
    assert len(media) == 1
    assert media[0].name.endswith("+me")
    assert media[0].max_count == 1
    # "+me" is a variant of the smallest profile
    assert media[0].name.removesuffix("+me") in names


@pytest.mark.parametrize("sku", list(SKUS.values()), ids=list(SKUS))
def test_profile_geometry_fits_the_gpu(sku):
    for p in sku.mig_profiles:
        assert p.starts, p.name
        assert p.name.startswith(f"{p.compute_slices}g.")
        for s in p.starts:
            assert s >= 0 and s + p.mem_slices <= MEMORY_SLICES, (p.name, s)
        # max_count never promises more instances than fit side by side
        assert p.max_count * p.compute_slices <= COMPUTE_SLICES, p.name
        assert p.max_count * p.mem_slices <= MEMORY_SLICES, p.name
    full = sku.profile(f"7g.{sku.memory_mb // 1024}gb")
    assert full is not None, "the 7g profile is named by the GPU's memory"
    assert (full.compute_slices, full.mem_slices, full.starts) == (7, 8, (0,))


def test_profile_lookup():
    assert H100.profile("3g.40gb") == MigProfile("3g.40gb", 9, 3, 4, 2, (0, 4))
    assert H100.profile("3g.71gb") is None
    assert H100.profile("") is None


def test_sku_without_profiles_is_not_mig_capable():
    assert not Sku("L40S", 46_068, ()).mig_capable


# --------------------------------------------------------------------------- layout_errors


VALID_LAYOUTS = {
    "empty": [],
    "2x3g": mig("3g.40gb@0", "3g.40gb@4"),
    "7x1g": mig(*(f"1g.10gb@{s}" for s in range(7))),
    "4g+2g+1g": mig("4g.40gb@0", "2g.20gb@4", "1g.10gb@6"),
    "7g": mig("7g.80gb@0"),
    "4x1g-double": mig("1g.20gb@0", "1g.20gb@2", "1g.20gb@4", "1g.20gb@6"),
    "3x2g+1g-double": mig("2g.20gb@0", "2g.20gb@2", "2g.20gb@4", "1g.20gb@6"),
    "me+1g+3g": mig("1g.10gb+me@0", "1g.10gb@1", "3g.40gb@4"),
    "4g+3g": mig("4g.40gb@0", "3g.40gb@4"),
    "unordered": mig("1g.10gb@6", "3g.40gb@0", "2g.20gb@4"),
}


@pytest.mark.parametrize("layout", list(VALID_LAYOUTS.values()), ids=list(VALID_LAYOUTS))
def test_valid_layouts(layout):
    assert layout_errors(H100, layout) == []


def test_layout_errors_accepts_any_iterable():
    assert layout_errors(H100, (i for i in VALID_LAYOUTS["2x3g"])) == []
    assert layout_errors(H100, tuple(VALID_LAYOUTS["7x1g"])) == []


@pytest.mark.parametrize("sku", list(SKUS.values()), ids=list(SKUS))
def test_valid_layouts_on_every_sku_by_profile_position(sku):
    one, me, one_double, two, three, four, seven = (p.name for p in sku.mig_profiles)
    layouts = [
        [MigInstance(three, 0), MigInstance(three, 4)],
        [MigInstance(one, s) for s in range(7)],
        [MigInstance(four, 0), MigInstance(two, 4), MigInstance(one, 6)],
        [MigInstance(seven, 0)],
        [MigInstance(one_double, s) for s in (0, 2, 4, 6)],
        [MigInstance(me, 3), MigInstance(three, 4)],
    ]
    for layout in layouts:
        assert layout_errors(sku, layout) == [], layout


@pytest.mark.parametrize(
    ("layout", "fragment"),
    [
        (mig("3g.40gb@2"), "cannot start at slot 2"),
        (mig("4g.40gb@4"), "cannot start at slot 4"),
        (mig("1g.20gb@1"), "cannot start at slot 1"),
        (mig("1g.10gb@7"), "cannot start at slot 7"),
        (mig("2g.20gb@6"), "cannot start at slot 6"),
        (mig("7g.80gb@1"), "cannot start at slot 1"),
        (mig("1g.10gb@8"), "cannot start at slot 8"),
        (mig("1g.10gb@-1"), "cannot start at slot -1"),
        (mig("3g.40gb@0", "2g.20gb@2"), "overlaps memory slot 2"),
        (mig("7g.80gb@0", "1g.10gb@5"), "overlaps memory slot 5"),
        (mig("1g.20gb@6", "1g.10gb@6"), "overlaps memory slot 6"),
        (mig("1g.10gb@3", "1g.10gb@3"), "overlaps memory slot 3"),
        (mig("3g.40gb@0", "3g.40gb@4", "3g.40gb@0"), "3 x 3g.40gb exceeds the maximum of 2"),
        (mig("4g.40gb@0", "4g.40gb@0"), "2 x 4g.40gb exceeds the maximum of 1"),
        (mig("7g.80gb@0", "1g.10gb@0"), "8 compute slices, more than 7"),
        (mig("4g.40gb@0", "4g.40gb@0"), "8 compute slices, more than 7"),
        (mig("3g.40gb@0", "3g.40gb@4", "1g.10gb@0", "1g.10gb@4"), "8 compute slices"),
        (mig("1g.10gb+me@0", "1g.10gb+me@1"), "at most one +me instance per GPU"),
        (mig("1g.10gb+me@0", "1g.10gb+me@1"), "2 x 1g.10gb+me exceeds the maximum of 1"),
        (mig("3g.71gb@0"), "'3g.71gb' is not a MIG profile of H100-80GB"),
        (mig("8g.90gb@0"), "is not a MIG profile"),
        (mig("@0"), "is not a MIG profile"),
    ],
)
def test_invalid_layouts(layout, fragment):
    errors = layout_errors(H100, layout)
    assert errors, layout
    assert any(fragment in e for e in errors), errors


def test_unknown_profile_error_lists_known_profiles():
    (err,) = layout_errors(H100, mig("5g.60gb@0"))
    for p in H100.mig_profiles:
        assert p.name in err


def test_every_problem_is_reported():
    errors = layout_errors(
        H100, mig("3g.40gb@1", "nope@0", "7g.80gb@0", "1g.10gb@2", "1g.10gb+me@3")
    )
    text = "\n".join(errors)
    assert "cannot start at slot 1" in text
    assert "'nope'" in text
    assert "overlaps memory slot 2" in text
    assert "overlaps memory slot 3" in text
    assert "9 compute slices" in text


def test_bad_instances_do_not_count_towards_compute():
    # instances rejected for their start or profile are skipped, not counted
    assert all(
        "compute" not in e for e in layout_errors(H100, mig("7g.80gb@0", "4g.40gb@4", "x@0"))
    )


def test_too_many_of_a_profile_without_overlap():
    # Every real profile's max_count equals its number of disjoint positions, so "too many"
    # always comes with an overlap there; a made-up SKU isolates the count rule.
    sku = Sku("TEST", 1024, (MigProfile("1g.1gb", 1, 1, 1, 1, (0, 4)),))
    assert layout_errors(sku, mig("1g.1gb@0")) == []
    assert layout_errors(sku, mig("1g.1gb@0", "1g.1gb@4")) == [
        "2 x 1g.1gb exceeds the maximum of 1"
    ]


def test_compute_over_seven_without_overlap():
    # With the real tables no disjoint layout exceeds 7 compute slices (the checks below prove
    # it exhaustively for H100); a made-up SKU isolates the compute rule.
    sku = Sku("TEST", 1024, (MigProfile("4g.1gb", 1, 4, 1, 2, (0, 4)),))
    assert layout_errors(sku, mig("4g.1gb@0")) == []
    assert layout_errors(sku, mig("4g.1gb@0", "4g.1gb@4")) == [
        "layout uses 8 compute slices, more than 7"
    ]


@pytest.mark.parametrize("layout", [[], mig("1g.10gb@0")])
def test_mig_on_sku_without_profiles(layout):
    sku = Sku("L40S", 46_068, ())
    assert layout_errors(sku, layout) == ["L40S does not support MIG"]


# --------------------------------------------------------------------------- properties


def _mem_ranges(sku: Sku, layout: list[MigInstance]) -> list[range]:
    out = []
    for inst in layout:
        p = sku.profile(inst.profile)
        assert p is not None
        out.append(range(inst.start, inst.start + p.mem_slices))
    return out


@st.composite
def sku_and_layout(draw):
    sku = draw(st.sampled_from(list(SKUS.values())))
    names = [p.name for p in sku.mig_profiles]
    layout = draw(
        st.lists(
            st.builds(MigInstance, st.sampled_from(names), st.integers(0, 7)),
            max_size=9,
        )
    )
    return sku, layout


@settings(max_examples=600, deadline=None)
@given(sku_and_layout())
def test_layout_errors_agrees_with_geometry(case):
    sku, layout = case
    errors = layout_errors(sku, layout)
    profiles = [sku.profile(i.profile) for i in layout]
    starts_ok = all(i.start in p.starts for i, p in zip(layout, profiles, strict=True))
    if errors == []:
        assert starts_ok
        slots = [s for r in _mem_ranges(sku, layout) for s in r]
        assert len(slots) == len(set(slots)), "memory ranges overlap"
        assert all(0 <= s < MEMORY_SLICES for s in slots)
        assert sum(p.compute_slices for p in profiles) <= COMPUTE_SLICES
        counts = Counter(i.profile for i in layout)
        for p in sku.mig_profiles:
            assert counts[p.name] <= p.max_count
        assert sum(p.media_extensions for p in profiles) <= 1
    elif starts_ok:
        # and the converse: a layout that breaks no rule is never refused
        slots = [s for r in _mem_ranges(sku, layout) for s in r]
        counts = Counter(i.profile for i in layout)
        assert (
            len(slots) != len(set(slots))
            or sum(p.compute_slices for p in profiles) > COMPUTE_SLICES
            or any(counts[p.name] > p.max_count for p in sku.mig_profiles)
            or sum(p.media_extensions for p in profiles) > 1
        ), errors


# --------------------------------------------------------------------------- enumeration


def _placements(sku: Sku, *, media: bool) -> list[MigInstance]:
    return [
        MigInstance(p.name, s)
        for p in sku.mig_profiles
        if media or not p.media_extensions
        for s in p.starts
    ]


def test_h100_layout_count_by_brute_force():
    """Count every non-empty set of (profile, start) placements that layout_errors accepts.

    The 1g.10gb (one memory slot) and 1g.20gb (two memory slots) profiles are distinct; the
    +me variant is left out. 18 placements → 2^18 subsets, each checked by layout_errors and by
    an independent bitmask model of the geometry (disjoint memory, ≤ 7 compute, max counts).

    The project's issue says the 7/8 geometry has 722 layouts; this enumeration finds exactly
    that many, so 722 counts layouts as sets of (profile, start) without +me variants and
    without the empty layout.
    """
    placements = _placements(H100, media=False)
    assert len(placements) == 7 + 4 + 3 + 2 + 1 + 1
    profs = [H100.profile(p.profile) for p in placements]
    masks = [((1 << p.mem_slices) - 1) << i.start for i, p in zip(placements, profs, strict=True)]
    valid = []
    for subset in range(1, 1 << len(placements)):
        chosen = [k for k in range(len(placements)) if subset >> k & 1]
        layout = [placements[k] for k in chosen]
        ok = not layout_errors(H100, layout)
        mem, overlap, compute = 0, False, 0
        counts: Counter[str] = Counter()
        for k in chosen:
            overlap |= bool(mem & masks[k])
            mem |= masks[k]
            compute += profs[k].compute_slices
            counts[profs[k].name] += 1
        model_ok = (
            not overlap
            and compute <= COMPUTE_SLICES
            and all(n <= H100.profile(name).max_count for name, n in counts.items())
        )
        assert ok == model_ok, layout
        if ok:
            valid.append(layout)
    print(f"H100-80GB: {len(valid)} non-empty MIG layouts without +me variants")
    assert len(valid) == 722

    # With the +me variant: at most one +me per GPU, so every layout with one is a layout
    # without one plus a single 1g.10gb+me placement (or that placement alone).
    me = [i for i in _placements(H100, media=True) if i.profile.endswith("+me")]
    with_me = sum(1 for layout in [[], *valid] for m in me if not layout_errors(H100, [*layout, m]))
    print(f"H100-80GB: {with_me} more layouts with a +me instance, {722 + with_me} in all")
    assert with_me == 1596
    # the 7 compute slices are never exceeded by a disjoint layout (so the compute rule only
    # ever fires together with an overlap on the real tables)
    assert max(sum(H100.profile(i.profile).compute_slices for i in v) for v in valid) == 7
