"""The pure domain model: tag and name validation, node states, isolation, workload states."""

from __future__ import annotations

import itertools

import pytest

from proofplane.errors import ValidationFailed
from proofplane.model import (
    KEEPS_WORK,
    NODE_TRANSITIONS,
    ComplianceProfile,
    GpuRequest,
    IsolationLevel,
    NodeState,
    WorkloadStatus,
    can_transition,
    missing_tags,
    parse_tag_pairs,
    validate_name,
    validate_tags,
)

# --------------------------------------------------------------------------- validate_name


@pytest.mark.parametrize(
    "name",
    ["a", "node-1", "fra-h100-01", "st-marys-hospital", "a1", "a" * 63, "a" + "-" * 61 + "b"],
)
def test_validate_name_accepts_dns_labels(name):
    assert validate_name(name, "node") == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "1node",  # must start with a letter
        "-node",
        "node-",  # must end with a letter or digit
        "Node",  # lowercase only
        "node_1",
        "node.1",
        "node 1",
        "nöde",
        "a" * 64,  # at most 63 characters
        "node/1",
    ],
)
def test_validate_name_rejects_bad_names(name):
    with pytest.raises(ValidationFailed) as exc:
        validate_name(name, "tenant")
    assert exc.value.code == "invalid_name"
    assert exc.value.details == {"name": name}
    assert "tenant" in exc.value.message
    assert repr(name) in exc.value.message


@pytest.mark.parametrize("name", [None, 5, b"node", ["node"]])
def test_validate_name_rejects_non_strings(name):
    with pytest.raises(ValidationFailed) as exc:
        validate_name(name, "node")  # type: ignore[arg-type]
    assert exc.value.code == "invalid_name"


# regression: a regex ending in "$" also matches before a trailing newline
@pytest.mark.parametrize("name", ["node\n", "a\n", "\nnode"])
def test_validate_name_rejects_trailing_newline(name):
    with pytest.raises(ValidationFailed):
        validate_name(name, "node")


# --------------------------------------------------------------------------- validate_tags


def test_validate_tags_returns_sorted_copy():
    tags = {"pci-dss": "isolated", "gdpr-zone": "frankfurt", "hipaa": "true"}
    out = validate_tags(tags)
    assert out == tags
    assert list(out) == ["gdpr-zone", "hipaa", "pci-dss"]
    assert out is not tags
    out["new"] = "x"
    assert "new" not in tags


@pytest.mark.parametrize(
    "tags",
    [
        {},
        {"hipaa": "true"},
        {"gdpr-zone": "Frankfurt"},  # values may carry uppercase
        {"example.com/zone": "eu_1.a-b"},
        {"k": "v"},
        {"a" * 63: "b" * 63},
        {"a1_b.c/d-e": "X"},
    ],
)
def test_validate_tags_accepts_good_pairs(tags):
    assert validate_tags(tags) == tags


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Hipaa", "true"),  # keys are lowercase
        ("", "true"),
        ("-hipaa", "true"),
        ("hipaa-", "true"),
        ("hip aa", "true"),
        ("hipaa=x", "true"),
        ("a" * 64, "true"),
        ("hipaa", ""),  # empty values are refused
        ("hipaa", "-true"),
        ("hipaa", "true-"),
        ("hipaa", "tr ue"),
        ("hipaa", "a/b"),  # '/' only in keys
        ("hipaa", "b" * 64),
        ("hipaa", "ümlaut"),
        (5, "true"),
        ("hipaa", True),
        ("hipaa", 1),
        ("hipaa", None),
    ],
)
def test_validate_tags_rejects_bad_pair(key, value):
    with pytest.raises(ValidationFailed) as exc:
        validate_tags({key: value})
    assert exc.value.code == "invalid_tag"
    bad = exc.value.details["tags"]
    assert len(bad) == 1
    assert repr(key) in bad[0]


