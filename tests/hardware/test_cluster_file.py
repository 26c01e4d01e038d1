"""Cluster files (parse_cluster, gpu_uuid) and inventory checks (normalize_gpus)."""

from __future__ import annotations

import re
import textwrap
from importlib import resources

import pytest

from proofplane.errors import ValidationFailed
from proofplane.hardware.cluster_file import ClusterSpec, gpu_uuid, parse_cluster
from proofplane.hardware.inventory import MAX_MEMORY_MB, normalize_gpus
from proofplane.hardware.skus import SKUS, get_sku, layout_errors
from proofplane.model import Gpu, GpuRequest, IsolationLevel, MigInstance, NodeState


def demo_text() -> str:
    return (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text()


@pytest.fixture(scope="module")
def demo() -> ClusterSpec:
    return parse_cluster(demo_text())


def parse(text: str) -> ClusterSpec:
    return parse_cluster(textwrap.dedent(text))


def one_node(gpus_yaml: str) -> str:
    return f"nodes:\n  - name: a\n    region: r\n    zone: z\n    gpus:\n{gpus_yaml}"


def invalid(text: str) -> ValidationFailed:
    with pytest.raises(ValidationFailed) as exc:
        parse_cluster(text)
    assert exc.value.code == "invalid_cluster_file"
    return exc.value


# --------------------------------------------------------------------------- the demo cluster


def test_demo_cluster_shape(demo):
    assert demo.name == "demo"
    assert len(demo.nodes) == 24
    assert len({n.node.name for n in demo.nodes}) == 24
    assert len({n.node.region for n in demo.nodes}) >= 3
    assert len(demo.tenants) >= 5
    assert len({t.name for t in demo.tenants}) == len(demo.tenants)
    assert demo.workloads
    assert {w.tenant for w in demo.workloads} <= {t.name for t in demo.tenants}


def test_demo_cluster_has_mig_and_certifications(demo):
    gpus = [g for n in demo.nodes for g in n.node.gpus]
    mig = [g for g in gpus if g.mig_enabled]
    assert mig
    assert len(mig) < len(gpus)
    assert all(g.mig_instances for g in mig)
    assert all(not g.mig_instances for g in gpus if not g.mig_enabled)
    certified = [n for n in demo.nodes if n.certifications]
    assert certified
    certs = {(k, v) for n in demo.nodes for k, v in n.certifications.items()}
    assert {("hipaa", "true"), ("pci-dss", "isolated"), ("gdpr-zone", "frankfurt")} <= certs
    assert ("gdpr-zone", "paris") in certs
    # certifications travel apart from the node: they are granted after admission
    assert all(n.node.certifications == {} for n in demo.nodes)


def test_demo_cluster_states(demo):
    states = {n.node.name: n.state for n in demo.nodes}
    assert states["use-b200-02"] is NodeState.REGISTERED
    assert states["use-a100-02"] is NodeState.CORDONED
    assert states["fra-h100-01"] is NodeState.ADMITTED
    assert all(n.node.state is NodeState.REGISTERED for n in demo.nodes)  # the Node default


def test_demo_gpu_uuids_are_deterministic_and_unique(demo):
    uuids = []
    for spec in demo.nodes:
        for g in spec.node.gpus:
            assert g.uuid == gpu_uuid(spec.node.name, g.index)
            uuids.append(g.uuid)
    assert len(uuids) == len(set(uuids))
    again = parse_cluster(demo_text())
    assert [g.uuid for n in again.nodes for g in n.node.gpus] == uuids


def test_demo_inventories_pass_the_inventory_checks(demo):
    for spec in demo.nodes:
        gpus = normalize_gpus(spec.node.gpus)
        assert [g.index for g in gpus] == list(range(len(gpus)))
        assert all(g.model in SKUS for g in gpus)


def test_demo_mig_layouts(demo):
    nodes = {n.node.name: n.node for n in demo.nodes}
    fra = nodes["fra-h100-01"].gpus
    assert [g.mig_enabled for g in fra] == [True, True] + [False] * 6
    assert fra[0].mig_instances == (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4))
    # no mig_gpus: every GPU of the group is MIG-enabled
    assert all(g.mig_enabled for g in nodes["par-h100-01"].gpus)
    assert [g.mig_enabled for g in nodes["fra-h100-04"].gpus] == [True] * 4 + [False] * 4
    for node in nodes.values():
        for g in node.gpus:
            if g.mig_enabled:
                assert layout_errors(get_sku(g.model), g.mig_instances) == []


