"""Topology (issue 17 §4) in the store and the cluster file: parsing, loading through the
service (bulk path), migration 0019_topology down and up on SQLite and PostgreSQL (the
``db_url`` fixture behind ``store``/``demo``)."""

from __future__ import annotations

import textwrap

import pytest

from dbtest import migrate_to
from proofplane.access import SYSTEM
from proofplane.errors import ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import TopologyMode, TopologyRequest, WorkloadStatus
from proofplane.schedule.reasons import TOPOLOGY_UNSATISFIABLE
from proofplane.service import nodes as nodes_svc
from proofplane.service import workloads as workloads_svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store

CLUSTER = """\
cluster: topo
tenants:
  - name: acme
nodes:
  - {name: a1, region: r, zone: z, rack: ra, topology: {nvlink_domain: nv1, block: b1},
     gpus: [{model: H100-80GB, count: 4}]}
  - {name: a2, region: r, zone: z, rack: ra, topology: {nvlink_domain: nv1, block: b1},
     gpus: [{model: H100-80GB, count: 4}]}
  - {name: b1, region: r, zone: z, topology: {rack: rb, block: b1},
     gpus: [{model: H100-80GB, count: 4}]}
workloads:
  - name: pair
    tenant: acme
    gpus: {count: 8, nodes: 2}
    topology: {level: nvlink_domain}
  - name: trio
    tenant: acme
    gpus: {count: 12, nodes: 3}
    topology: {level: rack, mode: required}
"""


def test_cluster_file_parses_topology() -> None:
    spec = parse_cluster(CLUSTER)
    nodes = {n.node.name: n.node for n in spec.nodes}
    assert nodes["a1"].topology == {"nvlink_domain": "nv1", "block": "b1"}
    assert nodes["b1"].topology == {"rack": "rb", "block": "b1"} and nodes["b1"].rack is None
    pair = spec.workloads[0]
    assert pair.gpus.nodes == 2
    assert pair.topology == TopologyRequest("nvlink_domain", TopologyMode.REQUIRED)
    bad = CLUSTER.replace("level: rack, mode: required", "level: pod")
    with pytest.raises(ValidationFailed) as exc:
        parse_cluster(bad)
    assert exc.value.code == "invalid_cluster_file"


def test_cluster_file_loads_and_places_by_topology(store: Store) -> None:
    load_cluster(store, SYSTEM, parse_cluster(CLUSTER))
    b1 = nodes_svc.get_node(store, SYSTEM, "b1")
    assert b1.rack == "rb" and b1.topology == {"block": "b1", "rack": "rb"}
    pair = workloads_svc.get_workload(store, SYSTEM, "pair")
    assert pair.status is WorkloadStatus.PLACED and pair.placement is not None
    assert set(pair.placement.nodes) == {"a1", "a2"}
    assert pair.topology == TopologyRequest("nvlink_domain", TopologyMode.REQUIRED)
    trio = workloads_svc.get_workload(store, SYSTEM, "trio")
    assert trio.status is WorkloadStatus.PENDING and trio.reason != TOPOLOGY_UNSATISFIABLE


def test_cluster_file_refuses_topology_on_one_node(store: Store) -> None:
    one = textwrap.dedent("""\
        cluster: x
        tenants: [{name: t2}]
        nodes: [{name: n1, region: r, zone: z, gpus: [{model: H100-80GB}]}]
        workloads:
          - {name: solo, tenant: t2, gpus: {count: 1}, topology: {level: rack}}
        """)
    with pytest.raises(ValidationFailed) as exc:
        load_cluster(store, SYSTEM, parse_cluster(one))
    assert exc.value.code == "topology_requires_gang"


def test_migration_0019_downgrades_and_upgrades_again(store: Store) -> None:
    load_cluster(store, SYSTEM, parse_cluster(CLUSTER))
    migrate_to(store.engine, "0017")
    # the columns are back, empty: nodes name no domain, workloads ask no topology
    assert nodes_svc.get_node(store, SYSTEM, "a1").topology == {}
    assert workloads_svc.get_workload(store, SYSTEM, "pair").topology is None
    nodes_svc.update_node(store, SYSTEM, "a1", topology={"rail": "rail-0"})
    assert nodes_svc.get_node(store, SYSTEM, "a1").topology == {"rail": "rail-0"}
