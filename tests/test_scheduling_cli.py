"""The scheduling commands of the CLI against a real server with the demo cluster:
``workloads explain``, ``--tenant`` on show/cancel/explain, gang submission, ``tenants quota``.
The server and helpers are test_cli's (one server for this module)."""

from __future__ import annotations

from test_cli import as_json, cli, config_dir, ok, server  # noqa: F401 - fixtures

DEMO = {
    "radiology-triage": "st-marys-hospital",
    "oncology-h200": "st-marys-hospital",
    "notebook-alice": "research-lab",
}


def test_explain_placed_and_pending(server: str) -> None:  # noqa: F811
    out = ok(cli(server, "workloads", "explain", "radiology-triage")).stdout
    assert "placed on fra-h100-01" in out and "RANK" in out and "ranks #1" in out
    out = ok(cli(server, "workloads", "explain", "oncology-h200")).stdout
    assert "pending (insufficient_capacity)" in out
    assert "NODES REJECTED BECAUSE" in out and "gpu_model_unavailable" in out
    e = as_json(cli(server, "workloads", "explain", "oncology-h200", "--json"))
    assert e["reason"] == "insufficient_capacity"
    assert e["analysis"]["filters"]["missing_certification"] >= 1


def test_explain_every_demo_workload(server: str) -> None:  # noqa: F811
    items = as_json(cli(server, "workloads", "list", "--all", "--json"))["items"]
    assert len(items) == 13
    for w in items:
        e = as_json(cli(server, "workloads", "explain", w["name"], "-t", w["tenant"], "--json"))
        assert e["status"] == w["status"] and e["summary"]


def test_tenant_option_on_show_cancel_explain(server: str) -> None:  # noqa: F811
    # the same name in a second tenant makes the bare name ambiguous
    ok(cli(server, "workloads", "submit", "notebook-alice", "-t", "paris-insurance",
           "--share-milli", "100"))  # fmt: skip
    for cmd in ("show", "explain"):
        result = cli(server, "workloads", cmd, "notebook-alice")
        assert result.exit_code == 1 and "ambiguous_name" in result.output
    shown = as_json(cli(server, "workloads", "show", "notebook-alice", "--tenant", "research-lab",
                        "--json"))  # fmt: skip
    assert shown["tenant"] == "research-lab"
    e = as_json(cli(server, "workloads", "explain", "notebook-alice", "-t", "paris-insurance",
                    "--json"))  # fmt: skip
    assert e["tenant"] == "paris-insurance"
    result = cli(server, "workloads", "cancel", "notebook-alice")
    assert result.exit_code == 1 and "ambiguous_name" in result.output
    c = as_json(cli(server, "workloads", "cancel", "notebook-alice", "-t", "paris-insurance",
                    "--json"))  # fmt: skip
    assert c["status"] == "cancelled" and c["tenant"] == "paris-insurance"
    # the other tenant's workload is untouched (a cancelled one still holds its name)
    other = as_json(cli(server, "workloads", "show", "notebook-alice", "-t", "research-lab",
                        "--json"))  # fmt: skip
    assert other["status"] in ("placed", "running")


def test_gang_submit_and_quota(server: str) -> None:  # noqa: F811
    out = ok(cli(server, "tenants", "quota", "research-lab", "--gpus", "4")).stdout
    assert "GPUs: 4" in out and "MIG slices: no limit" in out
    # a limit not given is kept
    t = as_json(cli(server, "tenants", "quota", "research-lab", "--mig-slices", "7", "--json"))
    assert t["quota"] == {"gpus": 4, "mig_slices": 7}
    w = as_json(cli(server, "workloads", "submit", "gang-job", "-t", "research-lab",
                    "--gpus", "8", "--nodes", "2", "--json"))  # fmt: skip
    assert w["gpus"]["nodes"] == 2
    assert w["status"] == "pending" and w["reason"] == "quota_exceeded"
    ok(cli(server, "tenants", "quota", "research-lab", "--unlimited"))
    w = as_json(cli(server, "workloads", "show", "gang-job", "--json"))
    assert w["status"] == "placed" and len(w["placement"]["members"]) == 2
    out = ok(cli(server, "workloads", "show", "gang-job")).stdout
    assert out.count("Placed on") == 2
    result = cli(server, "tenants", "quota", "no-such-tenant", "--gpus", "1")
    assert result.exit_code == 1 and "not_found" in result.output
    result = cli(server, "tenants", "quota", "research-lab", "--gpus", "-1")
    assert result.exit_code == 2