def test_demo_gpu_details(demo):
    nodes = {n.node.name: n.node for n in demo.nodes}
    g = nodes["fra-h100-01"].gpus[3]
    assert (g.model, g.vbios_version, g.driver_version) == (
        "H100-80GB",
        "96.00.99.00.01",
        "570.133.20",
    )
    assert g.memory_mb == 0  # filled from the SKU by normalize_gpus, not by the parser
    assert nodes["fra-h100-01"].labels == {"nvlink": "nv18"}
    assert nodes["fra-h100-01"].rack == "fra1-r01"


def test_demo_tenant_profiles(demo):
    tenants = {t.name: t for t in demo.tenants}
    nordbank = tenants["nordbank"].profile
    assert nordbank.required_tags == {"pci-dss": "isolated"}
    assert nordbank.min_isolation is IsolationLevel.EXCLUSIVE_GPU
    assert nordbank.isolation_rules == {"pci-dss=isolated": IsolationLevel.DEDICATED_NODE}
    assert nordbank.minimum_for({"pci-dss": "isolated"}) is IsolationLevel.DEDICATED_NODE
    assert tenants["research-lab"].profile.min_isolation is IsolationLevel.SHARED


def test_demo_workload_requests(demo):
    w = {x.name: x for x in demo.workloads}
    assert w["clinical-notes-ner"].gpus == GpuRequest(2, None, "1g.10gb", None)
    assert w["claims-triage"].gpus == GpuRequest(1, None, None, 250)
    assert w["llm-pretrain"].gpus == GpuRequest(8, "B200-180GB", None, None)
    assert w["radiology-triage"].priority == 100
    # The demo's workloads run a shared harmless loop (YAML anchor) labelled with the job name.
    cmd = w["fraud-scoring"].command
    assert cmd[:2] == ("python3", "-c") and cmd[-1] == "score --stream authorizations"
    assert cmd[2] == w["churn-model"].command[2] and "CUDA_VISIBLE_DEVICES" in cmd[2]
    assert w["fraud-scoring"].isolation is None


# --------------------------------------------------------------------------- gpu_uuid


def test_gpu_uuid():
    u = gpu_uuid("node-a", 0)
    assert re.fullmatch(
        r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u
    )
    assert gpu_uuid("node-a", 0) == u
    assert gpu_uuid("node-a", 1) != u
    assert gpu_uuid("node-b", 0) != u
    # the separator keeps ("n1", 11) and ("n11", 1) apart
    assert gpu_uuid("n1", 11) != gpu_uuid("n11", 1)


