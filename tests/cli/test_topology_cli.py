"""Topology-aware gangs in the CLI (issue 17 §4) against a real server with the demo cluster:
``nodes show`` prints a node's topology, ``workloads submit --topology`` asks for it and
``workloads explain`` says how the gang is packed. The server and helpers are test_cli's."""

from __future__ import annotations

from test_cli import as_json, cli, config_dir, ok, server  # noqa: F401 - fixtures


def test_node_show_prints_topology(server: str) -> None:  # noqa: F811
    out = ok(cli(server, "nodes", "show", "fra-h100-01")).stdout
    assert "topology" in out and "nvlink_domain=fra1-nv1" in out
    node = as_json(cli(server, "nodes", "show", "fra-h100-01", "--json"))
    assert node["topology"] == {"block": "fra1-b1", "nvlink_domain": "fra1-nv1"}


def test_submit_with_topology_and_explain(server: str) -> None:  # noqa: F811
    w = as_json(cli(server, "workloads", "submit", "nv-gang", "-t", "research-lab", "--gpus",
                    "2", "--nodes", "2", "--topology", "nvlink_domain", "--json"))  # fmt: skip
    assert w["topology"] == {"level": "nvlink_domain", "mode": "required"}
    assert w["status"] == "placed", w
    assert {m["node"] for m in w["placement"]["members"]} == {"fra-h100-01", "fra-h100-02"}
    out = ok(cli(server, "workloads", "explain", "nv-gang")).stdout
    assert "topology: nvlink_domain (required)" in out and "fra1-nv1" in out
    # three members cannot share the one two-node NVLink domain: it waits for its topology
    trio = ("--gpus", "3", "--nodes", "3", "--topology", "nvlink_domain:required", "--json")
    w = as_json(cli(server, "workloads", "submit", "nv-trio", "-t", "research-lab", *trio))
    assert w["status"] == "pending" and w["reason"] == "topology_unsatisfiable"
    out = ok(cli(server, "workloads", "explain", "nv-trio")).stdout
    assert "no nvlink_domain holds it now" in out
    w = as_json(cli(server, "workloads", "submit", "blk-trio", "-t", "research-lab", "--gpus",
                    "3", "--nodes", "3", "--topology", "block:preferred", "--json"))  # fmt: skip
    assert w["status"] == "placed"
    result = cli(server, "workloads", "submit", "bad", "-t", "research-lab", "--gpus", "2",
                 "--nodes", "2", "--topology", "pod")  # fmt: skip
    assert result.exit_code == 1 and "invalid_topology_level" in result.output
