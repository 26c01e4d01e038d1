"""The `proofplane` command line, against a real API server (uvicorn in a background thread) on
a SQLite database with the demo cluster loaded and a bootstrap admin token (which the client
commands send with --token), and the server commands on temp databases.

Every test gets its own config directory (the CLI's credentials file) and no PROOFPLANE_*
variables from the environment it runs in."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from live_server import free_port, serve
from proofplane.access import SYSTEM
from proofplane.cli import credentials as cli_credentials
from proofplane.cli import server as server_cli
from proofplane.cli.main import app
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import authenticate, bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

runner = CliRunner()
DEMO_NODES = 24
ADMIN_TOKEN = "ppt_cli-test-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROOFPLANE_ENV = (
    "PROOFPLANE_TOKEN",
    "PROOFPLANE_SERVER",
    "PROOFPLANE_ADMIN_TOKEN",
    "PROOFPLANE_DATABASE_URL",
    "PROOFPLANE_SESSION_TTL_SECONDS",
    "PROOFPLANE_COOKIE_SECURE",
    "PROOFPLANE_OIDC_ISSUER",
)


def demo_text() -> str:
    return (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text()


def demo_node_names() -> set[str]:
    return {ns.node.name for ns in parse_cluster(demo_text()).nodes}


@pytest.fixture(autouse=True)
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI's config directory for this test (never the real home), and a clean env."""
    for var in PROOFPLANE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    where = tmp_path / "xdg-config" / "proofplane"
    monkeypatch.setattr(cli_credentials, "config_dir", lambda: where)
    return where


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a real proofplane server with the demo cluster loaded and ADMIN_TOKEN."""
    db = tmp_path_factory.mktemp("cli") / "cli.db"
    store = Store(f"sqlite:///{db}")
    migrate.upgrade(store.engine)
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    assert bootstrap_admin(store, ADMIN_TOKEN)
    with serve(store) as url:
        yield url


def cli(server: str, *args: str) -> Any:
    """The CLI against ``server`` as the bootstrap admin."""
    return runner.invoke(app, ["--server", server, "--token", ADMIN_TOKEN, *args])


def ok(result: Any) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def as_json(result: Any) -> Any:
    return json.loads(ok(result).stdout)


def no_traceback(result: Any) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def flat(text: str) -> str:
    """Output with Rich panel borders removed and whitespace collapsed: a usage error's message
    is wrapped inside a panel, so compare it as one line."""
    for ch in "│╭╮╰╯─":
        text = text.replace(ch, " ")
    return " ".join(text.split())


def line_with(text: str, needle: str) -> str:
    lines = [line for line in text.splitlines() if needle in line]
    assert lines, f"{needle!r} not in output:\n{text}"
    return lines[0]


# --- nodes -------------------------------------------------------------------------------------


def test_nodes_list_table(server: str) -> None:
    out = ok(cli(server, "nodes", "list")).stdout
    row = line_with(out, "fra-h100-01")
    assert "8x H100-80GB (2 MIG)" in row
    assert "gdpr-zone=frankfurt, hipaa=true" in row
    assert "eu-frankfurt-1a" in row
    assert "admitted" in row
    assert "cordoned" in line_with(out, "use-a100-02")
    assert "more:" not in out  # every node fits on the default page


def test_nodes_list_json(server: str) -> None:
    page = as_json(cli(server, "nodes", "list", "--json"))
    assert set(page) == {"items", "next"}
    assert page["next"] is None
    names = [n["name"] for n in page["items"]]
    assert demo_node_names() <= set(names)
    node = next(n for n in page["items"] if n["name"] == "fra-h100-01")
    assert len(node["gpus"]) == 8
    assert node["certifications"] == {"gdpr-zone": "frankfurt", "hipaa": "true"}


def test_nodes_pagination(server: str) -> None:
    everything = httpx.get(f"{server}/api/v1/nodes", params={"limit": 500}, headers=AUTH).json()[
        "items"
    ]
    all_names = [n["name"] for n in everything]

    first = as_json(cli(server, "nodes", "list", "--limit", "5", "--json"))
    assert [n["name"] for n in first["items"]] == all_names[:5]
    assert first["next"]

    second = as_json(
        cli(server, "nodes", "list", "--limit", "5", "--cursor", first["next"], "--json")
    )
    assert [n["name"] for n in second["items"]] == all_names[5:10]

    table = ok(cli(server, "nodes", "list", "--limit", "5")).stdout
    assert f"--cursor {first['next']}" in table
    assert "5 nodes" in table

    full = as_json(cli(server, "nodes", "list", "--limit", "5", "--all", "--json"))
    names = [n["name"] for n in full["items"]]
    assert full["next"] is None
    assert names == all_names
    assert len(set(names)) == len(names) >= DEMO_NODES
    assert demo_node_names() <= set(names)

    out = ok(cli(server, "nodes", "list", "--limit", "5", "--all")).stdout
    assert f"{len(names)} nodes" in out
    assert "more:" not in out


def test_nodes_list_filters(server: str) -> None:
    page = as_json(
        cli(
            server,
            "nodes",
            "list",
            "--region",
            "us-east",
            "--certification",
            "hipaa=true",
            "--json",
        )
    )
    assert {n["name"] for n in page["items"]} == {"use-h100-01", "use-h100-02"}
    cordoned = as_json(cli(server, "nodes", "list", "--state", "registered", "--json"))
    assert "use-b200-02" in {n["name"] for n in cordoned["items"]}
    assert all(n["state"] == "registered" for n in cordoned["items"])

    bad = cli(server, "nodes", "list", "--certification", "hipaa")
    assert bad.exit_code == 2
    assert "not key=value" in flat(bad.output)
    no_traceback(bad)
    assert cli(server, "nodes", "list", "--state", "sleeping").exit_code == 2


def test_nodes_show(server: str) -> None:
    out = ok(cli(server, "nodes", "show", "fra-h100-02")).stdout
    assert "Node fra-h100-02" in out
    assert "1g.10gb@0" in out  # its MIG layout
    assert "570.133.20" in out
    node = as_json(cli(server, "nodes", "show", "fra-h100-02", "--json"))
    assert node["name"] == "fra-h100-02"
    assert node["gpus"][0]["uuid"] in out

    missing = cli(server, "nodes", "show", "no-such-node")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error (not_found): ")
    assert missing.stdout == ""


def test_node_state_change(server: str) -> None:
    out = ok(cli(server, "nodes", "state", "use-a100-01", "cordoned", "--reason", "maintenance"))
    assert "use-a100-01 is now cordoned (maintenance)" in out.stdout
    node = as_json(cli(server, "nodes", "show", "use-a100-01", "--json"))
    assert (node["state"], node["state_reason"]) == ("cordoned", "maintenance")

    events = as_json(
        cli(
            server,
            "events",
            "list",
            "--action",
            "node.state",
            "--target-id",
            "use-a100-01",
            "--json",
        )
    )
    assert [e["action"] for e in events["items"]][-1] == "node.state"
    assert events["items"][-1]["target_id"] == "use-a100-01"

    refused = cli(server, "nodes", "state", "use-a100-01", "registered")
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error (")
    assert "use-a100-01" in refused.stderr
    no_traceback(refused)

    assert cli(server, "nodes", "state", "use-a100-01", "asleep").exit_code == 2


def test_certify_and_uncertify(server: str) -> None:
    out = ok(cli(server, "nodes", "certify", "use-h100-04", "soc2=type2")).stdout
    assert "soc2=type2" in out
    assert as_json(cli(server, "nodes", "show", "use-h100-04", "--json"))["certifications"] == {
        "soc2": "type2"
    }
    ok(cli(server, "nodes", "uncertify", "use-h100-04", "soc2"))
    assert as_json(cli(server, "nodes", "show", "use-h100-04", "--json"))["certifications"] == {}

    again = cli(server, "nodes", "uncertify", "use-h100-04", "soc2")
    assert again.exit_code == 1
    assert "error (not_found)" in again.stderr
    assert cli(server, "nodes", "certify", "use-h100-04", "soc2").exit_code == 2


def test_nodes_register(server: str, tmp_path: Path) -> None:
    body = {
        "name": "lab-h100-01",
        "region": "lab",
        "zone": "lab-1",
        "gpus": [{"index": i, "uuid": f"GPU-cli-lab-{i}", "model": "H100-80GB"} for i in range(2)],
    }
    f = tmp_path / "node.json"
    f.write_text(json.dumps(body))
    out = ok(cli(server, "nodes", "register", "--file", str(f))).stdout
    assert "lab-h100-01 registered (2x H100-80GB), state registered" in out
    assert as_json(cli(server, "nodes", "show", "lab-h100-01", "--json"))["state"] == "registered"

    dup = cli(server, "nodes", "register", "--file", str(f))
    assert dup.exit_code == 1
    assert "error (conflict)" in dup.stderr

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = cli(server, "nodes", "register", "--file", str(bad))
    assert result.exit_code == 2
    assert "not valid JSON" in flat(result.output)
    no_traceback(result)

    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text('{"name": "lab-x"}')
    result = cli(server, "nodes", "register", "--file", str(incomplete))
    assert result.exit_code == 1
    assert "error (validation_failed)" in result.stderr
    assert "zone: Field required" in result.stderr  # the second problem, on a details line


# --- tenants -----------------------------------------------------------------------------------


def test_tenants_list_and_create(server: str) -> None:
    out = ok(cli(server, "tenants", "list")).stdout
    assert "hipaa=true" in line_with(out, "st-marys-hospital")
    assert "pci-dss=isolated → dedicated-node" in line_with(out, "nordbank")

    created = as_json(
        cli(
            server,
            "tenants",
            "create",
            "cli-bank",
            "--description",
            "a bank",
            "--require",
            "pci-dss=isolated",
            "--min-isolation",
            "exclusive-gpu",
            "--rule",
            "pci-dss=isolated:dedicated-node",
            "--no-co-residency",
            "--json",
        )
    )
    assert created["profile"] == {
        "required_tags": {"pci-dss": "isolated"},
        "min_isolation": "exclusive-gpu",
        "isolation_rules": {"pci-dss=isolated": "dedicated-node"},
        "co_residency": False,
        "segment": "per-tenant",
        "network_policy": None,
    }
    shown = ok(cli(server, "tenants", "show", "cli-bank")).stdout
    assert "a bank" in shown and "exclusive-gpu" in shown
    assert "cli-bank" in {
        t["name"] for t in as_json(cli(server, "tenants", "list", "--json"))["items"]
    }

    dup = cli(server, "tenants", "create", "cli-bank")
    assert dup.exit_code == 1
    assert "error (conflict)" in dup.stderr

    for bad in (["--rule", "pci-dss=isolated"], ["--rule", "x=y:sometimes"], ["--require", "x"]):
        result = cli(server, "tenants", "create", "cli-other", *bad)
        assert result.exit_code == 2, bad
        no_traceback(result)
    assert cli(server, "tenants", "show", "cli-other").exit_code == 1  # nothing was sent


# --- workloads ---------------------------------------------------------------------------------


def test_workload_submit_show_cancel(server: str) -> None:
    out = ok(
        cli(
            server,
            "workloads",
            "submit",
            "cli-notebook",
            "--tenant",
            "research-lab",
            "--share-milli",
            "250",
            "--",
            "jupyter",
            "lab",
            "--port",
            "9999",
        )
    ).stdout
    assert "workload cli-notebook submitted: placed on " in out

    w = as_json(cli(server, "workloads", "show", "cli-notebook", "--json"))
    assert w["status"] == "placed"
    assert w["command"] == ["jupyter", "lab", "--port", "9999"]
    assert w["tags"] == {}
    assert w["gpus"]["share_milli"] == 250
    assert w["placement"]["devices"][0]["share_milli"] == 250
    node = w["placement"]["node"]

    shown = ok(cli(server, "workloads", "show", "cli-notebook")).stdout
    assert f"Placed on {node}" in shown
    assert "0.25 GPU (shared)" in shown
    assert "jupyter lab --port 9999" in shown

    listed = ok(cli(server, "workloads", "list", "--tenant", "research-lab")).stdout
    row = line_with(listed, "cli-notebook")
    assert "placed" in row and node in row and "shared" in row

    cancelled = ok(cli(server, "workloads", "cancel", "cli-notebook", "--reason", "done"))
    assert "workload cli-notebook cancelled: done" in cancelled.stdout
    w = as_json(cli(server, "workloads", "show", "cli-notebook", "--json"))
    assert w["status"] == "cancelled"
    assert w["placement"] is None

    again = cli(server, "workloads", "cancel", "cli-notebook")
    assert again.exit_code == 1
    assert "error (invalid_state)" in again.stderr


def test_tagged_workload_waits_for_certified_nodes(server: str) -> None:
    args = ["cli-tagged", "-t", "research-lab", "--tag", "team=ml", "--share-milli", "100"]
    out = ok(cli(server, "workloads", "submit", *args)).stdout
    assert "workload cli-tagged submitted: pending — no_compliant_capacity" in out
    w = as_json(cli(server, "workloads", "show", "cli-tagged", "--json"))
    assert (w["status"], w["tags"], w["placement"]) == ("pending", {"team": "ml"}, None)
    assert w["reason_details"]["rejections"]["missing_certification"] >= 1
    ok(cli(server, "workloads", "cancel", "cli-tagged"))


def test_workloads_list_filters(server: str) -> None:
    page = as_json(cli(server, "workloads", "list", "--tenant", "st-marys-hospital", "--json"))
    assert {w["name"] for w in page["items"]} >= {"radiology-triage", "oncology-h200"}
    assert all(w["tenant"] == "st-marys-hospital" for w in page["items"])
    pending = as_json(cli(server, "workloads", "list", "--status", "pending", "--json"))
    assert pending["items"]
    assert all(w["status"] == "pending" for w in pending["items"])
    one = as_json(cli(server, "workloads", "list", "--limit", "1", "--json"))
    assert len(one["items"]) == 1 and one["next"]


def test_pending_workload_show_explains(server: str) -> None:
    out = ok(cli(server, "workloads", "show", "oncology-h200")).stdout
    assert "pending" in out
    assert "insufficient_capacity" in out
    assert "none can take it now" in out  # the reason_details message
    assert "NODES REJECTED BECAUSE" in out
    assert "missing_certification" in line_with(out, "missing_certification")


def test_submit_bad_tag_exits_2(server: str) -> None:
    result = cli(
        server, "workloads", "submit", "cli-badtag", "--tenant", "research-lab", "--tag", "oops"
    )
    assert result.exit_code == 2
    assert "'oops' is not key=value" in flat(result.output)
    no_traceback(result)
    assert cli(server, "workloads", "show", "cli-badtag").exit_code == 1  # never submitted


def test_submit_unknown_tenant_exits_1(server: str) -> None:
    result = cli(server, "workloads", "submit", "cli-orphan", "--tenant", "nobody", "--gpus", "1")
    assert result.exit_code == 1
    assert result.stderr.startswith("error (not_found): ")
    assert "nobody" in result.stderr
    assert result.stdout == ""
    no_traceback(result)


# --- events ------------------------------------------------------------------------------------


def test_events_list_after_mutation(server: str) -> None:
    ok(cli(server, "tenants", "create", "cli-events", "--description", "audit me"))
    page = as_json(
        cli(
            server,
            "events",
            "list",
            "--action",
            "tenant.create",
            "--target-id",
            "cli-events",
            "--json",
        )
    )
    assert len(page["items"]) == 1
    event = page["items"][0]
    assert (event["action"], event["target_type"], event["outcome"]) == (
        "tenant.create",
        "tenant",
        "success",
    )

    prefixed = as_json(cli(server, "events", "list", "--action", "tenant.*", "--all", "--json"))
    assert event["seq"] in {e["seq"] for e in prefixed["items"]}
    assert all(e["action"].startswith("tenant.") for e in prefixed["items"])

    table = ok(cli(server, "events", "list", "--target-id", "cli-events")).stdout
    row = line_with(table, "tenant/cli-events")
    assert "tenant.create" in row and str(event["seq"]) in row

    shown = as_json(cli(server, "events", "show", str(event["seq"]), "--json"))
    assert shown == event
    assert "audit me" in ok(cli(server, "events", "show", str(event["seq"]))).stdout


def test_events_since(server: str) -> None:
    future = as_json(cli(server, "events", "list", "--since", "2999-01-01T00:00:00Z", "--json"))
    assert future == {"items": [], "next": None}
    past = as_json(cli(server, "events", "list", "--since", "2000-01-01", "--limit", "3", "--json"))
    assert len(past["items"]) == 3
    bad = cli(server, "events", "list", "--since", "yesterday")
    assert bad.exit_code == 2
    assert "ISO 8601" in flat(bad.output)


# --- client failures ---------------------------------------------------------------------------


def test_dead_server_exits_3() -> None:
    port = free_port()  # nothing listens on it once the probe socket is closed
    url = f"http://127.0.0.1:{port}"
    result = runner.invoke(app, ["--server", url, "nodes", "list"])
    assert result.exit_code == 3
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "cannot reach the proofplane server" in lines[0]
    assert url in lines[0] and "connection refused" in lines[0]
    no_traceback(result)


def test_server_and_token_from_env(server: str) -> None:
    result = runner.invoke(
        app,
        ["nodes", "show", "fra-h100-01", "--json"],
        env={"PROOFPLANE_SERVER": server, "PROOFPLANE_TOKEN": ADMIN_TOKEN},
    )
    assert json.loads(ok(result).stdout)["name"] == "fra-h100-01"


def test_no_token_gets_the_login_hint(server: str, config_dir: Path) -> None:
    assert not (config_dir / "credentials.json").exists()
    result = runner.invoke(app, ["--server", server, "nodes", "list"])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error (unauthenticated): ")
    assert "run 'proofplane login'" in lines[-1]
    no_traceback(result)


def test_wrong_token_gets_the_login_hint(server: str) -> None:
    result = runner.invoke(app, ["--server", server, "--token", "ppt_nope", "nodes", "list"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error (invalid_token): ")
    assert "run 'proofplane login'" in result.stderr
    no_traceback(result)


def test_token_with_spaces_exits_2(server: str) -> None:
    result = runner.invoke(app, ["--server", server, "--token", "ppt_a b", "nodes", "list"])
    assert result.exit_code == 2
    assert "token" in result.stderr and "ppt_a b" not in result.output
    no_traceback(result)


def test_stored_credentials_are_per_server(server: str, config_dir: Path) -> None:
    """A token stored for one server is sent to that server only."""
    cli_credentials.store(server, token=ADMIN_TOKEN, username="admin", expires_at=None)
    assert (
        json.loads(ok(runner.invoke(app, ["--server", server, "whoami", "--json"])).stdout)[
            "username"
        ]
        == "admin"
    )
    other = server.replace("127.0.0.1", "localhost")
    result = runner.invoke(app, ["--server", other, "whoami"])
    assert result.exit_code == 1
    assert "error (unauthenticated)" in result.stderr


def test_invalid_server_url_exits_2() -> None:
    result = runner.invoke(app, ["--server", "not-a-url", "nodes", "list"])
    assert result.exit_code == 2
    assert "invalid --server URL" in result.stderr
    no_traceback(result)


class _Proxy(BaseHTTPRequestHandler):
    """Answers like a misconfigured proxy: an HTML 502 for the API, HTML 200 elsewhere."""

    def do_GET(self) -> None:
        status, body = (502, b"<html><body><h1>Bad Gateway</h1></body></html>")
        if self.path.startswith("/ok"):
            status, body = 200, b"<html>hello</html>"
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[str]:
    httpd = HTTPServer(("127.0.0.1", 0), _Proxy)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_non_json_error_body(proxy: str) -> None:
    result = runner.invoke(app, ["--server", proxy, "nodes", "list"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines == ["error (HTTP 502): Bad Gateway"]
    no_traceback(result)

    html_ok = runner.invoke(app, ["--server", f"{proxy}/ok", "nodes", "show", "x"])
    assert html_ok.exit_code == 1
    assert "did not answer with JSON" in html_ok.stderr
    no_traceback(html_ok)


# --- server commands ---------------------------------------------------------------------------


def test_db_upgrade_and_current(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db' / 'x.db'}"
    head = migrate.head_revision()
    before = runner.invoke(app, ["db", "current", "--db", url])
    assert ok(before).stdout.count(head) == 1  # only as the head
    assert "not migrated" in before.stdout
    upgraded = ok(runner.invoke(app, ["db", "upgrade", "--db", url]))
    assert f"revision {head}" in upgraded.stdout
    after = ok(runner.invoke(app, ["db", "current", "--db", url])).stdout
    assert line_with(after, "current:").split()[-1] == head
    assert "up to date" in after
    store = Store(url)
    try:
        assert migrate.current_revision(store.engine) == head
    finally:
        store.dispose()


def test_db_url_from_env(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    ok(runner.invoke(app, ["db", "upgrade"], env={"PROOFPLANE_DATABASE_URL": url}))
    assert (tmp_path / "env.db").exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://u@h/x", "unsupported database 'mysql'"),
        ("sqlite://", "SQLite needs a file path"),
        ("postgresql://u:s3cret@127.0.0.1:{port}/x", "database error"),
    ],
)
def test_db_errors_are_one_message(url: str, message: str) -> None:
    result = runner.invoke(app, ["db", "upgrade", "--db", url.format(port=free_port())])
    assert result.exit_code == 1
    assert result.stderr.startswith("proofplane: ")
    assert message in result.stderr
    assert "s3cret" not in result.output
    no_traceback(result)


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace uvicorn.run: record the call instead of serving forever (one process, so the
    recorded app is the application object; test_serve_starts_worker_processes sets more)."""
    monkeypatch.setenv("PROOFPLANE_SERVE_WORKERS", "1")
    calls: list[dict[str, Any]] = []

    def fake_run(app_: Any, **kwargs: Any) -> None:
        calls.append({"app": app_, **kwargs})

    monkeypatch.setattr(server_cli.uvicorn, "run", fake_run)
    return calls