# --------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("cluster: demo\nnodes:\n\t- name: x\n", 3),  # a tab cannot indent
        ("cluster: demo\nnodes: [a, b\n", 3),  # unclosed flow sequence
        ("a: b: c\n", 1),
        ("x: !!python/object:os.system {}\n", 1),  # safe loading refuses object tags
    ],
)
def test_invalid_yaml_names_the_line(text, line):
    err = invalid(text)
    assert "not valid YAML" in err.message
    m = re.search(r"line (\d+), column (\d+)", err.message)
    assert m, err.message
    assert int(m.group(1)) == line


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n", "42\n", "null\n"])
def test_top_level_must_be_a_mapping(text):
    err = invalid(text)
    assert "mapping" in err.message


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("clustr: x\n", "clustr"),
        ("tenants:\n  - name: a\n    descr: x\n", "tenants.0.descr"),
        ("tenants:\n  - name: a\n    profile: {required: {a: b}}\n", "tenants.0.profile.required"),
        ("nodes:\n  - {name: a, region: r, zone: z, certs: {}}\n", "nodes.0.certs"),
        (one_node("      - {model: H100, modle: x}\n"), "nodes.0.gpus.0.modle"),
        ("workloads:\n  - {name: w, tenant: t, gpus: {mig: 3g.40gb}}\n", "workloads.0.gpus.mig"),
    ],
)
def test_unknown_keys_are_rejected(text, where):
    err = invalid(text)
    assert err.message == "invalid cluster file"
    assert any(p.startswith(f"{where}:") for p in err.details), err.details


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("nodes:\n  - {name: a, region: r, zone: z, state: quarantined}\n", "nodes.0.state"),
        ("nodes:\n  - {name: a, region: r}\n", "nodes.0.zone"),
        (one_node("      - {model: H100, count: 0}\n"), "nodes.0.gpus.0.count"),
        (one_node("      - {model: H100, count: 17}\n"), "nodes.0.gpus.0.count"),
        (one_node("      - {model: H100, memory_mb: -1}\n"), "nodes.0.gpus.0.memory_mb"),
        (one_node("      - {model: H100, mig_gpus: -1}\n"), "nodes.0.gpus.0.mig_gpus"),
        ("tenants:\n  - {name: a, profile: {min_isolation: max}}\n", "tenants.0.profile"),
        ("nodes: 5\n", "nodes"),
        ("workloads:\n  - {name: w}\n", "workloads.0.tenant"),
    ],
)
def test_structure_errors_name_their_path(text, where):
    err = invalid(text)
    assert any(p.startswith(where) for p in err.details), err.details


def test_all_structure_errors_reported_at_once():
    err = invalid("clustr: x\nnodes:\n  - {name: a, region: r, zone: z, state: gone}\n")
    assert len(err.details) == 2


@pytest.mark.parametrize("item", ["3g.40gb", "3g.40gb@", "3g.40gb@x", "3g.40gb@-1", "@"])
def test_bad_mig_item_syntax(item):
    err = invalid(one_node(f'      - {{model: H100, mig: ["{item}"]}}\n'))
    assert "profile@start" in err.message
    assert "nodes.a.gpus[0]" in err.message
    assert repr(item) in err.message


def test_mig_start_with_non_decimal_digit():
    invalid(one_node('      - {model: H100, mig: ["3g.40gb@²"]}\n'))


def test_parser_leaves_semantic_checks_to_the_services():
    # unknown SKUs and impossible layouts are structurally fine; normalize_gpus refuses them
    spec = parse(one_node('      - {model: H999, count: 1, mig: ["3g.40gb@1"]}\n'))
    gpu = spec.nodes[0].node.gpus[0]
    assert gpu.model == "H999"
    assert gpu.mig_instances == (MigInstance("3g.40gb", 1),)
    with pytest.raises(ValidationFailed) as exc:
        normalize_gpus(spec.nodes[0].node.gpus)
    assert exc.value.code == "invalid_inventory"


def test_defaults():
    spec = parse("nodes:\n  - {name: a, region: r, zone: z}\n")
    assert spec.name == "proofplane"
    assert spec.tenants == () and spec.workloads == ()
    (node,) = spec.nodes
    assert node.state is NodeState.ADMITTED
    assert node.certifications == {}
    assert node.node.gpus == ()


# --------------------------------------------------------------------------- mig_gpus


def _mig_flags(group_yaml: str) -> list[bool]:
    spec = parse(one_node(group_yaml))
    return [g.mig_enabled for g in spec.nodes[0].node.gpus]


LAYOUT = 'mig: ["3g.40gb@0", "3g.40gb@4"]'


def test_mig_gpus_default_is_every_gpu():
    assert _mig_flags(f"      - {{model: H100, count: 3, {LAYOUT}}}\n") == [True] * 3


