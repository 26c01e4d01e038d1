"""Bodies and sizes (issue 19, §3): the attacks that got through before, refused now.

A 10 MB ``command`` was stored for good in the append-only event log and shipped to every SIEM;
10,000 tags were accepted. Request bodies are now bounded (1 MiB by default, 413
``payload_too_large``; a node's evidence has its own, larger limit), counted as they stream, and
every field has its own bound, checked by the API's bodies and by the services alike.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.api.middleware_limits import BodyLimit
from proofplane.config import MAX_BODY_BYTES, MAX_EVIDENCE_BYTES, Settings, from_env
from proofplane.errors import ValidationFailed
from proofplane.model import validate_tags
from proofplane.model.tags import MAX_TAGS
from proofplane.model.workload import MAX_COMMAND_ARG_CHARS, MAX_COMMAND_ARGS, MAX_COMMAND_CHARS
from proofplane.service import workloads as workload_svc
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, WorkloadRow

API = "/api/v1"
TOKEN = "ppt_test-admin-token-0123456789abcdef"  # conftest's bootstrap admin token


def _client(store: Store, settings: Settings | None = None) -> TestClient:
    return TestClient(
        create_app(store, settings),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )


@pytest.fixture
def small(client: TestClient, store: Store) -> Iterator[TestClient]:
    """A client of an API with small limits: 4 KiB bodies, 64 KiB evidence."""
    with _client(store, Settings(max_body_bytes=4096, max_evidence_bytes=65536)) as c:
        yield c


def too_large(r: Any, limit: int) -> None:
    assert r.status_code == 413, r.text[:300]
    assert r.json() == {
        "error": {
            "code": "payload_too_large",
            "message": f"the request body is larger than {limit} bytes",
            "details": {"limit": limit},
        }
    }


def stored(store: Store) -> tuple[int, int]:
    """(events, workloads) in the store."""
    with store.read() as s:
        return (
            s.scalar(select(func.count()).select_from(EventRow)) or 0,
            s.scalar(select(func.count()).select_from(WorkloadRow)) or 0,
        )


def chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


def workload(**kw: Any) -> dict[str, Any]:
    return {"name": "w1", "tenant": "acme", **kw}


@pytest.fixture
def acme(client: TestClient) -> TestClient:
    r = client.post(f"{API}/tenants", json={"name": "acme"})
    assert r.status_code == 201, r.text
    return client


# --- the request body --------------------------------------------------------------------------


def test_a_10_mb_command_is_refused_and_nothing_is_stored(acme: TestClient, store: Store) -> None:
    before = stored(store)
    r = acme.post(f"{API}/workloads", json=workload(command=["x" * 10_000_000]))
    too_large(r, MAX_BODY_BYTES)
    assert stored(store) == before
    assert r.headers["x-content-type-options"] == "nosniff"  # the 413 is a response like any


def test_a_chunked_body_without_content_length_is_counted(acme: TestClient, store: Store) -> None:
    before = stored(store)
    body = json.dumps(workload(command=["x" * (2 * MAX_BODY_BYTES)])).encode()
    r = acme.post(
        f"{API}/workloads", content=chunks(body), headers={"Content-Type": "application/json"}
    )
    too_large(r, MAX_BODY_BYTES)
    assert stored(store) == before
    # a chunked body under the limit goes through
    r = acme.post(
        f"{API}/workloads",
        content=chunks(json.dumps(workload(command=["true"])).encode(), 8),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 201, r.text
    assert stored(store)[1] == before[1] + 1


def test_the_limit_is_configurable(small: TestClient) -> None:
    assert small.post(f"{API}/tenants", json={"name": "acme"}).status_code == 201
    too_large(small.post(f"{API}/tenants", json={"name": "t2", "description": "x" * 5000}), 4096)
    assert small.get(f"{API}/tenants/acme").status_code == 200  # bodiless requests unaffected


def test_the_evidence_route_has_its_own_larger_limit(small: TestClient) -> None:
    url = f"{API}/nodes/ghost/attestation/evidence"
    big = {"nonce": "00" * 32, "evidence": {"event_log": "A" * 20_000}}  # over 4 KiB
    r = small.post(url, json=big)
    assert r.status_code != 413 and r.status_code < 500, r.text  # judged, not cut off
    too_large(small.post(url, json={**big, "evidence": {"event_log": "A" * 70_000}}), 65536)
    # the larger allowance is the evidence route's alone
    too_large(small.post(f"{API}/nodes/ghost/attestation/enroll", json=big), 4096)


def test_evidence_over_one_mib_is_accepted_by_default(client: TestClient) -> None:
    r = client.post(
        f"{API}/nodes/ghost/attestation/evidence",
        json={"nonce": "00" * 32, "evidence": {"event_log": "A" * (2 * MAX_BODY_BYTES)}},
    )
    assert r.status_code != 413 and r.status_code < 500, r.text[:300]
    assert MAX_EVIDENCE_BYTES > 2 * MAX_BODY_BYTES


def test_a_false_content_length_does_not_let_more_through() -> None:
    """Below the HTTP server (which would refuse such a request itself): the middleware counts
    what arrives, whatever was declared, and the application never sees the rest."""
    seen: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await send({"type": "http.response.start", "status": 400, "headers": []})
                await send({"type": "http.response.body", "body": b"too late"})
                return
            seen.append(message["body"])
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [
        {"type": "http.request", "body": b"x" * 60, "more_body": True},
        {"type": "http.request", "body": b"x" * 60, "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "headers": [(b"content-length", b"10")],
    }
    asyncio.run(BodyLimit(app, limit=100)(scope, receive, send))
    assert seen == [b"x" * 60]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [413]
    assert json.loads(sent[-1]["body"])["error"]["details"] == {"limit": 100}


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the application must not run")

    async def receive() -> dict[str, Any]:
        raise AssertionError("nothing is read")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "PUT", "path": "/", "headers": [(b"content-length", b"101")]}
    asyncio.run(BodyLimit(app, limit=100)(scope, receive, send))
    assert sent[0]["status"] == 413


def test_body_limit_settings_from_the_environment() -> None:
    s = from_env({})
    assert (s.max_body_bytes, s.max_evidence_bytes) == (1 << 20, 16 << 20)
    s = from_env({"PROOFPLANE_MAX_BODY_BYTES": "65536", "PROOFPLANE_MAX_EVIDENCE_BYTES": "99999"})
    assert (s.max_body_bytes, s.max_evidence_bytes) == (65536, 99999)
    assert from_env({"PROOFPLANE_MAX_BODY_BYTES": str(32 << 20)}).max_evidence_bytes == 32 << 20
    for bad in ("0", "-1", "1e6", "lots", str(2 << 30)):
        with pytest.raises(ValidationFailed) as exc:
            from_env({"PROOFPLANE_MAX_BODY_BYTES": bad})
        assert exc.value.code == "invalid_setting"


# --- fields ------------------------------------------------------------------------------------


def invalid(r: Any, where: str) -> None:
    assert r.status_code == 422, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "validation_failed", err
    assert err["message"].startswith(where), err["message"]


def test_ten_thousand_tags_are_refused(acme: TestClient, store: Store) -> None:
    before = stored(store)
    tags = {f"k{i}": "v" for i in range(10_000)}
    invalid(acme.post(f"{API}/workloads", json=workload(tags=tags)), "tags")
    assert stored(store) == before
    ok = {f"k{i}": "v" for i in range(MAX_TAGS)}
    assert acme.post(f"{API}/workloads", json=workload(tags=ok)).status_code == 201


@pytest.mark.parametrize(
    ("command", "where"),
    [
        (["a"] * (MAX_COMMAND_ARGS + 1), "command"),
        (["a" * (MAX_COMMAND_ARG_CHARS + 1)], "command.0"),
        (
            ["a" * MAX_COMMAND_ARG_CHARS] * (MAX_COMMAND_CHARS // MAX_COMMAND_ARG_CHARS + 1),
            "command",
        ),
    ],
    ids=["args", "one-argument", "total"],
)
def test_command_bounds(acme: TestClient, command: list[str], where: str) -> None:
    invalid(acme.post(f"{API}/workloads", json=workload(command=command)), where)


def test_a_command_at_its_bounds_is_accepted(acme: TestClient) -> None:
    command = ["a" * MAX_COMMAND_ARG_CHARS] * (MAX_COMMAND_CHARS // MAX_COMMAND_ARG_CHARS)
    r = acme.post(f"{API}/workloads", json=workload(command=command))
    assert r.status_code == 201, r.text[:300]
    assert r.json()["command"] == command


def test_names_labels_and_other_fields_are_bounded(acme: TestClient) -> None:
    node = {"name": "n1", "region": "r", "zone": "z"}
    invalid(acme.post(f"{API}/nodes", json={**node, "name": "n" * 64}), "name")
    labels = {f"l{i}": "v" for i in range(MAX_TAGS + 1)}
    invalid(acme.post(f"{API}/nodes", json={**node, "labels": labels}), "labels")
    invalid(acme.post(f"{API}/nodes", json={**node, "labels": {"k": "v" * 64}}), "labels")
    gpu = {"index": 0, "uuid": "GPU-1", "model": "H100-80GB" * 100}
    invalid(acme.post(f"{API}/nodes", json={**node, "gpus": [gpu]}), "gpus.0.model")
    invalid(acme.post(f"{API}/tenants", json={"name": "t" * 64}), "name")
    profile = {"required_tags": {f"k{i}": "v" for i in range(MAX_TAGS + 1)}}
    invalid(acme.post(f"{API}/tenants", json={"name": "t2", "profile": profile}), "profile")
    invalid(acme.post(f"{API}/workloads", json=workload(tags={"k" * 64: "v"})), "tags")


def test_the_services_hold_the_same_bounds(demo: Store) -> None:
    """What does not come through the API (the CLI on the server, the demo, batch files) meets
    the same constants."""
    with pytest.raises(ValidationFailed) as exc:
        validate_tags({f"k{i}": "v" for i in range(MAX_TAGS + 1)})
    assert exc.value.code == "too_many_tags"
    assert exc.value.details["limit"] == MAX_TAGS
    tenant = "acme"
    for command in (
        ("a",) * (MAX_COMMAND_ARGS + 1),
        ("a" * (MAX_COMMAND_ARG_CHARS + 1),),
        ("a" * MAX_COMMAND_ARG_CHARS,) * (MAX_COMMAND_CHARS // MAX_COMMAND_ARG_CHARS + 1),
    ):
        spec = workload_svc.WorkloadSpec("w1", tenant, command=command)
        with pytest.raises(ValidationFailed) as exc:
            workload_svc.submit_workload(demo, SYSTEM, spec)
        assert "limit" in exc.value.details


def test_a_cluster_files_workloads_meet_the_command_bounds(store: Store) -> None:
    """A cluster file (``proofplane up --cluster``) reaches the store without the API."""
    from proofplane.hardware.cluster_file import parse_cluster
    from proofplane.service.cluster import load_cluster

    text = (
        "cluster: big\n"
        "tenants:\n  - name: acme\n"
        "nodes:\n  - name: n1\n    region: r\n    zone: z\n"
        "    gpus: [{model: H100-80GB, count: 1}]\n"
        "workloads:\n  - name: w1\n    tenant: acme\n    gpus: {count: 1}\n"
        f"    command: [sh, -c, {'x' * (MAX_COMMAND_ARG_CHARS + 1)}]\n"
    )
    before = stored(store)
    with pytest.raises(ValidationFailed) as exc:
        load_cluster(store, SYSTEM, parse_cluster(text))
    assert "4096" in exc.value.message
    assert stored(store) == before
