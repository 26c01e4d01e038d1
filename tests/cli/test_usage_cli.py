"""``proofplane usage report`` and ``proofplane cost compare``: against a real server and
straight on a database (``--db``); the same bytes from a copied database file; every mistake a
message and an exit status, never a traceback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from live_server import serve
from proofplane.cli.main import app
from proofplane.service.access import bootstrap_admin
from proofplane.store import migrate
from usage_scenario import WINDOW, ClockStore, build

runner = CliRunner()
TOKEN = "ppt_usage-cli-admin-token-0123456789abcdef"
SPAN = ["--from", WINDOW[0].isoformat(), "--to", WINDOW[1].isoformat()]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PROOFPLANE_TOKEN", "PROOFPLANE_SERVER", "PROOFPLANE_RATE_CARD",
                "PROOFPLANE_COST_MODEL"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file holding the usage scenario, closed (its WAL checkpointed)."""
    path = tmp_path_factory.mktemp("usage-cli") / "usage.db"
    store = ClockStore(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    build(store)
    bootstrap_admin(store, TOKEN, now=datetime.now(UTC))
    store.dispose()
    return f"sqlite:///{path}"


@pytest.fixture(scope="module")
def server(db: str) -> Iterator[str]:
    store = ClockStore(db)
    with serve(store) as url:
        yield url


def run(*args: str) -> Any:
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def ok(result: Any) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.output)
    return result


def test_the_report_as_a_table(db: str) -> None:
    out = ok(run("usage", "report", "--db", db, *SPAN)).stdout
    for word in ("acme", "beta", "H100-80GB/3g.40gb", "TOTAL", "ROUND_HALF_EVEN", "tier=gold"):
        assert word in out, word


def test_the_server_and_the_database_give_the_same_bytes(db: str, server: str) -> None:
    for fmt in ("csv", "focus", "json"):
        local = ok(run("usage", "report", "--db", db, *SPAN, "--format", fmt)).stdout_bytes
        remote = ok(
            run("--server", server, "--token", TOKEN, "usage", "report", *SPAN, "--format", fmt)
        ).stdout_bytes
        api = httpx.get(
            f"{server}/api/v1/usage",
            params={"from": WINDOW[0].isoformat(), "to": WINDOW[1].isoformat(), "format": fmt},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ).content
        assert local == remote == api, fmt


def test_a_copied_database_gives_the_same_bytes(db: str, tmp_path: Path) -> None:
    copy = tmp_path / "copy.db"
    shutil.copyfile(db.removeprefix("sqlite:///"), copy)
    for fmt in ("focus", "csv", "json"):
        a = ok(run("usage", "report", "--db", db, *SPAN, "-f", fmt)).stdout_bytes
        b = ok(run("usage", "report", "--db", f"sqlite:///{copy}", *SPAN, "-f", fmt)).stdout_bytes
        assert a == b and a, fmt


def test_a_tenant_and_a_grouping(db: str) -> None:
    data = json.loads(
        ok(
            run(
                "usage",
                "report",
                "--db",
                db,
                *SPAN,
                "--tenant",
                "beta",
                "--group-by",
                "workload",
                "-f",
                "json",
            )
        ).stdout  # fmt: skip
    )
    assert {x["tenant"] for x in data["lines"]} == {"beta"}
    assert {x["workload"] for x in data["lines"]} == {"infer", "train"}


