"""Runbooks (issue 12, §8): the six shipped runbooks parse, name only actions the code really
records and only CLI commands that exist; bad documents are refused with ``invalid_runbook``;
``runbook_for`` picks the most specific trigger; a published version is a ``runbook.publish``
event and becomes current; alert events name the runbook that answers them; the API and the
CLI list and show them."""

from __future__ import annotations

import ast
import re
import shlex
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from ci import REPO
from live_server import serve
from proofplane.access import SYSTEM, Actor, Forbidden, Role
from proofplane.cli.main import app as cli_app
from proofplane.errors import Conflict, NotFound, ProofplaneError, ValidationFailed
from proofplane.govern.runbooks import Runbook, Trigger, parse_runbook
from proofplane.govern.runbooks import runbook_for as match
from proofplane.meter.anomaly import EVALUATED_RULES
from proofplane.model import Outcome, Tenant
from proofplane.service import access
from proofplane.service import runbooks as svc
from proofplane.service.context import Store
from proofplane.service.tenants import create_tenant
from proofplane.store.tables import EventRow

SHIPPED = {
    "attestation-failure",
    "node-failure",
    "audit-verification-failure",
    "siem-sink-down",
    "suspected-tenant-breakout",
    "key-compromise",
    # issue 15: the alert worker's rules and the GPU health drain
    "offhours-spike",
    "transfer-volume",
    "control-failing",
    "capacity-n-plus-one",
    "gpu-health",
}
PASSWORD = "correct horse battery staple"
AUDITOR = Actor("aud", frozenset({Role.AUDITOR}))
AGENT = Actor("node:n1")


def doc(header: str, body: str = "1. Do the thing.\n") -> str:
    return f"---\n{header}\n---\n{body}"


GOOD = doc('id: test-book\ntitle: A test\nversion: 2\ntriggers: ["sink.delivery_failed"]')


def _recorded_actions() -> set[str]:
    """The literal actions passed to ``record(...)``/``NewEvent(...)`` anywhere in src/."""
    found: set[str] = set()
    for path in (REPO / "src" / "proofplane").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            value = getattr(node.args[0], "value", None)
            if name in ("record", "NewEvent", "_record") and isinstance(value, str):
                found.add(value)
    # the alert worker records alert.<rule> for each rule it evaluates (service/alerts.py)
    found.update(f"alert.{rule}" for rule in EVALUATED_RULES)
    return found


# --- the shipped set ---------------------------------------------------------------------------


def test_the_shipped_runbooks_parse() -> None:
    books = svc.shipped()
    assert {rb.id for rb in books} == SHIPPED
    folder = REPO / "src" / "proofplane" / "data" / "runbooks"
    assert {p.stem for p in folder.glob("*.md")} == SHIPPED
    for rb in books:
        assert rb.version == 1 and rb.title and rb.body.count("\n") > 10
        assert parse_runbook((folder / f"{rb.id}.md").read_text("utf-8")) == rb


def test_every_trigger_is_an_action_the_code_records() -> None:
    recorded = _recorded_actions()
    assert "node.attest" in recorded and "sink.delivery_failed" in recorded
    named = {t.action for rb in svc.shipped() for t in rb.triggers}
    assert named and named <= recorded, named - recorded
    # the login alerts are answered (they carry it: test_alert_events_carry_their_runbook)
    for alert in ("alert.auth_failure_burst", "alert.auth_failure_spray",
                  "alert.auth_source_throttled"):  # fmt: skip
        assert alert in recorded and svc.runbook_for(alert, Outcome.FAILURE) is not None


