"""The scheduling commands of the CLI against a real server with the demo cluster:
``workloads explain``, ``--tenant`` on show/cancel/explain, gang submission, ``tenants quota``.
The server and helpers are test_cli's (one server for this module)."""

from __future__ import annotations

import json

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


def test_submit_batch(server: str, tmp_path) -> None:  # noqa: F811
    from test_cli import ADMIN_TOKEN, no_traceback, runner

    from proofplane.cli.main import app

    lines = [
        {"name": "batch-a", "tenant": "research-lab", "gpus": {"share_milli": 250}},
        {"name": "batch-b", "tenant": "st-marys-hospital", "gpus": {"mig_profile": "1g.10gb"}},
        {"name": "batch-c", "tenant": "research-lab", "gpus": {"count": 64, "model": "B200"}},
    ]
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = ok(cli(server, "workloads", "submit-batch", str(jsonl))).stdout
    assert "batch-a" in out and "batch-b" in out and "3 submitted: 2 placed, 1 pending" in out
    b = as_json(cli(server, "workloads", "show", "batch-b", "--json"))
    assert b["status"] == "placed" and b["tags"]["hipaa"] == "true"  # the tenant's profile
    c = as_json(cli(server, "workloads", "show", "batch-c", "--json"))
    assert c["status"] == "pending" and c["reason"]

    # a JSON document from standard input, --json output in item order
    doc = {"items": [{"name": "batch-d", "tenant": "research-lab", "gpus": {"share_milli": 100}}]}
    result = runner.invoke(
        app,
        ["--server", server, "--token", ADMIN_TOKEN, "workloads", "submit-batch", "-", "--json"],
        input=json.dumps(doc),
    )
    assert [w["name"] for w in json.loads(ok(result).stdout)["items"]] == ["batch-d"]

    # all or nothing: a refused item (a duplicate of an existing name) writes nothing
    bad = [{"name": "batch-e", "tenant": "research-lab", "gpus": {"share_milli": 100}},
           {"name": "batch-a", "tenant": "research-lab", "gpus": {"share_milli": 100}}]  # fmt: skip
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    result = cli(server, "workloads", "submit-batch", str(tmp_path / "bad.json"))
    assert result.exit_code == 1 and "items[1]" in result.output and "conflict" in result.output
    no_traceback(result)
    assert cli(server, "workloads", "show", "batch-e").exit_code == 1  # not found: not written

    # bad files: usage errors (exit 2), nothing sent
    cases = {
        "broken.jsonl": '{"name": "x"}\n{not json\n',
        "empty.json": "[]",
        "scalar.json": "42",
        "noitems.json": '{"workloads": []}',
        "huge.json": json.dumps([{"name": f"w{i}", "tenant": "research-lab"} for i in range(1001)]),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        result = cli(server, "workloads", "submit-batch", str(tmp_path / name))
        assert result.exit_code == 2, (name, result.output)
        no_traceback(result)

    def batch(name: str) -> str:
        return cli(server, "workloads", "submit-batch", str(tmp_path / name)).output

    assert "line 2" in batch("broken.jsonl") and "at most 1000" in batch("huge.json")
    result = cli(server, "workloads", "submit-batch", str(tmp_path / "missing.json"))
    assert result.exit_code == 2 and "cannot read" in result.output


def test_submit_restartable(server: str) -> None:  # noqa: F811
    w = as_json(cli(server, "workloads", "submit", "ckpt-job", "-t", "research-lab",
                    "--share-milli", "100", "--restartable", "--json"))  # fmt: skip
    assert w["restartable"] is True
    plain = as_json(cli(server, "workloads", "show", "notebook-alice", "-t", "research-lab",
                        "--json"))  # fmt: skip
    assert plain["restartable"] is False
    e = as_json(cli(server, "workloads", "explain", "ckpt-job", "--json"))
    assert "defrag" in e
    ok(cli(server, "workloads", "cancel", "ckpt-job"))