def test_mig_gpus_takes_the_first_gpus_of_the_group():
    flags = _mig_flags(f"      - {{model: H100, count: 4, {LAYOUT}, mig_gpus: 1}}\n")
    assert flags == [True, False, False, False]


def test_mig_gpus_zero_means_none():
    assert _mig_flags(f"      - {{model: H100, count: 2, {LAYOUT}, mig_gpus: 0}}\n") == [
        False,
        False,
    ]


def test_mig_gpus_without_layout_is_rejected():
    err = invalid(one_node("      - {model: H100, count: 2, mig_gpus: 1}\n"))
    assert "mig_gpus given without a mig layout" in err.message
    assert "nodes.a.gpus[0]" in err.message


def test_no_layout_means_no_mig():
    assert _mig_flags("      - {model: H100, count: 2}\n") == [False, False]
    assert _mig_flags("      - {model: H100, count: 2, mig_gpus: 0}\n") == [False, False]


def test_mig_gpus_apply_per_group_and_indexes_continue():
    spec = parse(
        one_node(
            f"      - {{model: H100, count: 2, {LAYOUT}, mig_gpus: 1}}\n"
            "      - {model: A100-80GB, count: 3, mig: [7g.80gb@0], mig_gpus: 2}\n"
        )
    )
    gpus = spec.nodes[0].node.gpus
    assert [g.index for g in gpus] == [0, 1, 2, 3, 4]
    assert [g.model for g in gpus] == ["H100"] * 2 + ["A100-80GB"] * 3
    assert [g.mig_enabled for g in gpus] == [True, False, True, True, False]
    assert gpus[2].mig_instances == (MigInstance("7g.80gb", 0),)
    assert gpus[1].mig_instances == () and gpus[4].mig_instances == ()
    assert [g.uuid for g in gpus] == [gpu_uuid("a", i) for i in range(5)]


def test_mig_gpus_larger_than_count_is_rejected():
    invalid(one_node(f"      - {{model: H100, count: 2, {LAYOUT}, mig_gpus: 5}}\n"))


# --------------------------------------------------------------------------- normalize_gpus


def gpu(index: int, model: str = "H100-80GB", **kw) -> Gpu:
    kw.setdefault("uuid", f"GPU-{index}")
    kw.setdefault("memory_mb", 0)
    return Gpu(index=index, model=model, **kw)


def test_normalize_fills_from_sku_and_sorts():
    out = normalize_gpus(
        [
            gpu(2, "B200"),
            gpu(
                0,
                "H100",
                mig_enabled=True,
                mig_instances=(MigInstance("3g.40gb", 4), MigInstance("3g.40gb", 0)),
            ),
            gpu(1, "H100-80GB", memory_mb=80_000),
        ]
    )
    assert isinstance(out, tuple)
    assert [g.index for g in out] == [0, 1, 2]
    assert [g.model for g in out] == ["H100-80GB", "H100-80GB", "B200-180GB"]
    assert out[0].memory_mb == 81_920
    assert out[1].memory_mb == 80_000  # a reported size is kept
    assert out[2].memory_mb == 184_320
    assert [i.start for i in out[0].mig_instances] == [0, 4]
    assert out[0].uuid == "GPU-0"


def test_normalize_empty_and_mig_enabled_without_instances():
    assert normalize_gpus([]) == ()
    (g,) = normalize_gpus([gpu(0, mig_enabled=True)])
    assert g.mig_enabled and g.mig_instances == ()


def test_normalize_keeps_plain_models_that_are_not_skus():
    # issue 17: a GPU without MIG may be any plain model (the openb trace's T4, P100, ...)
    (g,) = normalize_gpus([gpu(0, "T4")])
    assert g.model == "T4" and g.memory_mb == 0 and not g.mig_enabled
    with pytest.raises(ValidationFailed) as exc:
        normalize_gpus([gpu(0, "not a model!")])
    assert "unknown GPU model 'not a model!'" in "\n".join(exc.value.details)


