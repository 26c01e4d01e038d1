"""``proofplane capacity`` and ``proofplane alerts list`` (issue 15, §8 and §10): headroom, the
N+1 check and the demand forecast per compliance pool; the alerts the audit log holds."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.common import JsonOpt, client

app = typer.Typer(help="Alerts: anomalies, failing controls, capacity, logins, GPU health.",
                  no_args_is_help=True)  # fmt: skip

SEVERITY_STYLES = {"critical": "red", "high": "magenta", "medium": "yellow", "low": "cyan"}


def _n1(check: dict[str, Any]) -> str:
    if check["lost_node"] is None:
        return "ok (no node serves it)"
    if check["ok"]:
        return f"ok without {check['lost_node']}"
    unplaced = check["unplaced"]
    return f"FAILS without {check['lost_node']}: {len(unplaced)} would wait"


def _forecast(f: dict[str, Any] | None) -> str:
    if f is None:
        return "-"
    if f["days"] == 0:
        return "no demand metered"
    days = f["days_to_capacity"]
    trend = f"{f['slope_per_week']:+.2f}/week"
    return f"{trend}; full in {days:g} d" if days is not None else f"{trend}; not filling"


def capacity_table(answer: dict[str, Any]) -> Table:
    table = Table(header_style="bold")
    for col in ("POOL", "NODES", "GPUS", "FREE GPUS", "FREE MIG SLICES", "HELD", "N+1",
                "FORECAST"):  # fmt: skip
        table.add_column(col, overflow="fold")
    for p in answer["pools"]:
        held = p["held"]
        what = f"{held['gpus']} GPUs"
        if held["gpu_shares"]:
            what += f" + {held['gpu_shares']:g} shared"
        if held["mig_slices"]:
            what += f" + {held['mig_slices']} MIG slices"
        check = p["n_plus_one"]
        table.add_row(
            render.text(p["pool"]),
            str(p["nodes"]),
            str(p["gpus"]),
            str(p["headroom"]["gpus"]),
            str(p["headroom"]["mig_slices"]),
            render.text(what),
            render.text(_n1(check), "green" if check["ok"] else "red"),
            render.text(_forecast(p.get("forecast"))),
        )
    return table


def capacity(
    ctx: typer.Context,
    forecast: bool = typer.Option(
        True, "--forecast/--no-forecast", help="Meter the last weeks' demand for a trend."
    ),
    weeks: int = typer.Option(4, "--weeks", min=1, max=12, help="Weeks of demand to trend."),
    as_json: bool = JsonOpt,
) -> None:
    """Per compliance pool: nodes, GPUs, headroom (free GPUs and MIG slices), what is held,
    whether it survives losing its largest node (N+1, decided by the production placement
    core), and the trend of its metered demand. Exits 1 when a pool fails its N+1 check."""
    with client(ctx) as api:
        answer = api.get("/api/v1/capacity", {"forecast": forecast, "weeks": weeks})
    if as_json:
        render.print_json(answer)
    else:
        render.console().print(capacity_table(answer))
        for p in answer["pools"]:
            for u in p["n_plus_one"]["unplaced"]:
                who = u.get("workload", "a workload")
                render.print_line(f"{p['pool']}: {who} would wait ({u['reason']})", "red")
    if not answer["ok"]:
        raise typer.Exit(1)


@app.command("list")
def list_alerts(
    ctx: typer.Context,
    status: str = typer.Option(
        "firing", "--status", help="firing, resolved or all (the newest episode of each)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """The alerts the audit log holds: rule, severity, what, since when, the runbook."""
    with client(ctx) as api:
        answer = api.get("/api/v1/alerts", {"status": status})
    if as_json:
        render.print_json(answer)
        return
    if not answer["items"]:
        render.print_line(f"no {status} alerts" if status != "all" else "no alerts")
        return
    table = Table(header_style="bold")
    for col in ("SINCE", "STATUS", "SEVERITY", "RULE", "SUMMARY", "RUNBOOK", "EVENT"):
        table.add_column(col, overflow="fold")
    for a in answer["items"]:
        table.add_row(
            render.text(a["starts_at"]),
            render.text(a["status"]),
            render.text(a["severity"], SEVERITY_STYLES.get(a["severity"], "")),
            render.text(a["rule"]),
            render.text(a["summary"]),
            render.text(a["runbook"] or "-"),
            str(a["event_seq"]),
        )
    render.console().print(table)
