"""Change requests over HTTP and on the command line (issue 12, §6): every route's happy path
and refusals (each a 4xx with its code, never a 500), the two-person flow with three tokens,
separation of duties and the roles that never approve; the CLI's create, list, show, approve,
apply, diff and export against a real server."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from live_server import serve
from proofplane.access import SYSTEM, Actor, Role
from proofplane.api.app import create_app
from proofplane.cli.main import app as cli_app
from proofplane.model import Gpu, Node, NodeState, Tenant
from proofplane.service.access import create_user, issue_token
from proofplane.service.context import Store
from proofplane.service.nodes import register_node, set_node_state
from proofplane.service.tenants import create_tenant
from proofplane.store import migrate

API = "/api/v1/changes"
GRANT = {"node": "gpu-01", "key": "hipaa", "value": "true"}
PEOPLE: dict[str, tuple[set[Role], set[str]]] = {
    "alice": ({Role.ADMIN}, set()),  # the requester
    "bob": ({Role.ADMIN}, set()),  # the first approver
    "sec": ({Role.SECURITY_OFFICER}, set()),  # the second approver
    "dev": ({Role.DEVELOPER}, {"t1"}),
    "aud": ({Role.AUDITOR}, set()),
    "ops": ({Role.OPERATOR}, set()),
}


def prepare(path: Path) -> tuple[Store, dict[str, str]]:
    """A store with an admitted node gpu-01, a tenant t1, and a token per person."""
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    register_node(
        store, SYSTEM, Node("gpu-01", "r1", "z1", gpus=(Gpu(0, "GPU-1", "H100-80GB", 81920),))
    )
    set_node_state(store, SYSTEM, "gpu-01", NodeState.ADMITTED, "test")
    create_tenant(store, SYSTEM, Tenant("t1"))
    tokens = {}
    for name, (roles, tenants) in PEOPLE.items():
        create_user(store, SYSTEM, name, None, sorted(roles), sorted(tenants))
        actor = Actor(name, frozenset(roles), frozenset(tenants), token_id="setup")
        issued = issue_token(store, actor, roles=None, tenants=None, expires_in=3600)
        tokens[name] = issued.token
    return store, tokens


class Http:
    """One TestClient, a request as any of the people."""

    def __init__(self, client: TestClient, tokens: dict[str, str]) -> None:
        self.client, self.tokens = client, tokens

    def __call__(self, who: str | None, method: str, path: str, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}
        return self.client.request(method, path, headers=headers, **kw)


@pytest.fixture
def http(tmp_path: Path) -> Iterator[Http]:
    store, tokens = prepare(tmp_path / "api.db")
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        yield Http(client, tokens)
    store.dispose()


def ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def refused(response: Any, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code, response.text


def create(http: Http, who: str = "alice", payload: dict[str, Any] | None = None) -> Any:
    body = {"type": "certification.grant", "payload": payload or GRANT, "reason": "audit"}
    return ok(http(who, "POST", API, json=body), 201)


# --- the two-person flow -----------------------------------------------------------------------


def test_a_grant_approved_by_two_others_applies_over_http(http: Http) -> None:
    change = create(http)
    cid = change["id"]
    assert change["state"] == "pending" and change["requested_by"] == "alice"
    assert change["approvals"] == [] and len(change["payload_sha256"]) == 64
    refused(http("alice", "POST", f"{API}/{cid}/approve"), 403, "separation_of_duties")
    refused(http("alice", "POST", f"{API}/{cid}/apply"), 409, "change_not_approved")
    first = ok(http("bob", "POST", f"{API}/{cid}/approve", json={"comment": "checked"}))
    assert first["state"] == "pending" and first["approvals"][0]["by"] == "bob"
    assert first["approvals"][0]["comment"] == "checked"
    refused(http("bob", "POST", f"{API}/{cid}/approve"), 409, "already_voted")
    second = ok(http("sec", "POST", f"{API}/{cid}/approve"))  # no body at all
    assert second["state"] == "approved"
    refused(http("sec", "POST", f"{API}/{cid}/apply"), 403, "forbidden")  # applies nothing
    applied = ok(http("alice", "POST", f"{API}/{cid}/apply", json={}))
    assert applied["state"] == "applied" and applied["applied_by"] == "alice"
    node = ok(http("aud", "GET", "/api/v1/nodes/gpu-01"))
    assert node["certifications"] == {"hipaa": "true"}
    refused(http("alice", "POST", f"{API}/{cid}/apply"), 409, "change_not_approved")
    refused(http("alice", "POST", f"{API}/{cid}/cancel"), 409, "change_not_pending")
    shown = ok(http("aud", "GET", f"{API}/{cid}"))  # auditors read
    assert [a["by"] for a in shown["approvals"]] == ["bob", "sec"]


def test_the_editor_cannot_approve_and_an_edit_voids_approvals(http: Http) -> None:
    cid = create(http)["id"]
    ok(http("sec", "POST", f"{API}/{cid}/approve"))
    edited = ok(http("bob", "PATCH", f"{API}/{cid}", json={"payload": {**GRANT, "value": "no"}}))
    assert edited["last_edited_by"] == "bob" and edited["payload"]["value"] == "no"
    assert [a["current"] for a in edited["approvals"]] == [False]
    refused(http("bob", "POST", f"{API}/{cid}/approve"), 403, "separation_of_duties")
    refused(http("bob", "PATCH", f"{API}/{cid}", json={"payload": {}}), 422, "invalid_payload")
    refused(http("dev", "PATCH", f"{API}/{cid}", json={"payload": GRANT}), 403, "forbidden")


@pytest.mark.parametrize("who", ["dev", "aud", "ops"])
def test_roles_without_changes_approve_get_403(http: Http, who: str) -> None:
    cid = create(http)["id"]
    for action in ("approve", "deny", "review"):
        refused(http(who, "POST", f"{API}/{cid}/{action}"), 403, "forbidden")


def test_deny_cancel_and_list(http: Http) -> None:
    denied = create(http)["id"]
    assert ok(http("sec", "POST", f"{API}/{denied}/deny", json={"comment": "no"}))["state"] == (
        "denied"
    )
    refused(http("bob", "POST", f"{API}/{denied}/approve"), 409, "change_not_pending")
    cancelled = create(http)["id"]
    refused(http("ops", "POST", f"{API}/{cancelled}/cancel"), 403, "forbidden")
    assert ok(http("alice", "POST", f"{API}/{cancelled}/cancel"))["state"] == "cancelled"
    body = {"type": "quota.set", "payload": {"tenant": "t1", "gpus": 2}}
    quota = ok(http("alice", "POST", API, json=body), 201)
    page = ok(http("aud", "GET", API))
    assert [c["id"] for c in page["items"]] == [quota["id"], cancelled, denied]
    assert page["next"] is None
    assert [c["id"] for c in ok(http("sec", "GET", API, params={"state": "denied"}))["items"]] == [
        denied
    ]
    by_type = ok(http("sec", "GET", API, params={"type": "quota.set"}))["items"]
    assert [c["id"] for c in by_type] == [quota["id"]]
    first = ok(http("aud", "GET", API, params={"limit": 2}))
    assert len(first["items"]) == 2 and first["next"]
    rest = ok(http("aud", "GET", API, params={"limit": 2, "cursor": first["next"]}))
    assert [c["id"] for c in rest["items"]] == [denied] and rest["next"] is None
    refused(http("aud", "GET", API, params={"state": "weird"}), 422, "invalid_state")
    refused(http("aud", "GET", API, params={"type": "nope"}), 422, "unknown_change_type")
    refused(http("aud", "GET", API, params={"cursor": "garbage"}), 422, "invalid_cursor")
    refused(http("dev", "GET", API), 403, "forbidden")  # developers do not read changes


def test_emergency_change_and_its_review_over_http(http: Http) -> None:
    body = {"type": "certification.grant", "payload": GRANT, "reason": "regulator",
            "emergency": True}  # fmt: skip
    change = ok(http("alice", "POST", API, json=body), 201)
    assert change["state"] == "applied" and change["review_state"] == "pending"
    cid = change["id"]
    refused(http("alice", "POST", f"{API}/{cid}/review"), 403, "separation_of_duties")
    ok(http("bob", "POST", f"{API}/{cid}/review"))
    assert ok(http("sec", "POST", f"{API}/{cid}/review"))["review_state"] == "done"
    refused(http("bob", "POST", f"{API}/{cid}/review"), 409, "no_review_pending")
    normal = create(http)["id"]
    refused(http("bob", "POST", f"{API}/{normal}/review"), 409, "no_review_pending")
    body_ops = {**body, "payload": {"node": "gpu-01", "reason": "x"}, "type": "node.readmit"}
    refused(http("ops", "POST", API, json=body_ops), 403, "forbidden")  # an admin's only
    refused(http("alice", "POST", API, json={**body, "reason": ""}), 422, "invalid_reason")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"type": "nope", "payload": {}}, 422, "unknown_change_type"),
        ({"type": "certification.grant", "payload": {"node": "gpu-01"}}, 422, "invalid_payload"),
        ({"type": "certification.grant", "payload": {**GRANT, "x": 1}}, 422, "invalid_payload"),
        ({"type": "quota.set", "payload": {"tenant": "t1", "gpus": "2"}}, 422, "invalid_payload"),
        ({"type": "certification.grant", "payload": []}, 422, "validation_failed"),
        ({"type": "certification.grant", "payload": GRANT, "emergency": "yes"}, 422,
         "validation_failed"),
        ({"type": "certification.grant", "payload": GRANT, "extra": 1}, 422, "validation_failed"),
        ({"type": "certification.grant", "payload": GRANT, "reason": "x" * 3000}, 422,
         "validation_failed"),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_with_its_code(
    http: Http, body: dict[str, Any], status: int, code: str
) -> None:
    refused(http("alice", "POST", API, json=body), status, code)
    assert ok(http("aud", "GET", API))["items"] == []  # nothing was written


def test_refusals_and_missing_things_never_500(http: Http) -> None:
    refused(http(None, "GET", API), 401, "unauthenticated")
    refused(http(None, "POST", API, json={"type": "x", "payload": {}}), 401, "unauthenticated")
    refused(http("dev", "POST", API, json={"type": "certification.grant", "payload": GRANT}),
            403, "forbidden")  # fmt: skip
    for method, path in (("GET", f"{API}/999"), ("POST", f"{API}/999/approve"),
                         ("POST", f"{API}/999/apply"), ("POST", f"{API}/999/cancel"),
                         ("POST", f"{API}/999/deny"), ("POST", f"{API}/999/review")):  # fmt: skip
        refused(http("alice", method, path), 404, "not_found")
    refused(http("alice", "PATCH", f"{API}/999", json={"payload": GRANT}), 404, "not_found")
    for path in (f"{API}/0", f"{API}/abc", f"{API}/{2**64}"):
        assert http("alice", "GET", path).status_code == 422
    long = {"comment": "c" * 3000}
    cid = create(http)["id"]
    assert http("bob", "POST", f"{API}/{cid}/approve", json=long).status_code == 422
    assert http("bob", "POST", f"{API}/{cid}/approve", json=[1]).status_code == 422
    # applying a change whose node disappeared from service: 4xx, the error kept on it
    missing = create(http, payload={**GRANT, "node": "ghost"})["id"]
    ok(http("bob", "POST", f"{API}/{missing}/approve"))
    ok(http("sec", "POST", f"{API}/{missing}/approve"))
    response = http("alice", "POST", f"{API}/{missing}/apply")
    assert 400 <= response.status_code < 500, response.text
    after = ok(http("aud", "GET", f"{API}/{missing}"))
    assert after["state"] == "approved" and after["error"]


def test_location_header_and_openapi(http: Http) -> None:
    response = http("alice", "POST", API, json={"type": "certification.grant", "payload": GRANT})
    assert response.headers["location"] == f"{API}/{response.json()['id']}"
    paths = http.client.get("/openapi.json").json()["paths"]
    assert {f"{API}", f"{API}/export", f"{API}/{{change_id}}", f"{API}/{{change_id}}/approve",
            f"{API}/{{change_id}}/review"} <= set(paths)  # fmt: skip


# --- the CLI against a real server -------------------------------------------------------------

runner = CliRunner()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    store, tokens = prepare(tmp_path_factory.mktemp("changes-cli") / "cli.db")
    with serve(store) as url:
        yield url, tokens


def cli(live: tuple[str, dict[str, str]], who: str, *args: str) -> Any:
    url, tokens = live
    return runner.invoke(cli_app, ["--server", url, "--token", tokens[who], *args])


def cli_ok(result: Any) -> str:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return str(result.stdout)


def cli_json(result: Any) -> Any:
    return json.loads(cli_ok(result))


def test_cli_create_approve_apply_diff_and_export(
    live: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    payload = json.dumps({"node": "gpu-01", "key": "gdpr-zone", "value": "frankfurt"})
    change = cli_json(cli(live, "alice", "changes", "create", "certification.grant",
                          "--payload", payload, "--reason", "audit", "--json"))  # fmt: skip
    cid = str(change["id"])
    assert change["state"] == "pending"
    out = cli_ok(cli(live, "alice", "changes", "create", "certification.grant",
                     "--payload", payload))  # fmt: skip
    assert "pending" in out and "approve" in out  # says what to do next

    diff = cli_json(cli(live, "aud", "changes", "diff", cid, "--json"))
    assert diff["before"] == {} and diff["after"] == {"gdpr-zone": "frankfurt"}
    assert diff["changes"] == [{"key": "gdpr-zone", "before": None, "after": "frankfurt"}]
    table = cli_ok(cli(live, "aud", "changes", "diff", cid))
    assert "gdpr-zone" in table and "frankfurt" in table

    self_approval = cli(live, "alice", "changes", "approve", cid)
    assert self_approval.exit_code == 1 and "separation_of_duties" in self_approval.output
    cli_ok(cli(live, "bob", "changes", "approve", cid, "--comment", "ok"))
    approved = cli_json(cli(live, "sec", "changes", "approve", cid, "--json"))
    assert approved["state"] == "approved"
    assert "applied" in cli_ok(cli(live, "alice", "changes", "apply", cid))

    shown = cli_ok(cli(live, "aud", "changes", "show", cid))
    assert "applied" in shown and "bob" in shown and "sec" in shown
    listed = cli_json(cli(live, "aud", "changes", "list", "--state", "applied", "--json"))
    assert [c["id"] for c in listed["items"]] == [int(cid)]
    assert cid in cli_ok(cli(live, "aud", "changes", "list", "--type", "certification.grant"))

    target = tmp_path / "register.csv"
    cli_ok(cli(live, "aud", "changes", "export", "--format", "csv", "-o", str(target)))
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    row = next(r for r in rows if r["id"] == cid)
    assert row["sod_passed"] == "true" and row["applied_by"] == "alice"
    assert [a.split("@")[0] for a in row["approvers"].split(";")] == ["bob", "sec"]
    register = cli_json(cli(live, "aud", "changes", "export", "--from", "2000-01-01",
                            "--to", "2999-01-01"))  # fmt: skip
    assert any(item["id"] == int(cid) for item in register["items"])
    assert "audit prove --index" in register["verify"]


def test_cli_payload_from_file_deny_cancel_review_and_errors(
    live: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    body = tmp_path / "quota.json"
    body.write_text(json.dumps({"tenant": "t1", "gpus": 4, "mig_slices": None}))
    quota = cli_json(cli(live, "alice", "changes", "create", "quota.set", "--payload",
                         f"@{body}", "--json"))  # fmt: skip
    diff = cli_json(cli(live, "aud", "changes", "diff", str(quota["id"]), "--json"))
    assert diff["before"] == {"gpus": None, "mig_slices": None}
    assert diff["after"] == {"gpus": 4, "mig_slices": None}
    denied = cli_json(cli(live, "sec", "changes", "deny", str(quota["id"]), "--json"))
    assert denied["state"] == "denied"

    again = cli_json(cli(live, "alice", "changes", "create", "quota.set", "--payload",
                         f"@{body}", "--json"))  # fmt: skip
    assert "cancelled" in cli_ok(cli(live, "alice", "changes", "cancel", str(again["id"])))

    grant = json.dumps({"node": "gpu-01", "key": "tier", "value": "gold"})
    emergency = cli_json(cli(live, "alice", "changes", "create", "certification.grant",
                             "--payload", grant, "--emergency", "--reason", "now",
                             "--json"))  # fmt: skip
    assert emergency["state"] == "applied" and emergency["review_state"] == "pending"
    cli_ok(cli(live, "bob", "changes", "review", str(emergency["id"])))

    bad = cli(live, "alice", "changes", "create", "certification.grant", "--payload", "{nope")
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    missing = cli(live, "alice", "changes", "create", "certification.grant", "--payload",
                  f"@{tmp_path / 'absent.json'}")  # fmt: skip
    assert missing.exit_code == 2
    unknown = cli(live, "alice", "changes", "create", "nope", "--payload", "{}")
    assert unknown.exit_code == 1 and "unknown_change_type" in unknown.output
    bad_time = cli(live, "aud", "changes", "export", "--from", "yesterday")
    assert bad_time.exit_code == 2


def test_cli_diff_for_other_types(live: tuple[str, dict[str, str]]) -> None:
    policy = {"node_class": "gpu", "policy": {"pcrs": {"0": "00" * 32}}}
    change = cli_json(cli(live, "alice", "changes", "create", "attestation.policy", "--payload",
                          json.dumps(policy), "--json"))  # fmt: skip
    diff = cli_json(cli(live, "aud", "changes", "diff", str(change["id"]), "--json"))
    assert diff["before"] is None and diff["after"]["policy"]["node_class"] == "gpu"
    profile = {"tenant": "t1", "profile": {"required_tags": {"hipaa": "true"}}}
    change = cli_json(cli(live, "alice", "changes", "create", "tenant.profile", "--payload",
                          json.dumps(profile), "--json"))  # fmt: skip
    diff = cli_json(cli(live, "aud", "changes", "diff", str(change["id"]), "--json"))
    assert diff["after"]["profile"] == {"required_tags": {"hipaa": "true"}}
    assert any(c["key"] == "profile.required_tags.hipaa" for c in diff["changes"])
    readmit = {"node": "gpu-01", "reason": "fixed"}
    change = cli_json(cli(live, "alice", "changes", "create", "node.readmit", "--payload",
                          json.dumps(readmit), "--json"))  # fmt: skip
    diff = cli_json(cli(live, "aud", "changes", "diff", str(change["id"]), "--json"))
    assert diff["before"] == {"state": "admitted"} and diff["after"] == {"state": "admitted"}
    assert diff["changes"] == []