def _cli_commands(text: str) -> list[list[str]]:
    """The ``proofplane …`` lines of the fenced code blocks, as argument lists."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip().split(" > ", 1)[0]
            if line.startswith("proofplane "):
                out.append(shlex.split(line)[1:])
    return out


def test_every_cli_command_in_a_runbook_exists() -> None:
    root = typer.main.get_command(cli_app)
    seen = 0
    for rb in svc.shipped():
        for argv in _cli_commands(rb.body):
            seen += 1
            cmd: Any = root
            args = list(argv)
            while args and args[0] in getattr(cmd, "commands", {}):
                cmd = cmd.commands[args.pop(0)]
            assert not hasattr(cmd, "commands"), (rb.id, argv)  # a command, not a group
            options = {o for p in cmd.params for o in getattr(p, "opts", [])}
            options |= {o for p in cmd.params for o in getattr(p, "secondary_opts", [])}
            used = {a.split("=", 1)[0] for a in args if a.startswith("-")}
            assert used <= options, (rb.id, argv, used - options)
    assert seen >= 40


# --- the parser --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        None,
        42,
        "",
        "no header at all\n1. step\n",
        "---\nid: x\ntitle: t\nversion: 1\ntriggers: []\n1. never closed\n",
        doc("id: [unclosed"),
        doc("- a list\n- not a mapping"),
        doc("just a string"),
        doc("title: t\nversion: 1\ntriggers: []"),  # no id
        doc("id: x\nversion: 1\ntriggers: []"),  # no title
        doc("id: x\ntitle: t\ntriggers: []"),  # no version
        doc("id: x\ntitle: t\nversion: 1"),  # no triggers
        doc("id: x\ntitle: t\nversion: 1\ntriggers: []\nowner: me"),  # unknown key
        doc("id: X_Y\ntitle: t\nversion: 1\ntriggers: []"),
        doc("id: 7\ntitle: t\nversion: 1\ntriggers: []"),
        doc("id: x\ntitle: ''\nversion: 1\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: 0\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: -3\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: '2'\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: 1.5\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: true\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: 99999999999\ntriggers: []"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: node.attest"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: [7]"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: ['noaction']"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: ['node.attest:broken']"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: ['node.attest', 'node.attest']"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: []", "no numbered steps, only prose\n"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: []", "1. step \x00\n"),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: []", "1. " + "x" * 70_000),
        doc("id: x\ntitle: t\nversion: 1\ntriggers: []", "1. lone \ud800 surrogate\n"),
    ],
)
def test_bad_runbooks_are_refused(text: Any) -> None:
    with pytest.raises(ValidationFailed) as refused:
        parse_runbook(text)
    assert refused.value.code == "invalid_runbook"


def test_a_good_runbook() -> None:
    rb = parse_runbook(GOOD.replace("\n", "\r\n"))
    assert (rb.id, rb.title, rb.version, rb.ref) == ("test-book", "A test", 2, "test-book@v2")
    assert rb.triggers == (Trigger("sink.delivery_failed"),)
    assert rb.body == "1. Do the thing.\n" and len(rb.sha256) == 64


def test_runbook_for_prefers_the_most_specific_trigger() -> None:
    def book(rid: str, *triggers: str) -> Runbook:
        return parse_runbook(doc(f"id: {rid}\ntitle: t\nversion: 3\ntriggers: {list(triggers)}"))

    books = [book("b-any", "node.attest"), book("a-fail", "node.attest:failure"),
             book("c-other", "node.attest")]  # fmt: skip
    assert match("node.attest", "failure", books) == ("a-fail", 3)
    assert match("node.attest", "success", books) == ("b-any", 3)  # lowest id among equals
    assert match("node.attest", None, books) == ("b-any", 3)
    assert match("node.state", "failure", books) is None
    # the shipped set
    assert svc.runbook_for("node.attest", Outcome.FAILURE) == ("attestation-failure", 1)
    assert svc.runbook_for("node.attest", Outcome.SUCCESS) is None
    assert svc.runbook_for("sink.delivery_failed", "failure") == ("siem-sink-down", 1)
    assert svc.runbook_for("workload.device_mismatch", "failure") == (
        "suspected-tenant-breakout",
        1,
    )
    assert svc.runbook_for("alert.auth_failure_spray", "failure") == ("key-compromise", 1)
    assert svc.runbook_for("tenant.create", "success") is None
    assert svc.with_runbook({"a": 1}, "node.state", "success") == {
        "a": 1,
        "runbook": "node-failure@v1",
    }
    assert svc.with_runbook(None, "tenant.create", "success") == {}


# --- publishing --------------------------------------------------------------------------------


def _publish_count(store: Store) -> int:
    with store.read() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(EventRow)
                .where(EventRow.action == svc.PUBLISH_ACTION)
            )
            or 0
        )


def test_a_published_version_is_an_event_and_becomes_current(store: Store) -> None:
    shipped = svc.get_runbook(store, AUDITOR, "key-compromise")
    v2 = (
        shipped["text"]
        .replace("version: 1", "version: 2")
        .replace("1. Read the alert", "1. Page the security officer, then read the alert")
    )
    with store.write(SYSTEM) as tx:
        out = svc.publish_runbook(tx, v2, change_id=5)
    assert (out["id"], out["version"], out["source"], out["change_id"]) == (
        "key-compromise",
        2,
        "published",
        5,
    )
    with store.read() as session:
        event = session.scalar(select(EventRow).where(EventRow.action == "runbook.publish"))
        assert event is not None and event.target_id == "key-compromise"
        assert event.details["text"] == v2 and event.details["previous"] == 1
    now = svc.get_runbook(store, AUDITOR, "key-compromise")
    assert now["version"] == 2 and now["versions"] == [1, 2] and "Page the" in now["steps"]
    assert svc.get_runbook(store, AUDITOR, "key-compromise", 1)["source"] == "shipped"
    listed = {rb["id"]: rb for rb in svc.list_runbooks(store, AUDITOR)}
    assert listed["key-compromise"]["version"] == 2 and listed["node-failure"]["version"] == 1
    with store.read() as session:
        assert svc.runbook_for("alert.auth_failure_burst", "failure", session) == (
            "key-compromise",
            2,
        )
    # not newer, or not a runbook: refused, nothing written
    before = _publish_count(store)
    for text, error in ((v2, Conflict), (shipped["text"], Conflict), ("nope", ValidationFailed)):
        with pytest.raises(error) as refused, store.write(SYSTEM) as tx:
            svc.publish_runbook(tx, text)
        assert refused.value.code in ("runbook_version_not_newer", "invalid_runbook")
    assert _publish_count(store) == before
    # a new id
    with store.write(SYSTEM) as tx:
        svc.publish_runbook(tx, GOOD)
    assert svc.get_runbook(store, AUDITOR, "test-book")["versions"] == [2]


def test_reading_needs_nodes_or_audit_read(store: Store) -> None:
    for actor in (AGENT, Actor("nobody")):
        with pytest.raises(Forbidden):
            svc.list_runbooks(store, actor)
        with pytest.raises(Forbidden):
            svc.get_runbook(store, actor, "node-failure")
    dev = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"acme"}))
    assert len(svc.list_runbooks(store, dev)) == len(SHIPPED)
    with pytest.raises(NotFound) as missing:
        svc.get_runbook(store, AUDITOR, "no-such-book")
    assert missing.value.code == "runbook_not_found"
    with pytest.raises(NotFound):
        svc.get_runbook(store, AUDITOR, "node-failure", 2)
    with pytest.raises(ValidationFailed):
        svc.get_runbook(store, AUDITOR, "node-failure", 0)


# --- alerts name their runbook -----------------------------------------------------------------


def test_alert_events_carry_their_runbook(store: Store) -> None:
    create_tenant(store, SYSTEM, Tenant("lab"))
    access.create_user(store, SYSTEM, "victim", PASSWORD, ["developer"], ["lab"])
    t0 = datetime.now(UTC)
    attempts = [("victim", "203.0.113.9")] * 10 + [(f"ghost{i}", None) for i in range(10)]
    for i, (user, source) in enumerate(attempts):
        with pytest.raises(ProofplaneError):
            access.login(store, user, f"guess {i}", None, session_ttl=timedelta(hours=1),
                         now=t0 + timedelta(seconds=i), source=source)  # fmt: skip
    with store.read() as session:
        alerts = list(session.scalars(select(EventRow).where(EventRow.action.like("alert.%"))))
    assert {a.action for a in alerts} == {
        "alert.auth_failure_burst",
        "alert.auth_source_throttled",
        "alert.auth_failure_spray",
    }
    assert all(a.details["runbook"] == "key-compromise@v1" for a in alerts), alerts


# --- API and CLI -------------------------------------------------------------------------------


def test_api_list_and_show(client: TestClient, store: Store) -> None:
    items = client.get("/api/v1/runbooks").json()["items"]
    assert [rb["id"] for rb in items] == sorted(SHIPPED)
    assert all(rb["source"] == "shipped" and rb["versions"] == [1] for rb in items)
    one = client.get("/api/v1/runbooks/siem-sink-down").json()
    assert one["triggers"] == ["sink.delivery_failed"] and "proofplane sinks flush" in one["steps"]
    assert client.get("/api/v1/runbooks/siem-sink-down", params={"version": 1}).status_code == 200
    for path, params, code in (
        ("/api/v1/runbooks/nope", None, 404),
        ("/api/v1/runbooks/siem-sink-down", {"version": 2}, 404),
        ("/api/v1/runbooks/siem-sink-down", {"version": 0}, 422),
        ("/api/v1/runbooks/siem-sink-down", {"version": "x"}, 422),
        ("/api/v1/runbooks/" + "a" * 64, None, 422),
    ):
        assert client.get(path, params=params).status_code == code, (path, params)
    # an agent credential reads no runbooks
    from proofplane.model import Gpu, Node
    from proofplane.service.nodes import register_node

    register_node(
        store, SYSTEM, Node("n1", "r1", "z1", gpus=(Gpu(0, "GPU-1", "H100-80GB", 81920),))
    )
    token = access.issue_agent_credential(store, SYSTEM, "n1", ttl_days=1).token
    agent = client.get("/api/v1/runbooks", headers={"Authorization": f"Bearer {token}"})
    assert agent.status_code == 403
    anon = client.get("/api/v1/runbooks", headers={"Authorization": ""})
    assert anon.status_code == 401


def test_cli_list_and_show(store: Store, client: TestClient, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from dbtest import ADMIN_TOKEN

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    runner = CliRunner()
    with serve(store) as url:
        base = ["--server", url, "--token", ADMIN_TOKEN, "runbooks"]
        listed = runner.invoke(cli_app, [*base, "list"])
        assert listed.exit_code == 0, listed.output
        assert "key-compromise" in listed.stdout and "(started by hand)" in listed.stdout
        shown = runner.invoke(cli_app, [*base, "show", "attestation-failure"])
        assert shown.exit_code == 0, shown.output
        assert (
            "attestation-failure v1" in shown.stdout and "proofplane attest replay" in shown.stdout
        )
        raw = runner.invoke(cli_app, [*base, "show", "node-failure", "--raw"])
        assert raw.exit_code == 0 and parse_runbook(raw.stdout).id == "node-failure"
        as_json = runner.invoke(
            cli_app, [*base, "show", "node-failure", "--version", "1", "--json"]
        )
        assert as_json.exit_code == 0 and '"version": 1' in as_json.stdout
        missing = runner.invoke(cli_app, [*base, "show", "nope"])
        assert missing.exit_code == 1 and "Traceback" not in missing.output
        assert "not found" in missing.output
