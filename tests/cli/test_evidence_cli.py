"""``proofplane evidence package`` through the API server (a job, then the download) and
straight from the database, ``proofplane evidence verify`` on the result (and on a tampered
copy, naming what changed), and the API's answers to bad requests."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from ci import SHARED, unavailable
from console_world import SETTINGS, World, build_world
from dbtest import ADMIN_TOKEN
from live_server import serve
from proofplane.cli.main import app

runner = CliRunner()
CATALOG = SHARED / "data" / "oscal" / "NIST_SP-800-53_rev5_catalog.json"
API = "/api/v1/evidence/packages"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    if not CATALOG.is_file():
        unavailable(f"NIST's OSCAL catalog is missing: {CATALOG}")
    return build_world(tmp_path_factory.mktemp("evidence-cli"), ADMIN_TOKEN)


@pytest.fixture(scope="module")
def server(world: World) -> Iterator[str]:
    with serve(world.store, SETTINGS) as url:
        yield url


def _period(days: int = 1) -> tuple[str, str]:
    now = datetime.now(UTC)
    return (now - timedelta(days=days)).isoformat(), now.isoformat()


def cli(server: str, *args: str) -> Any:
    return runner.invoke(app, ["--server", server, "--token", ADMIN_TOKEN, *args])


def test_package_through_the_server_then_verify(server: str, tmp_path: Path) -> None:
    start, end = _period()
    out = tmp_path / "soc2"
    result = cli(server, "evidence", "package", "--framework", "soc2", "--from", start,
                 "--to", end, "-o", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "wrote evidence package ev-" in result.output
    assert (out / "report.pdf").is_file() and (out / "verification-bundle.json").is_file()
    verified = runner.invoke(app, ["evidence", "verify", str(out)])
    assert verified.exit_code == 0, verified.output
    assert verified.output.startswith("ok: package ev-")
    # the bundle is the audit bundle format: audit verify-bundle checks it as it is
    bundle = runner.invoke(app, ["audit", "verify-bundle", str(out / "verification-bundle.json")])
    assert bundle.exit_code == 0, bundle.output

    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    target = tampered / "artifacts" / "accounts.json"
    target.write_text(target.read_text().replace("security-officer", "developer"))
    failed = runner.invoke(app, ["evidence", "verify", str(tampered)])
    assert failed.exit_code == 1
    assert "does NOT verify" in failed.output
    assert "artifacts/accounts.json: its SHA-256 does not match the manifest" in failed.output


def test_package_straight_from_the_database(world: World, tmp_path: Path) -> None:
    start, end = _period()
    out = tmp_path / "pci"
    args = ["--framework", "pci-dss", "--from", start, "--to", end, "--db", world.url]
    result = runner.invoke(app, ["evidence", "package", *args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["evidence", "verify", str(out)]).exit_code == 0


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--framework", "sox"], "unknown_framework"),
        (["--from", "2026-01-02", "--to", "2026-01-01"], "empty_period"),
        (["--from", "2999-01-01", "--to", "2999-02-01"], "period_in_future"),
        (["--tenant", "no-such-tenant"], "not_found"),
    ],
)
def test_bad_input_is_a_clear_cli_error(server: str, tmp_path: Path, args, code) -> None:
    start, end = _period()
    base = {"--framework": "hipaa", "--from": start, "--to": end}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    flat = [x for kv in base.items() for x in kv]
    result = cli(server, "evidence", "package", *flat, "-o", str(tmp_path / "x"))
    assert result.exit_code == 1, result.output
    assert code in result.output
    assert not (tmp_path / "x").exists()  # no partial package


def test_cli_refuses_a_bad_date_and_a_used_directory(server: str, tmp_path: Path) -> None:
    bad = cli(server, "evidence", "package", "--framework", "hipaa", "--from", "yesterday",
              "--to", "2026-01-01", "-o", str(tmp_path / "x"))  # fmt: skip
    assert bad.exit_code == 2 and "ISO 8601" in bad.output
    far = ["--from", "9999-12-31T23:59:59-14:00", "--to", "2026-01-01"]
    edge = cli(server, "evidence", "package", "--framework", "hipaa", *far, "-o", str(tmp_path))
    assert edge.exit_code == 2 and "outside the years" in edge.output
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("x")
    start, end = _period()
    used = cli(server, "evidence", "package", "--framework", "hipaa", "--from", start, "--to",
               end, "-o", str(tmp_path / "used"))  # fmt: skip
    assert used.exit_code == 2 and "not an empty directory" in used.output
    assert runner.invoke(app, ["evidence", "verify", str(tmp_path / "nope")]).exit_code == 2


def test_the_api_job(server: str) -> None:
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    start, end = _period()
    with httpx.Client(base_url=server, headers=auth, timeout=30) as c:
        for body, status, code in [
            ({"framework": "sox", "from": start, "to": end}, 422, "unknown_framework"),
            ({"framework": "hipaa", "from": end, "to": start}, 422, "empty_period"),
            (
                {
                    "framework": "hipaa",
                    "from": "2999-01-01T00:00:00Z",
                    "to": "2999-02-01T00:00:00Z",
                },
                422,
                "period_in_future",
            ),  # fmt: skip
            ({"framework": "hipaa", "from": start, "to": end, "tenant": "nope"}, 404, "not_found"),
            ({"framework": "hipaa", "from": start}, 422, "validation_failed"),
            ({"framework": "hipaa", "from": start, "to": end, "x": 1}, 422, "validation_failed"),
        ]:
            r = c.post(API, json=body)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        job = c.post(API, json={"framework": "iso27001", "from": start, "to": end})
        assert job.status_code == 202 and job.json()["status"] == "running"
        job_id = job.json()["id"]
        for _ in range(120):
            state = c.get(f"{API}/{job_id}").json()
            if state["status"] != "running":
                break
            time.sleep(0.25)
        assert state["status"] == "done", state
        assert state["controls"] >= 10 and state["package"].startswith("ev-")
        r = c.get(f"{API}/{job_id}/download")
        assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
        assert c.get(f"{API}/job-0000000000000000").status_code == 404
        assert c.get(f"{API}/not-a-job").status_code == 422
        # the package is on the record
        events = c.get("/api/v1/events", params={"action": "evidence.package"}).json()["items"]
        assert any(e["target_id"] == state["package"] for e in events)
        details = next(e for e in events if e["target_id"] == state["package"])["details"]
        assert details["framework"] == "iso27001" and len(details["manifest_sha256"]) == 64
        json.dumps(details)
