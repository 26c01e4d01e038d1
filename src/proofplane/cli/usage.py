"""``proofplane usage report`` and ``proofplane cost compare`` (issue 15, §5–§6).

Both ask the server (``GET /api/v1/usage``, ``GET /api/v1/usage/cost-compare``), or with
``--db URL`` read a database straight (a copy of one, say: the same database gives the same
bytes). The server prices with its own rate card (``PROOFPLANE_RATE_CARD``); ``--rate-card``
prices locally and so needs ``--db``. ``cost compare --cost-model FILE`` prices the facts the
server measured with your model, against a server too.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import EXIT_USAGE, ApiClient, CliError
from proofplane.cli.common import resolve_token, state
from proofplane.cli.server import store_errors

app = typer.Typer(
    help="Usage and chargeback from the audit log: GPU-hours, energy, cost per tenant.",
    no_args_is_help=True,
)
cost_app = typer.Typer(
    help="What an effective GPU-hour costs here, against a virtualised/cloud alternative.",
    no_args_is_help=True,
)

REPORT_TIMEOUT_S = 600.0  # a month of a large fleet takes seconds on the server
FORMATS = ("table", "csv", "focus", "json")
GROUPS = ("tenant", "pool", "sku", "workload")


def _when(value: str, option: str) -> datetime:
    """An ISO 8601 date or time; no zone means UTC. Malformed: a usage error (exit 2)."""
    try:
        ts = datetime.fromisoformat(value.strip().replace("z", "Z"))
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not an ISO 8601 date or time (2026-01-01 or 2026-01-01T00:00:00Z)",
            param_hint=option,
        ) from None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def _iso(ts: datetime) -> str:
    return ts.isoformat().replace("+00:00", "Z")


def _api(ctx: typer.Context) -> ApiClient:
    st = state(ctx)
    return ApiClient(
        st.server, token=resolve_token(ctx), ca_file=st.ca_file, timeout=REPORT_TIMEOUT_S
    )


FromOpt = typer.Option(..., "--from", help="Window start: ISO 8601 date or time (UTC if no zone).")
ToOpt = typer.Option(..., "--to", help="Window end, exclusive.")
DbOpt = typer.Option(None, "--db", help="Read this database URL straight, without a server.")


@app.command("report")
def report(
    ctx: typer.Context,
    start: str = FromOpt,
    end: str = ToOpt,
    tenant: str | None = typer.Option(None, "--tenant", help="One tenant (default: all yours)."),
    group_by: str = typer.Option(
        "sku", "--group-by", help="Lines per tenant, pool, sku (and MIG profile) or workload."
    ),
    fmt: str = typer.Option(
        "table", "--format", "-f", help="table, csv, focus (FOCUS 1.x CSV) or json."
    ),
    waste: bool = typer.Option(
        False, "--waste", help="Add allocated-but-idle device-hours from telemetry."
    ),
    db: str | None = DbOpt,
    rate_card: str | None = typer.Option(
        None,
        "--rate-card",
        envvar="PROOFPLANE_RATE_CARD",
        help="Price with this rate card (YAML/JSON; needs --db: a server uses its own).",
    ),
) -> None:
    """GPU-hours per tenant per SKU from the audit log, priced with the rate card.

    csv, focus and json print the exact bytes of the report (the same log and window give the
    same bytes); table is for reading."""
    if fmt not in FORMATS:
        raise typer.BadParameter(f"{fmt!r}: one of {', '.join(FORMATS)}", param_hint="--format")
    if group_by not in GROUPS:
        raise typer.BadParameter(
            f"{group_by!r}: one of {', '.join(GROUPS)}", param_hint="--group-by"
        )
    t0, t1 = _when(start, "--from"), _when(end, "--to")
    wire = "json" if fmt == "table" else fmt
    if db is not None:
        body = _report_db(db, t0, t1, tenant, group_by, wire, waste, rate_card)
    else:
        explicit = ctx.get_parameter_source("rate_card")
        if rate_card is not None and explicit is not None and explicit.name == "COMMANDLINE":
            raise CliError(
                "proofplane: --rate-card prices locally and needs --db; the server prices with "
                "its own rate card (PROOFPLANE_RATE_CARD where it runs)",
                exit_code=EXIT_USAGE,
            )
        params = {
            "from": _iso(t0),
            "to": _iso(t1),
            "tenant": tenant,
            "group_by": group_by,
            "format": wire,
            "waste": "true" if waste else None,
        }
        with _api(ctx) as api:
            body = api.content("/api/v1/usage", params)
    if fmt != "table":
        sys.stdout.buffer.write(body)
        sys.stdout.flush()
        return
    _print_report(json.loads(body))


def _report_db(
    url: str,
    t0: datetime,
    t1: datetime,
    tenant: str | None,
    group_by: str,
    fmt: str,
    waste: bool,
    rate_card: str | None,
) -> bytes:
    from proofplane.access import SYSTEM
    from proofplane.service import usage as usage_svc
    from proofplane.service.context import Store

    with store_errors("usage report"):
        card = usage_svc.load_rate_card(rate_card)
        store = Store(url)
        try:
            result = usage_svc.usage_report(
                store,
                SYSTEM,
                start=t0,
                end=t1,
                now=datetime.now(UTC),
                tenant=tenant,
                group_by=group_by,
                rate_card=card,
                waste=waste,
            )
            return usage_svc.render(result, fmt)
        finally:
            store.dispose()


def _print_report(data: dict[str, Any]) -> None:
    out = render.console()
    w = data["window"]
    cur = data["currency"]
    out.print(
        render.text(
            f"Usage {w['from']} .. {w['to']}"
            + (f" (counted up to {w['end']})" if w.get("partial") else "")
            + f"  rate card: {data['rate_card']['name']} ({data['rate_card']['sha256'][:12]})"
        )
    )
    table = Table(header_style="bold", caption_justify="left")
    columns = ["TENANT", "POOL", "SKU", "WORKLOAD", "PERIOD", "GPU-HOURS", "DEVICE-HOURS",
               "UNIT PRICE", f"LIST {cur}", f"BILLED {cur}", "kWh"]  # fmt: skip
    for col in columns:
        numeric = col.startswith(("GPU", "DEVICE", "UNIT", "LIST", "BILLED", "kWh"))
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")
    for line in data["lines"]:
        unit = line["list_unit_price"]
        table.add_row(
            render.text(line["tenant"]),
            render.text(line["pool"]),
            render.text(line["sku_id"]),
            render.text(line["workload"]),
            render.text(f"{line['period_start']} .. {line['period_end']}"),
            render.text(line["gpu_hours"]),
            render.text(line["device_hours"]),
            render.text(f"{unit}/{line['pricing_unit']}" if unit else None),
            render.text(line["list_cost"]),
            render.text(line["billed_cost"]),
            render.text(line["energy_kwh"]),
        )
    out.print(table)
    totals = Table(header_style="bold", title="Per tenant", title_justify="left")
    for col in ("TENANT", "GPU-HOURS", f"LIST {cur}", f"BILLED {cur}", "kWh"):
        totals.add_column(col, justify="left" if col == "TENANT" else "right")
    for t in data["tenants"]:
        totals.add_row(
            render.text(t["tenant"]),
            render.text(t["gpu_hours"]),
            render.text(t["list_cost"]),
            render.text(t["billed_cost"]),
            render.text(t["energy_kwh"]),
        )
    total = data["total"]
    totals.add_row(
        render.text("TOTAL", "bold"),
        render.text(total["gpu_hours"], "bold"),
        render.text(total["list_cost"], "bold"),
        render.text(total["billed_cost"], "bold"),
        render.text(total["energy_kwh"], "bold"),
    )
    out.print(totals)
    if data.get("waste") is not None:
        waste = Table(
            header_style="bold",
            title="Allocated but idle (telemetry; not the invoice basis)",
            title_justify="left",
        )
        for col in ("TENANT", "ALLOCATED DEV-H", "IDLE DEV-H", "UTIL-ADJ IDLE H", "MEAN ACTIVITY"):
            waste.add_column(col, justify="left" if col == "TENANT" else "right")
        for row in data["waste"]:
            waste.add_row(
                render.text(row["tenant"]),
                render.text(row["allocated_device_hours"]),
                render.text(row["idle_device_hours"]),
                render.text(row["utilisation_adjusted_idle_hours"]),
                render.text(row["mean_activity"]),
            )
        out.print(waste)
    out.print(render.text(f"rounding: {data['rounding']}", "dim"))
    for note in data["notes"]:
        out.print(render.text(f"note: {note}", "dim"))


# --- cost compare --------------------------------------------------------------------------------


@cost_app.command("compare")
def compare(
    ctx: typer.Context,
    start: str = FromOpt,
    end: str = ToOpt,
    cost_model: str | None = typer.Option(
        None,
        "--cost-model",
        help="Your cost model (YAML/JSON; default: the server's, or with --db "
        "PROOFPLANE_COST_MODEL or the shipped illustrative one).",
    ),
    db: str | None = DbOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the JSON (every input and fact)."),
) -> None:
    """Cost per effective GPU-hour on this bare-metal fleet (hardware amortisation, metered
    power, operations, metered utilisation) against a virtualised/cloud alternative (instance
    prices and hypervisor overhead from the cost model), per SKU, every input shown."""
    t0, t1 = _when(start, "--from"), _when(end, "--to")
    from proofplane.meter import cost as cost_core
    from proofplane.service import usage as usage_svc

    if db is not None:
        from proofplane.access import SYSTEM
        from proofplane.service.context import Store

        with store_errors("cost compare"):
            model = usage_svc.load_cost_model(cost_model)
            store = Store(db)
            try:
                result = usage_svc.cost_compare(
                    store, SYSTEM, start=t0, end=t1, now=datetime.now(UTC), model=model
                )
            finally:
                store.dispose()
    else:
        with _api(ctx) as api:
            result = api.get("/api/v1/usage/cost-compare", {"from": _iso(t0), "to": _iso(t1)})
        if cost_model is not None:  # the server's facts, priced with the user's model
            with store_errors("cost compare"):
                model = usage_svc.load_cost_model(cost_model)
                facts = cost_core.facts_from_json(result.get("facts"))
                window = result["window"]
                result = cost_core.compare(
                    model,
                    facts,
                    start=datetime.fromisoformat(window["from"]),
                    end=datetime.fromisoformat(window["end"]),
                )
    if as_json:
        render.print_json(result)
        return
    _print_compare(result)


def _print_compare(data: dict[str, Any]) -> None:
    out = render.console()
    cur = data["currency"]
    w = data["window"]
    out.print(render.text(f"Cost per effective GPU-hour, {w['from']} .. {w['end']} ({cur})"))
    table = Table(header_style="bold")
    cols = ["SKU", "GPUS", "CAPACITY GPU-H", "ALLOCATED GPU-H", "ALLOC", "ACTIVITY",
            "EFFECTIVE GPU-H", "AMORTISATION", "POWER", "OPERATIONS", "BARE METAL TOTAL",
            "BARE /EFF-H", "CLOUD /EFF-H", "BARE:CLOUD"]  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "SKU" else "right", overflow="fold")
    for row in data["skus"]:
        m, b, c = row["measured"], row["bare_metal"], row["cloud"] or {}
        table.add_row(
            render.text(row["sku"]),
            render.text(m["gpus_owned"]),
            render.text(m["capacity_gpu_hours"]),
            render.text(m["allocated_gpu_hours"]),
            render.text(m["allocation"]),
            render.text(f"{m['mean_activity'] or '1'} ({m['activity_source']})"),
            render.text(m["effective_gpu_hours"]),
            render.text(b["amortisation"]),
            render.text(f"{b['power']} ({b['power_source']}, {b['energy_kwh_used']} kWh)"),
            render.text(b["operations"]),
            render.text(b["total"]),
            render.text(b["per_effective_gpu_hour"]),
            render.text(c.get("per_effective_gpu_hour")),
            render.text(row["bare_metal_to_cloud"]),
        )
    out.print(table)
    model = data["cost_model"]
    out.print(render.text(f"cost model: {model['name']} (sha256 {model['sha256'][:12]})", "bold"))
    power = model["power"]
    out.print(render.text(f"  power: {power['price_per_kwh']} {cur}/kWh, PUE {power['pue']}"))
    for sku, b in model["bare_metal"].items():
        out.print(
            render.text(
                f"  bare metal {sku}: capex {b['capex_per_gpu']}/GPU over "
                f"{b['amortisation_years']} years, operations {b['ops_per_gpu_month']}/GPU-month, "
                f"assumed {b['assumed_watts']} W when unmetered"
            )
        )
    cloud = model["cloud"]
    out.print(
        render.text(
            f"  cloud: hypervisor overhead {cloud['hypervisor_overhead']}, billing "
            f"{cloud['billing']}"
        )
    )
    for sku, i in cloud["instances"].items():
        out.print(render.text(f"  cloud {sku}: {i['instance']}, {i['gpus']} GPUs, {i['hourly']}/h"))
    for item in data.get("not_compared") or ():
        out.print(render.text(f"not compared: {item['sku']}: {item['why']}", "yellow"))
    for formula in data["formulas"]:
        out.print(render.text(f"formula: {formula}", "dim"))
    out.print(render.text(f"rounding: {data['rounding']}", "dim"))
