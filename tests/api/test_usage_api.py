"""GET /api/v1/usage and /api/v1/usage/cost-compare on SQLite and PostgreSQL: the bill
reconciles with an independent reading of the events API to the cent; the same log gives the
same bytes (a copied SQLite file too); bad input is a clear 4xx."""

from __future__ import annotations

import csv
import io
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dbtest import ADMIN_TOKEN
from proofplane.access import Actor, Role
from proofplane.api.app import create_app
from proofplane.meter.focus import COLUMNS
from proofplane.service import usage as usage_svc
from proofplane.service.access import bootstrap_admin
from usage_scenario import T0, WINDOW, ClockStore, H, build, recompute

API = "/api/v1/usage"
PARAMS = {"from": WINDOW[0].isoformat(), "to": WINDOW[1].isoformat()}


@pytest.fixture
def usage_store(db_url: str) -> Iterator[ClockStore]:
    store = ClockStore(db_url)
    build(store)
    bootstrap_admin(store, ADMIN_TOKEN, now=datetime.now(UTC))
    yield store
    store.dispose()


def api_client(store: ClockStore) -> TestClient:
    return TestClient(
        create_app(store),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )


@pytest.fixture
def client(usage_store: ClockStore) -> Iterator[TestClient]:
    with api_client(usage_store) as c:
        yield c


def test_the_bill_reconciles_with_the_events_api_to_the_cent(client: TestClient) -> None:
    expected = recompute(client, *WINDOW)
    r = client.get(API, params=PARAMS)
    assert r.status_code == 200, r.text
    report = r.json()
    got = {t["tenant"]: t for t in report["tenants"]}
    assert set(got) == set(expected) == {"acme", "beta"}
    for tenant, want in expected.items():
        assert Decimal(got[tenant]["billed_cost"]) == want["billed"], tenant
        assert Decimal(got[tenant]["gpu_hours"]) == Decimal(
            str(round(float(want["gpu_hours"]), 6))
        ), tenant
    total = sum((w["billed"] for w in expected.values()), Decimal(0))
    assert Decimal(report["total"]["billed_cost"]) == total > 0
    # every kind of holding is in the report
    kinds = {(x["tenant"], x["sku_id"]) for x in report["lines"]}
    assert ("beta", "H100-80GB/3g.40gb") in kinds  # a MIG slice, 3/7 of a GPU
    assert any(sku and sku.endswith("/shared") for _t, sku in kinds)  # the notebook's share
    assert ("beta", "A100-40GB") in kinds  # beta's "train", not acme's
    pools = {x["pool"] for x in report["lines"] if x["tenant"] == "beta"}
    assert "tier=gold" in pools


def test_mig_and_share_weights_in_the_report(client: TestClient) -> None:
    lines = client.get(API, params={**PARAMS, "group_by": "workload"}).json()["lines"]
    infer = [x for x in lines if x["workload"] == "infer"]
    (mig,) = infer
    # held from 0:00 to 5:20: 5 1/3 instance-hours, x 3/7 of a GPU
    assert Decimal(mig["device_hours"]) == Decimal("5.333333")
    assert Decimal(mig["gpu_hours"]) == Decimal("2.285714")  # 16/3 x 3/7 = 16/7
    notebook = [x for x in lines if x["workload"] == "notebook"]
    assert sum(Decimal(x["gpu_hours"]) for x in notebook) == Decimal("2.375000")  # 9.5 h x 1/4
    gang = [x for x in lines if x["workload"] == "gang"]
    assert sum(Decimal(x["gpu_hours"]) for x in gang) == Decimal("17.500000")  # 2 GPUs x 8.75 h


def test_the_same_log_gives_the_same_bytes(client: TestClient) -> None:
    for fmt in ("json", "csv", "focus"):
        a = client.get(API, params={**PARAMS, "format": fmt})
        b = client.get(API, params={**PARAMS, "format": fmt})
        assert a.status_code == 200 and a.content == b.content, fmt
    focus = client.get(API, params={**PARAMS, "format": "focus"})
    assert focus.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(focus.text)))
    assert rows and list(rows[0]) == list(COLUMNS)
    billed = sum(Decimal(r["BilledCost"]) for r in rows)
    assert billed == Decimal(client.get(API, params=PARAMS).json()["total"]["billed_cost"])
    assert {r["ChargeCategory"] for r in rows} == {"Usage"}
    assert {r["BillingCurrency"] for r in rows} == {"USD"}


def test_a_copied_sqlite_file_gives_the_same_bytes(
    usage_store: ClockStore, db_url: str, tmp_path: Path
) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("a file copy is the SQLite case; PostgreSQL is covered by the test above")
    with api_client(usage_store) as c:
        before = {f: c.get(API, params={**PARAMS, "format": f}).content for f in ("json", "focus")}
    usage_store.dispose()  # checkpoints the WAL into the main file
    source = Path(db_url.removeprefix("sqlite:///"))
    copy = tmp_path / "copy.db"
    shutil.copyfile(source, copy)
    other = ClockStore(f"sqlite:///{copy}")
    try:
        with api_client(other) as c:
            for fmt, body in before.items():
                assert c.get(API, params={**PARAMS, "format": fmt}).content == body, fmt
    finally:
        other.dispose()