def test_a_rate_card_with_db(db: str, tmp_path: Path) -> None:
    card = tmp_path / "card.json"
    card.write_text(
        json.dumps(
            {
                "version": 1,
                "name": "flat",
                "currency": "CHF",
                "periods": [
                    {
                        "valid_from": "2020-01-01T00:00:00Z",
                        "skus": {"H100-80GB": {"gpu_hour": "1"}, "A100-40GB": {"gpu_hour": "1"}},
                    }
                ],
            }
        )
    )
    data = json.loads(
        ok(run("usage", "report", "--db", db, *SPAN, "-f", "json", "--rate-card", str(card))).stdout
    )
    assert data["currency"] == "CHF" and data["rate_card"]["name"] == "flat"


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--from", "soon", "--to", "2021-03-02"], 2, "is not an ISO 8601 date"),
        (["--from", "2021-03-02", "--to", "2021-03-01"], 1, "the window is empty"),
        ([*SPAN, "--tenant", "ghost"], 1, "tenant 'ghost' not found"),
        ([*SPAN, "--format", "xml"], 2, "'xml': one of"),
        ([*SPAN, "--group-by", "node"], 2, "'node': one of"),
        ([*SPAN, "--group-by", "pool", "-f", "focus"], 1, "FOCUS rows are per SKU"),
        (["--from", "2019-01-01", "--to", "2019-01-02"], 1, "prices nothing from"),
    ],
)
def test_mistakes_are_messages(db: str, args: list[str], code: int, says: str) -> None:
    result = run("usage", "report", "--db", db, *args)
    assert result.exit_code == code, result.output
    assert says in " ".join(result.output.replace("│", " ").split()), result.output


def test_a_malformed_rate_card(db: str, tmp_path: Path) -> None:
    card = tmp_path / "card.yaml"
    card.write_text("version: 1\ncurrency: dollars\nperiods: [{skus: {H100: {gpu_hour: x}}}]\n")
    result = run("usage", "report", "--db", db, *SPAN, "--rate-card", str(card))
    assert result.exit_code == 1
    assert f"rate card {card}" in result.output and "currency" in result.output
    missing = run("usage", "report", "--db", db, *SPAN, "--rate-card", str(tmp_path / "none"))
    assert missing.exit_code == 1 and "cannot be read" in missing.output


def test_rate_card_needs_db(server: str, tmp_path: Path) -> None:
    result = run("--server", server, "--token", TOKEN, "usage", "report", *SPAN,
                 "--rate-card", str(tmp_path / "card.yaml"))  # fmt: skip
    assert result.exit_code == 2 and "needs --db" in result.output


def test_server_errors_are_messages(server: str) -> None:
    result = run("--server", server, "--token", TOKEN, "usage", "report", "--from",
                 "2021-03-02", "--to", "2021-03-01")  # fmt: skip
    assert result.exit_code == 1 and "invalid_period" in result.output
    result = run("--server", server, "usage", "report", *SPAN)  # no token
    assert result.exit_code == 1 and "unauthenticated" in result.output


def test_cost_compare(db: str, server: str, tmp_path: Path) -> None:
    out = ok(run("cost", "compare", "--db", db, *SPAN)).stdout
    for word in ("H100-80GB", "BARE /EFF-H", "formula:", "capex", "hypervisor overhead"):
        assert word in out, word
    local = json.loads(ok(run("cost", "compare", "--db", db, *SPAN, "--json")).stdout)
    remote = json.loads(
        ok(run("--server", server, "--token", TOKEN, "cost", "compare", *SPAN, "--json")).stdout
    )
    assert local["facts"] == remote["facts"] and local["skus"] == remote["skus"]
    model = tmp_path / "model.yaml"
    model.write_text(
        "version: 1\nname: mine\ncurrency: EUR\npower: {price_per_kwh: '0.3', pue: '1.1'}\n"
        "bare_metal: {H100-80GB: {capex_per_gpu: '1', amortisation_years: 1, "
        "ops_per_gpu_month: '0', assumed_watts: 0}}\n"
        "cloud: {hypervisor_overhead: '0', instances: {}}\n"
    )
    mine = json.loads(
        ok(
            run(
                "--server",
                server,
                "--token",
                TOKEN,
                "cost",
                "compare",
                *SPAN,
                "--json",
                "--cost-model",
                str(model),
            )
        ).stdout  # fmt: skip
    )
    assert mine["currency"] == "EUR" and mine["cost_model"]["name"] == "mine"
    assert [r["sku"] for r in mine["skus"]] == ["H100-80GB"]
    assert mine["facts"] == remote["facts"]  # the server's measurements, priced locally
    model.write_text("version: 1\n")
    bad = run("cost", "compare", "--db", db, *SPAN, "--cost-model", str(model))
    assert bad.exit_code == 1 and "cost model" in bad.output