def test_validate_tags_names_every_bad_pair_and_no_good_one():
    tags = {"hipaa": "true", "Bad-Key": "x", "good": "ok", "zone": "bad value"}
    with pytest.raises(ValidationFailed) as exc:
        validate_tags(tags, field="certifications")
    err = exc.value
    assert err.code == "invalid_tag"
    assert "certifications" in err.message
    assert list(err.details) == ["certifications"]
    bad = err.details["certifications"]
    assert len(bad) == 2
    text = " ".join(bad)
    assert "'Bad-Key'" in text
    assert "'bad value'" in text and "'zone'" in text
    assert "'hipaa'" not in text and "'good'" not in text


# regression: "hipaa\n=true" must fail loudly, not silently never match "hipaa=true"
@pytest.mark.parametrize("tags", [{"hipaa\n": "true"}, {"hipaa": "true\n"}])
def test_validate_tags_rejects_trailing_newline(tags):
    with pytest.raises(ValidationFailed) as exc:
        validate_tags(tags)
    assert exc.value.code == "invalid_tag"


def test_parse_tag_pairs_rejects_trailing_newline():
    with pytest.raises(ValidationFailed) as exc:
        parse_tag_pairs(["hipaa=true\n"])
    assert exc.value.code == "invalid_tag"


# --------------------------------------------------------------------------- parse_tag_pairs


def test_parse_tag_pairs_parses_cli_form():
    out = parse_tag_pairs(["pci-dss=isolated", "hipaa=true", "gdpr-zone=frankfurt"])
    assert out == {"gdpr-zone": "frankfurt", "hipaa": "true", "pci-dss": "isolated"}
    assert list(out) == sorted(out)


def test_parse_tag_pairs_empty_and_generator():
    assert parse_tag_pairs([]) == {}
    assert parse_tag_pairs(p for p in ["a=b"]) == {"a": "b"}


def test_parse_tag_pairs_same_pair_twice_is_fine():
    assert parse_tag_pairs(["hipaa=true", "hipaa=true"]) == {"hipaa": "true"}


@pytest.mark.parametrize("pair", ["hipaa", "hipaa:true", ""])
def test_parse_tag_pairs_requires_equals(pair):
    with pytest.raises(ValidationFailed) as exc:
        parse_tag_pairs(["ok=yes", pair], field="certification")
    assert exc.value.code == "invalid_tag"
    assert exc.value.details == {"certification": [pair]}
    assert "key=value" in exc.value.message


def test_parse_tag_pairs_rejects_conflicting_values():
    with pytest.raises(ValidationFailed) as exc:
        parse_tag_pairs(["gdpr-zone=frankfurt", "gdpr-zone=paris"])
    assert exc.value.code == "invalid_tag"
    assert exc.value.details == {"tags": ["gdpr-zone=paris"]}
    assert "twice" in exc.value.message


@pytest.mark.parametrize(
    ("pairs", "named"),
    [
        (["=true"], "''"),
        (["hipaa="], "''"),
        (["a=b=c"], "'b=c'"),  # only the first '=' splits; the value then is invalid
        (["HIPAA=true"], "'HIPAA'"),
    ],
)
def test_parse_tag_pairs_validates_keys_and_values(pairs, named):
    with pytest.raises(ValidationFailed) as exc:
        parse_tag_pairs(pairs)
    assert exc.value.code == "invalid_tag"
    assert named in exc.value.details["tags"][0]


def test_parse_tag_pairs_names_all_bad_pairs():
    with pytest.raises(ValidationFailed) as exc:
        parse_tag_pairs(["Bad=1", "ok=1", "also bad=2"], field="labels")
    bad = exc.value.details["labels"]
    assert len(bad) == 2
    assert any("'Bad'" in b for b in bad)
    assert any("'also bad'" in b for b in bad)


# --------------------------------------------------------------------------- missing_tags