def test_normalize_lists_every_problem_at_once():
    gpus = [
        gpu(0),
        gpu(0, uuid="GPU-x"),  # duplicate index
        gpu(1, uuid="GPU-0"),  # duplicate uuid
        gpu(2, "RTX-9000", uuid="GPU-2", mig_enabled=True),  # MIG on a model that is no SKU
        gpu(3, uuid="GPU-3", mig_instances=(MigInstance("3g.40gb", 0),)),  # MIG not enabled
        gpu(
            4,
            uuid="GPU-4",
            mig_enabled=True,
            mig_instances=(MigInstance("3g.40gb", 0), MigInstance("4g.40gb", 0)),
        ),  # invalid layout
    ]
    with pytest.raises(ValidationFailed) as exc:
        normalize_gpus(gpus)
    err = exc.value
    assert err.code == "invalid_inventory"
    problems = err.details
    assert isinstance(problems, list)
    text = "\n".join(problems)
    assert "GPU index 0 appears 2 times" in text
    assert "GPU UUID GPU-0 appears 2 times" in text
    assert "GPU 2: unknown GPU model 'RTX-9000'" in text
    assert "H100-80GB" in text  # the known models are listed
    assert "GPU 3: has MIG instances but MIG is not enabled" in text
    assert "GPU 4: 4g.40gb@0 overlaps memory slot 0" in text
    assert len(problems) == 5


@pytest.mark.parametrize(
    ("g", "fragment"),
    [
        (gpu(-1), "GPU -1: index must be"),
        (gpu(256), "GPU 256: index must be"),
        (gpu(0, uuid=""), "uuid must be 1 to 64 characters"),
        (gpu(0, uuid="G" * 65), "uuid must be 1 to 64 characters"),
        (gpu(0, memory_mb=-5), "memory_mb must be"),
        (gpu(0, memory_mb=MAX_MEMORY_MB + 1), "memory_mb must be"),
        (gpu(0, vbios_version=""), "vbios_version must be 1 to 63 characters"),
        (gpu(0, driver_version="5" * 64), "driver_version must be 1 to 63 characters"),
        (
            gpu(0, mig_enabled=True, mig_instances=(MigInstance("3g.71gb", 0),)),
            "is not a MIG profile of H100-80GB",
        ),
    ],
)
def test_normalize_single_problems(g, fragment):
    with pytest.raises(ValidationFailed) as exc:
        normalize_gpus([g])
    assert exc.value.code == "invalid_inventory"
    assert any(fragment in p for p in exc.value.details), exc.value.details


def test_normalize_accepts_values_at_the_bounds():
    out = normalize_gpus(
        [
            gpu(0, uuid="G" * 64, memory_mb=MAX_MEMORY_MB, vbios_version="9" * 63),
            gpu(255, uuid="x", driver_version="5"),
        ]
    )
    assert [g.index for g in out] == [0, 255]
    assert out[0].uuid == "G" * 64
    assert out[0].memory_mb == MAX_MEMORY_MB


def test_normalize_checks_layout_against_the_gpus_own_sku():
    # 3g.71gb is an H200 profile: fine there, refused on an H100
    layout = (MigInstance("3g.71gb", 0), MigInstance("3g.71gb", 4))
    (g,) = normalize_gpus([gpu(0, "H200", mig_enabled=True, mig_instances=layout)])
    assert g.model == "H200-141GB"
    with pytest.raises(ValidationFailed):
        normalize_gpus([gpu(0, "H100", mig_enabled=True, mig_instances=layout)])


def test_a_workload_may_declare_itself_restartable() -> None:
    base = "workloads:\n  - name: w\n    tenant: t\n    gpus: {{mig_profile: 1g.10gb}}\n{extra}"
    assert parse_cluster(base.format(extra="")).workloads[0].restartable is False
    spec = parse_cluster(base.format(extra="    restartable: true\n"))
    assert spec.workloads[0].restartable is True
    invalid(base.format(extra="    restartable: maybe\n"))