def test_scoped_callers_see_their_tenants_only(usage_store: ClockStore) -> None:
    dev = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"beta"}))
    now = datetime.now(UTC)
    report = usage_svc.usage_report(usage_store, dev, start=WINDOW[0], end=WINDOW[1], now=now)
    assert {x.tenant for x in report.lines} == {"beta"}
    assert report.unallocated_energy_kwh is None
    from proofplane.errors import NotFound

    with pytest.raises(NotFound):
        usage_svc.usage_report(
            usage_store, dev, start=WINDOW[0], end=WINDOW[1], now=now, tenant="acme"
        )


def test_a_window_reaching_past_now_is_cut_at_now(usage_store: ClockStore) -> None:
    now = T0 + 2 * H
    report = usage_svc.usage_report(usage_store, Actor("a", frozenset({Role.ADMIN})),
                                     start=WINDOW[0], end=WINDOW[1], now=now)  # fmt: skip
    assert report.end == now and report.requested_end == WINDOW[1]
    assert any(n.startswith("partial") for n in report.notes)
    # 0-2h: train 2 GPUs x 2 h + infer 3/7 x 2 + notebook 1/4 x 1.5 + gang 2 x 0.75
    expected = Decimal(4) + Decimal(6) / 7 + Decimal("0.375") + Decimal("1.5")
    assert report.total_gpu_hours == expected.quantize(Decimal("0.000001"))


@pytest.mark.parametrize(
    ("params", "status", "code"),
    [
        ({"from": "yesterday", "to": "2021-03-02"}, 422, "validation_failed"),
        ({"from": "2021-03-01"}, 422, "validation_failed"),
        ({"from": "2021-03-02", "to": "2021-03-01"}, 422, "invalid_period"),
        ({"from": "2021-03-01", "to": "2021-03-01"}, 422, "invalid_period"),
        ({**PARAMS, "tenant": "ghost"}, 404, "not_found"),
        ({**PARAMS, "format": "xml"}, 422, "validation_failed"),
        ({**PARAMS, "group_by": "node"}, 422, "validation_failed"),
        ({**PARAMS, "group_by": "tenant", "format": "focus"}, 422, "invalid_group_by"),
        ({**PARAMS, "tenant": "x" * 64}, 422, "validation_failed"),
        ({"from": "2019-01-01T00:00:00Z", "to": "2019-01-02T00:00:00Z"}, 422, "rate_card_gap"),
        ({"from": "9999-12-31T23:00:00-14:00", "to": "2021-03-01"}, 422, "invalid_period"),
    ],
)
def test_bad_input_is_a_clear_4xx(
    client: TestClient, params: dict[str, str], status: int, code: str
) -> None:
    r = client.get(API, params=params)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    assert r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("version: 1\ncurrency: USD\nperiods: []\n", "invalid_rate_card"),
        ("{ not yaml: [", "invalid_rate_card"),
        (None, "invalid_rate_card"),  # the file does not exist
    ],
)
def test_a_malformed_server_rate_card_is_a_clear_error(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, code: str
) -> None:
    path = tmp_path / "card.yaml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv(usage_svc.RATE_CARD_ENV, str(path))
    r = client.get(API, params=PARAMS)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == code and str(path) in err["message"]


def test_a_rate_card_from_the_environment_and_its_periods(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "card.yaml"
    path.write_text(
        "version: 1\nname: two prices\ncurrency: EUR\nperiods:\n"
        "  - valid_from: '2021-01-01T00:00:00Z'\n    valid_to: '2021-03-01T05:00:00Z'\n"
        "    skus: {H100-80GB: {gpu_hour: '1'}, A100-40GB: {gpu_hour: '1'}}\n"
        "  - valid_from: '2021-03-01T05:00:00Z'\n    valid_to: null\n    discount: '0.5'\n"
        "    skus: {H100-80GB: {gpu_hour: '1'}, A100-40GB: {gpu_hour: '1'}}\n"
    )
    monkeypatch.setenv(usage_svc.RATE_CARD_ENV, str(path))
    report = client.get(API, params={**PARAMS, "group_by": "tenant"}).json()
    assert report["currency"] == "EUR" and report["rate_card"]["name"] == "two prices"
    periods = {(x["period_start"], x["period_end"]) for x in report["lines"]}
    assert periods == {
        ("2021-03-01T00:00:00Z", "2021-03-01T05:00:00Z"),
        ("2021-03-01T05:00:00Z", "2021-03-01T10:00:00Z"),
    }
    late = [x for x in report["lines"] if x["period_start"].endswith("05:00:00Z")]
    assert all(Decimal(x["billed_cost"]) < Decimal(x["list_cost"]) for x in late)


def test_cost_compare(client: TestClient) -> None:
    r = client.get(f"{API}/cost-compare", params=PARAMS)
    assert r.status_code == 200, r.text
    data = r.json()
    skus = {row["sku"]: row for row in data["skus"]}
    assert set(skus) == {"H100-80GB", "A100-40GB"}
    h100 = skus["H100-80GB"]["measured"]
    assert h100["gpus_owned"] == 8 and h100["hours"] == "10.000000000"
    assert h100["activity_source"] == "assumed 1"
    assert skus["H100-80GB"]["bare_metal"]["power_source"] == "assumed"
    assert data["cost_model"]["power"]["pue"]  # every input is shown
    assert {f["sku"] for f in data["facts"]} == set(skus)
    r = client.get(f"{API}/cost-compare", params={"from": "2021-03-02", "to": "2021-03-01"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_period"