@pytest.mark.parametrize(
    ("required", "held", "missing"),
    [
        ({}, {}, {}),
        ({}, {"hipaa": "true"}, {}),
        ({"hipaa": "true"}, {"hipaa": "true", "x": "y"}, {}),
        ({"hipaa": "true"}, {}, {"hipaa": "true"}),
        ({"hipaa": "true"}, {"hipaa": "false"}, {"hipaa": "true"}),
        ({"hipaa": "true"}, {"hipaa": "True"}, {"hipaa": "true"}),  # exact value match
        (
            {"gdpr-zone": "paris", "hipaa": "true"},
            {"gdpr-zone": "frankfurt", "hipaa": "true"},
            {"gdpr-zone": "paris"},
        ),
    ],
)
def test_missing_tags(required, held, missing):
    assert missing_tags(required, held) == missing


# --------------------------------------------------------------------------- NodeState


def test_every_state_has_a_transition_entry():
    assert set(NODE_TRANSITIONS) == set(NodeState)


def test_decommissioned_is_terminal():
    for target in NodeState:
        assert not can_transition(NodeState.DECOMMISSIONED, target)


@pytest.mark.parametrize("state", [s for s in NodeState if s is not NodeState.DECOMMISSIONED])
def test_every_other_state_can_be_left(state):
    targets = [t for t in NodeState if can_transition(state, t)]
    assert targets
    assert can_transition(state, NodeState.DECOMMISSIONED)
    assert can_transition(state, NodeState.FAILED) or state is NodeState.FAILED


@pytest.mark.parametrize("state", list(NodeState))
def test_no_self_transitions(state):
    assert not can_transition(state, state)


def test_nothing_goes_back_to_registered():
    assert not any(can_transition(s, NodeState.REGISTERED) for s in NodeState)


@pytest.mark.parametrize(
    ("current", "target", "allowed"),
    [
        (NodeState.REGISTERED, NodeState.ADMITTED, True),
        (NodeState.REGISTERED, NodeState.CORDONED, False),
        (NodeState.ADMITTED, NodeState.CORDONED, True),
        (NodeState.CORDONED, NodeState.ADMITTED, True),
        (NodeState.ADMITTED, NodeState.QUARANTINED, True),
        (NodeState.QUARANTINED, NodeState.ADMITTED, True),
        (NodeState.QUARANTINED, NodeState.CORDONED, False),
        (NodeState.FAILED, NodeState.ADMITTED, True),
        (NodeState.FAILED, NodeState.CORDONED, False),
        (NodeState.DECOMMISSIONED, NodeState.ADMITTED, False),
    ],
)
def test_can_transition_examples(current, target, allowed):
    assert can_transition(current, target) is allowed


def test_can_transition_matches_table_for_all_pairs():
    for a, b in itertools.product(NodeState, NodeState):
        assert can_transition(a, b) == (b in NODE_TRANSITIONS[a])


def test_keeps_work_only_admitted_and_cordoned():
    assert frozenset({NodeState.ADMITTED, NodeState.CORDONED}) == KEEPS_WORK


# --------------------------------------------------------------------------- IsolationLevel


ORDER = [
    IsolationLevel.SHARED,
    IsolationLevel.MIG,
    IsolationLevel.EXCLUSIVE_GPU,
    IsolationLevel.DEDICATED_NODE,
]


def test_isolation_ranks_weakest_first():
    assert [lvl.rank for lvl in ORDER] == [0, 1, 2, 3]
    assert sorted(IsolationLevel, key=lambda lvl: lvl.rank) == ORDER


def test_isolation_values_are_wire_strings():
    assert [str(lvl) for lvl in ORDER] == ["shared", "mig", "exclusive-gpu", "dedicated-node"]
    assert IsolationLevel("dedicated-node") is IsolationLevel.DEDICATED_NODE


@pytest.mark.parametrize(("a", "b"), list(itertools.product(ORDER, ORDER)))
def test_at_least_is_the_stricter(a, b):
    expected = ORDER[max(ORDER.index(a), ORDER.index(b))]
    assert a.at_least(b) is expected
    assert b.at_least(a) is expected


# --------------------------------------------------------------------------- ComplianceProfile