def test_up_invalid_cluster_file(tmp_path: Path, no_serving: list[dict[str, Any]]) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text("cluster: broken\nnodes:\n  - name: n1\n    colour: blue\n")
    result = runner.invoke(app, ["up", "--cluster", str(f), "--db", f"sqlite:///{tmp_path}/x.db"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"proofplane: invalid cluster file {f}:"
    assert "  - nodes.0.region: Field required" in lines
    assert "  - nodes.0.colour: Extra inputs are not permitted" in lines
    no_traceback(result)
    assert no_serving == []
    assert not (tmp_path / "x.db").exists()  # checked before any database is touched

    f.write_text("cluster: [unclosed\n")
    result = runner.invoke(app, ["up", "--cluster", str(f)])
    assert result.exit_code == 1
    assert "not valid YAML" in result.stderr
    no_traceback(result)


def test_up_rejected_cluster_contents(tmp_path: Path, no_serving: list[dict[str, Any]]) -> None:
    f = tmp_path / "cluster.yaml"
    # a plain GPU of any model loads (issue 17); a MIG layout needs a MIG model
    f.write_text(
        "nodes:\n  - {name: n1, region: r, zone: z, gpus: [{model: NO-SUCH-GPU, "
        "mig: ['1g.10gb@0']}]}\n"
    )
    result = runner.invoke(
        app,
        [
            "up",
            "--cluster",
            str(f),
            "--db",
            f"sqlite:///{tmp_path}/x.db",
            "--port",
            str(free_port()),
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.startswith("proofplane: cannot load ")
    assert "NO-SUCH-GPU" in result.stderr
    no_traceback(result)
    assert no_serving == []


def test_up_missing_cluster_file(tmp_path: Path, no_serving: list[dict[str, Any]]) -> None:
    result = runner.invoke(app, ["up", "--cluster", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1
    assert "does not exist" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    no_traceback(result)
    result = runner.invoke(app, ["up", "--cluster", str(tmp_path)])
    assert result.exit_code == 1
    assert "is a directory" in result.stderr
    assert no_serving == []


def test_up_into_non_empty_database(tmp_path: Path, no_serving: list[dict[str, Any]]) -> None:
    url = f"sqlite:///{tmp_path / 'full.db'}"
    store = Store(url)
    migrate.upgrade(store.engine)
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    store.dispose()
    result = runner.invoke(app, ["up", "--db", url, "--port", str(free_port())])
    assert result.exit_code == 1
    assert "already has nodes" in result.stderr
    assert "proofplane serve --db" in result.stderr
    no_traceback(result)
    assert no_serving == []


def _demo_token(out: str) -> str:
    """The token the welcome panel shows as the demo admin token."""
    token = flat(line_with(out, "demo admin token")).split("demo admin token", 1)[1].split()[0]
    assert token.startswith("ppt_") and len(token) > 40
    return token


def test_up_starts_fresh_every_time(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_serving: list[dict[str, Any]],
    config_dir: Path,
) -> None:
    demo_db = tmp_path / "data" / "demo.db"
    demo_db.parent.mkdir()
    for suffix in ("", "-wal", "-shm"):  # leftovers that would break a reuse
        Path(f"{demo_db}{suffix}").write_bytes(b"not a database")
    monkeypatch.setattr(server_cli, "demo_database_path", lambda: demo_db)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tokens = []
    for _ in range(2):
        result = runner.invoke(app, ["up", "--port", str(port)])
        out = ok(result).stdout
        assert f"{url}/docs" in out
        assert "5 tenants, 24 nodes, 13 workloads" in out
        assert str(demo_db) in out
        assert "proofplane workloads show radiology-triage" in out
        assert f"export PROOFPLANE_SERVER={url}" in out  # not the default port
        token = _demo_token(out)
        assert f"export PROOFPLANE_TOKEN={token}" in out
        assert str(config_dir / "credentials.json") in flat(out)
        tokens.append(token)
    assert tokens[0] != tokens[1]  # a fresh random token each time
    assert [(c["host"], c["port"]) for c in no_serving] == [("127.0.0.1", port)] * 2
    settings = no_serving[-1]["app"].state.settings
    assert settings.admin_token == tokens[1]
    assert settings.cookie_secure is False  # plain HTTP on loopback
    store = Store(f"sqlite:///{demo_db}")
    try:
        from proofplane.service.nodes import list_nodes

        assert len(list_nodes(store, SYSTEM, limit=500).items) == DEMO_NODES  # not 48
        actor = authenticate(store, tokens[1], datetime.now(UTC))
        assert actor.name == "admin" and {r.value for r in actor.roles} == {"admin"}
    finally:
        store.dispose()


def test_up_stores_the_demo_token_for_the_cli(
    tmp_path: Path, no_serving: list[dict[str, Any]], config_dir: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    db = tmp_path / "up.db"
    out = ok(runner.invoke(app, ["up", "--port", str(port), "--db", f"sqlite:///{db}"])).stdout
    token = _demo_token(out)
    path = config_dir / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    entry = json.loads(path.read_text())[url]
    assert (entry["token"], entry["username"], entry["kind"]) == (token, "admin", "api")
    assert datetime.fromisoformat(entry["expires_at"]) > datetime.now(UTC) + timedelta(days=89)
    assert cli_credentials.lookup(url + "/") == entry  # what the client commands send to url


def test_up_uses_the_admin_token_from_env(
    tmp_path: Path, no_serving: list[dict[str, Any]], config_dir: Path
) -> None:
    port = free_port()
    db = tmp_path / "up.db"
    result = runner.invoke(
        app,
        ["up", "--port", str(port), "--db", f"sqlite:///{db}"],
        env={"PROOFPLANE_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    assert _demo_token(ok(result).stdout) == ADMIN_TOKEN
    entry = json.loads((config_dir / "credentials.json").read_text())[f"http://127.0.0.1:{port}"]
    assert entry["token"] == ADMIN_TOKEN
    assert no_serving[0]["app"].state.settings.admin_token == ADMIN_TOKEN


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PROOFPLANE_SESSION_TTL_SECONDS": "5"}, "PROOFPLANE_SESSION_TTL_SECONDS"),
        ({"PROOFPLANE_OIDC_ISSUER": "https://idp.example"}, "OIDC is configured"),
    ],
)
@pytest.mark.parametrize("command", ["up", "serve"])
def test_bad_settings_are_one_line(
    tmp_path: Path,
    no_serving: list[dict[str, Any]],
    env: dict[str, str],
    message: str,
    command: str,
) -> None:
    db = tmp_path / "s.db"
    result = runner.invoke(
        app, [command, "--port", str(free_port()), "--db", f"sqlite:///{db}"], env=env
    )
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("proofplane: invalid configuration: ")
    assert message in lines[0]
    no_traceback(result)
    assert no_serving == []
    assert not db.exists()


def test_weak_admin_token_is_refused(tmp_path: Path, no_serving: list[dict[str, Any]]) -> None:
    result = runner.invoke(
        app,
        ["serve", "--port", str(free_port()), "--db", f"sqlite:///{tmp_path}/w.db"],
        env={"PROOFPLANE_ADMIN_TOKEN": "short"},
    )
    assert result.exit_code == 1
    assert "must be 16..256 characters" in result.stderr
    assert "short" not in result.output
    assert no_serving == []


def test_up_refuses_a_busy_port(tmp_path: Path, no_serving: list[dict[str, Any]]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(
            app, ["up", "--port", str(port), "--db", f"sqlite:///{tmp_path}/b.db"]
        )
    assert result.exit_code == 1
    assert "already in use" in result.stderr
    assert no_serving == []


@pytest.mark.parametrize(
    ("args", "env", "want"),
    [
        (["--workers", "3"], {}, 3),
        ([], {"PROOFPLANE_SERVE_WORKERS": "2"}, 2),
        ([], {"PROOFPLANE_SERVE_WORKERS": None}, os.cpu_count() or 1),  # default: one per core
    ],
)
def test_serve_starts_worker_processes(
    tmp_path: Path,
    no_serving: list[dict[str, Any]],
    args: list[str],
    env: dict[str, str | None],
    want: int,
) -> None:
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    result = ok(
        runner.invoke(app, ["serve", "--db", url, "--port", str(free_port()), *args], env=env)
    )
    (call,) = no_serving
    if want == 1:
        assert "workers" not in call and "worker processes" not in result.stdout
        return
    # each process builds the application from the environment the parent set up
    assert call["app"] == "proofplane.cli.worker_app:app_from_env" and call["factory"] is True
    assert call["workers"] == want
    assert f"{want} worker processes" in result.stdout
    assert os.environ.pop("PROOFPLANE_SERVE_URL") == url


@pytest.mark.parametrize(
    ("args", "env", "want"),
    [
        ([], {}, False),
        (["--access-log"], {}, True),
        (["--no-access-log"], {"PROOFPLANE_ACCESS_LOG": "1"}, False),
        ([], {"PROOFPLANE_ACCESS_LOG": "true"}, True),
        (["--workers", "2"], {}, False),
        (["--workers", "2", "--access-log"], {}, True),
    ],
)
def test_serve_access_log_is_off_unless_asked(
    tmp_path: Path,
    no_serving: list[dict[str, Any]],
    args: list[str],
    env: dict[str, str],
    want: bool,
) -> None:
    """uvicorn's line per request costs every request CPU (issue 12's profile: 7 % of a
    worker) and repeats what the audit log records: off unless ``--access-log`` (or
    ``PROOFPLANE_ACCESS_LOG``) asks for it, in one process and in worker processes alike."""
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    ok(runner.invoke(app, ["serve", "--db", url, "--port", str(free_port()), *args], env=env))
    (call,) = no_serving
    assert call["access_log"] is want
    if "--workers" in args:
        assert call["workers"] == 2
        os.environ.pop("PROOFPLANE_SERVE_URL")


def test_serve_refuses_a_bad_access_log_setting(
    tmp_path: Path, no_serving: list[dict[str, Any]]
) -> None:
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    result = runner.invoke(app, ["serve", "--db", url], env={"PROOFPLANE_ACCESS_LOG": "maybe"})
    assert result.exit_code == 2 and no_serving == []
    assert "Invalid value for '--access-log'" in result.output, result.output
    no_traceback(result)


@pytest.mark.parametrize("bad", ["0", "65", "two"])
def test_serve_refuses_a_bad_worker_count(
    tmp_path: Path, no_serving: list[dict[str, Any]], bad: str
) -> None:
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    result = runner.invoke(app, ["serve", "--db", url, "--workers", bad])
    assert result.exit_code == 2 and no_serving == []
    assert "--workers" in result.output
    no_traceback(result)


def test_serve_migrates_then_serves(
    tmp_path: Path, no_serving: list[dict[str, Any]], config_dir: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    port = free_port()
    result = ok(runner.invoke(app, ["serve", "--db", url, "--port", str(port), "--workers", "1"]))
    assert f"http://127.0.0.1:{port}" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1
    assert len(no_serving) == 1 and no_serving[0]["port"] == port
    settings = no_serving[0]["app"].state.settings
    assert (settings.admin_token, settings.cookie_secure) == (None, True)
    assert not (config_dir / "credentials.json").exists()  # serve stores nothing for the CLI
    store = Store(url)
    try:
        assert migrate.is_current(store.engine)
        with pytest.raises(Exception, match="invalid or revoked token"):
            authenticate(store, ADMIN_TOKEN, datetime.now(UTC))
    finally:
        store.dispose()


def test_serve_bootstraps_the_admin_token_once(
    tmp_path: Path, no_serving: list[dict[str, Any]]
) -> None:
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    env = {"PROOFPLANE_ADMIN_TOKEN": ADMIN_TOKEN, "PROOFPLANE_SESSION_TTL_SECONDS": "600"}
    args = ["serve", "--db", url, "--port", str(free_port())]
    first = ok(runner.invoke(app, args, env=env)).stdout
    assert "created user admin" in first
    assert ADMIN_TOKEN not in first
    settings = no_serving[0]["app"].state.settings
    assert settings.admin_token == ADMIN_TOKEN
    assert settings.session_ttl == timedelta(seconds=600)
    store = Store(url)
    try:
        assert authenticate(store, ADMIN_TOKEN, datetime.now(UTC)).name == "admin"
    finally:
        store.dispose()
    # A control plane that has users is left alone (and says nothing about it).
    second = ok(runner.invoke(app, args, env={"PROOFPLANE_ADMIN_TOKEN": "ppt_" + "x" * 40}))
    assert "created user admin" not in second.stdout
    store = Store(url)
    try:
        with pytest.raises(Exception, match="invalid or revoked token"):
            authenticate(store, "ppt_" + "x" * 40, datetime.now(UTC))
    finally:
        store.dispose()


def test_version() -> None:
    from proofplane import __version__

    assert ok(runner.invoke(app, ["--version"])).stdout.strip() == f"proofplane {__version__}"


def test_events_list_newest_first(server: str) -> None:
    page = as_json(cli(server, "events", "list", "--newest", "--json", "--limit", "3"))
    seqs = [e["seq"] for e in page["items"]]
    assert seqs == sorted(seqs, reverse=True) and len(seqs) == 3
    assert page["next"] is not None


# --- execution: the demo's processes, workloads logs ---------------------------------------------


def _live_jobs(store: Store) -> list[str]:
    from proofplane.service import execution

    assert store.backend is not None
    return execution.live_job_ids(store, store.backend)


def test_up_runs_the_demo_workloads_as_local_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proofplane.backends.base import ChangeKind
    from proofplane.backends.local import LocalExecutor

    seen: dict[str, Any] = {}

    def serving(app_: Any, **_kwargs: Any) -> None:
        """While `up` serves: the placed demo workloads run, each printing its GPUs."""
        store = app_.state.store
        backend = store.backend
        assert isinstance(backend, LocalExecutor)
        seen["state_dir"] = backend.state_dir
        seen["jobs"] = _live_jobs(store)
        assert {c.kind for c in backend.sync(seen["jobs"])} == {ChangeKind.RUNNING}
        triage = next(j for j in seen["jobs"] if ".radiology-triage." in j)
        deadline = time.monotonic() + 10
        while not backend.logs(triage) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["log"] = backend.logs(triage).decode()
        seen["backend"] = backend

    monkeypatch.setattr(server_cli.uvicorn, "run", serving)
    db = tmp_path / "up.db"
    out = ok(runner.invoke(app, ["up", "--port", str(free_port()), "--db", f"sqlite:///{db}"]))
    assert seen["state_dir"] == Path(f"{db}.jobs")  # next to its database, never the user's
    assert len(seen["jobs"]) >= 5
    assert seen["log"].startswith("triage.serve --model ct-chest-v4: step 1/720 on ")
    assert "CUDA_VISIBLE_DEVICES=MIG-SIM-" in seen["log"]
    assert f"{len(seen['jobs'])} workload(s) dispatched" in flat(out.stdout)
    assert "proofplane workloads logs radiology-triage" in out.stdout
    # When `up` stops, so do the demo's processes.
    assert f"stopped {len(seen['jobs'])} demo workload process(es)" in out.stdout
    changes = seen["backend"].sync(seen["jobs"])
    assert {c.kind for c in changes} == {ChangeKind.CANCELLED}


@pytest.fixture
def engine_server(tmp_path: Path) -> Iterator[tuple[str, Store]]:
    """A server whose store runs its workloads on the local executor (the demo cluster)."""
    from proofplane.backends.local import LimitMode, LocalExecutor
    from proofplane.config import ExecutionSettings
    from proofplane.service import execution

    store = Store(f"sqlite:///{tmp_path / 'engine.db'}")
    migrate.upgrade(store.engine)
    backend = LocalExecutor(tmp_path / "jobs", limit_mode=LimitMode("rlimit", "test"))
    store.backend = backend
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    assert bootstrap_admin(store, ADMIN_TOKEN)
    try:
        with serve(store, execution=ExecutionSettings(sync_interval_s=0.2)) as url:
            yield url, store
    finally:
        execution.stop_jobs(backend, backend.adopt())


def test_workloads_logs_and_the_engine_job_in_show(engine_server: tuple[str, Store]) -> None:
    url, _store = engine_server
    deadline = time.monotonic() + 15
    while True:  # the server's sync worker sees the process run
        shown = ok(cli(url, "workloads", "show", "radiology-triage")).stdout
        if "(running" in shown or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    engine = flat(line_with(shown, "engine"))
    assert "local job st-marys-hospital.radiology-triage." in engine and "(running" in engine
    assert "python3 -c" in shown and "triage.serve --model ct-chest-v4" in shown
    logs = ok(cli(url, "workloads", "logs", "radiology-triage")).stdout
    assert logs.startswith("triage.serve --model ct-chest-v4: step 1/720 on ")
    assert "CUDA_VISIBLE_DEVICES=MIG-SIM-" in logs
    tailed = ok(cli(url, "workloads", "logs", "radiology-triage", "--tail", "10", "-t",
                    "st-marys-hospital")).stdout  # fmt: skip
    assert len(tailed.encode()) == 10 and logs.endswith(tailed)
    assert ok(cli(url, "workloads", "logs", "radiology-triage", "--stderr")).stdout == ""
    jobs = as_json(cli(url, "backends", "jobs", "radiology-triage", "--json"))
    assert [j["state"] for j in jobs["items"]] == ["running"]
    listed = as_json(cli(url, "backends", "list", "--json"))
    assert [b["name"] for b in listed["items"] if b["configured"]] == ["local"]
    # A workload that has not run: said so, exit 0.
    pending = as_json(cli(url, "workloads", "list", "--status", "pending", "--json"))["items"]
    assert pending
    waiting = ok(cli(url, "workloads", "logs", pending[0]["name"]))
    assert "has not run yet" in waiting.stdout
    missing = cli(url, "workloads", "logs", "no-such-workload")
    assert missing.exit_code == 1 and "not found" in missing.stderr.lower()


def test_sigterm_stops_up_and_the_demo_processes(tmp_path: Path) -> None:
    """A service manager stops `up` with SIGTERM: the demo's workload processes go with it."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    db = tmp_path / "demo.db"
    env = {**os.environ, "HOME": str(tmp_path), "PROOFPLANE_DATABASE_URL": f"sqlite:///{db}"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proofplane.cli.main",
            "up",
            "--port",
            str(port),
            "--db",
            f"sqlite:///{db}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "up did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped 11 demo workload process(es)" in out