def test_default_profile_floor_is_shared():
    assert ComplianceProfile().minimum_for({"hipaa": "true"}) is IsolationLevel.SHARED


def test_minimum_for_raises_floor_by_rule():
    profile = ComplianceProfile(
        required_tags={"pci-dss": "isolated"},
        min_isolation=IsolationLevel.EXCLUSIVE_GPU,
        isolation_rules={"pci-dss=isolated": IsolationLevel.DEDICATED_NODE},
    )
    assert profile.minimum_for({"pci-dss": "isolated"}) is IsolationLevel.DEDICATED_NODE
    assert profile.minimum_for({"pci-dss": "other"}) is IsolationLevel.EXCLUSIVE_GPU
    assert profile.minimum_for({}) is IsolationLevel.EXCLUSIVE_GPU
    # the key alone does not match: the rule names a key=value pair
    assert profile.minimum_for({"pci-dss": "isolated-not"}) is IsolationLevel.EXCLUSIVE_GPU


def test_minimum_for_rule_never_lowers_floor():
    profile = ComplianceProfile(
        min_isolation=IsolationLevel.EXCLUSIVE_GPU,
        isolation_rules={"hipaa=true": IsolationLevel.SHARED},
    )
    assert profile.minimum_for({"hipaa": "true"}) is IsolationLevel.EXCLUSIVE_GPU


def test_minimum_for_takes_strictest_matching_rule():
    profile = ComplianceProfile(
        min_isolation=IsolationLevel.SHARED,
        isolation_rules={
            "hipaa=true": IsolationLevel.MIG,
            "pci-dss=isolated": IsolationLevel.DEDICATED_NODE,
            "gdpr-zone=paris": IsolationLevel.EXCLUSIVE_GPU,
        },
    )
    assert profile.minimum_for({"hipaa": "true"}) is IsolationLevel.MIG
    assert (
        profile.minimum_for({"hipaa": "true", "gdpr-zone": "paris"}) is IsolationLevel.EXCLUSIVE_GPU
    )
    assert (
        profile.minimum_for({"hipaa": "true", "gdpr-zone": "paris", "pci-dss": "isolated"})
        is IsolationLevel.DEDICATED_NODE
    )
    assert profile.minimum_for({"gdpr-zone": "frankfurt"}) is IsolationLevel.SHARED


# --------------------------------------------------------------------------- GpuRequest


@pytest.mark.parametrize(
    ("req", "level"),
    [
        (GpuRequest(), IsolationLevel.EXCLUSIVE_GPU),
        (GpuRequest(count=8, model="H100-80GB"), IsolationLevel.EXCLUSIVE_GPU),
        (GpuRequest(mig_profile="3g.40gb"), IsolationLevel.MIG),
        (GpuRequest(count=2, mig_profile="1g.10gb"), IsolationLevel.MIG),
        (GpuRequest(share_milli=250), IsolationLevel.SHARED),
    ],
)
def test_natural_isolation(req, level):
    assert req.natural_isolation is level


def test_gpu_request_defaults_to_one_whole_gpu():
    req = GpuRequest()
    assert (req.count, req.model, req.mig_profile, req.share_milli) == (1, None, None, None)


# --------------------------------------------------------------------------- WorkloadStatus


def test_terminal_statuses():
    assert {s for s in WorkloadStatus if s.is_terminal} == {
        WorkloadStatus.SUCCEEDED,
        WorkloadStatus.FAILED,
        WorkloadStatus.CANCELLED,
    }


def test_capacity_holding_statuses():
    assert {s for s in WorkloadStatus if s.holds_capacity} == {
        WorkloadStatus.PLACED,
        WorkloadStatus.RUNNING,
    }


@pytest.mark.parametrize("status", list(WorkloadStatus))
def test_terminal_statuses_hold_no_capacity(status):
    assert not (status.is_terminal and status.holds_capacity)


def test_pending_neither_terminal_nor_holding():
    assert not WorkloadStatus.PENDING.is_terminal
    assert not WorkloadStatus.PENDING.holds_capacity
