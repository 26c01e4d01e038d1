"""``proofplane telemetry …``: GPU readings (raw or hourly), the newest of each device, drained
GPUs and their recovery, tenants' idle policies (issue 15). Simulated readings (the demo's)
say so in every table and in the JSON (``simulated``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    fetch,
    iso_callback,
    run_list,
    send,
)

app = typer.Typer(
    help="GPU telemetry: readings, rollups, drained GPUs, idle policies.", no_args_is_help=True
)

SIMULATED = render.text("simulated", "yellow")


def _table(*columns: str) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in columns:
        table.add_column(col, no_wrap=True)
    return table


def _num(value: Any) -> str:
    if value is None:
        return "-"
    v = float(value)
    return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.4e}"


def _device(item: dict[str, Any]) -> str:
    gi = item.get("gi_id")
    uuid = str(item["gpu_uuid"])
    short = uuid if len(uuid) <= 16 else uuid[:12] + "…"
    if gi is None:
        return short
    return f"{short}/gi{gi}" + (f" {item['profile']}" if item.get("profile") else "")


def _holder(item: dict[str, Any]) -> str:
    if item.get("tenant") is None:
        return "-"
    return f"{item['tenant']}/{item['workload']}"


def readings_table(items: Sequence[dict[str, Any]]) -> Table:
    table = _table("TIME (UTC)", "NODE", "DEVICE", "FIELD", "VALUE", "UNIT", "HELD BY",
                   "SHARE", "")  # fmt: skip
    for r in items:
        table.add_row(
            render.text(render.timestamp(r["ts"])), render.text(r["node"]),
            render.text(_device(r)), render.text(r["field"]), render.text(_num(r["value"])),
            render.text(r.get("unit")), render.text(_holder(r)),
            render.text(_num(r.get("share"))), SIMULATED if r.get("simulated") else render.text(""),
        )  # fmt: skip
    return table


def hourly_table(items: Sequence[dict[str, Any]]) -> Table:
    table = _table("HOUR (UTC)", "NODE", "DEVICE", "FIELD", "COUNT", "SUM", "MIN", "MAX",
                   "LAST", "HELD BY", "")  # fmt: skip
    for r in items:
        table.add_row(
            render.text(render.timestamp(r["hour"])), render.text(r["node"]),
            render.text(_device(r)), render.text(r["field"]), render.text(r["count"]),
            render.text(_num(r["sum"])), render.text(_num(r["min"])),
            render.text(_num(r["max"])), render.text(_num(r["last"])),
            render.text(_holder(r)), SIMULATED if r.get("simulated") else render.text(""),
        )  # fmt: skip
    return table


@app.command("list")
def list_readings(
    ctx: typer.Context,
    node: str | None = typer.Option(None, "--node", help="Only this node's GPUs."),
    tenant: str | None = typer.Option(None, "--tenant", help="Only what this tenant held."),
    field: str | None = typer.Option(None, "--field", "-f", help="A DCGM field name."),
    start: str | None = typer.Option(
        None, "--from", callback=iso_callback, help="ISO 8601 time; UTC when no zone is given."
    ),
    end: str | None = typer.Option(None, "--to", callback=iso_callback),
    hourly: bool = typer.Option(False, "--hourly", help="Stored hourly rollups, not readings."),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List GPU readings (oldest first) or hourly rollups, filtered."""
    run_list(
        ctx,
        "/api/v1/telemetry",
        {
            "node": node,
            "tenant": tenant,
            "field": field,
            "from": start,
            "to": end,
            "resolution": "hour" if hourly else None,
        },  # fmt: skip
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=hourly_table if hourly else readings_table,
        noun="rollup" if hourly else "reading",
    )


@app.command("latest")
def latest(
    ctx: typer.Context,
    node: str | None = typer.Option(None, "--node", help="Only this node's GPUs."),
    field: str | None = typer.Option(None, "--field", "-f", help="Only this DCGM field."),
    as_json: bool = JsonOpt,
) -> None:
    """The newest reading of every device and field."""
    path = "/api/v1/telemetry/latest" + (f"?node={segment(node)}" if node else "")
    items = [i for i in fetch(ctx, path)["items"] if field is None or i["field"] == field]
    if as_json:
        render.print_json({"items": items})
        return
    render.print_list(readings_table(items), len(items), "reading", None)


@app.command("health")
def health(
    ctx: typer.Context,
    node: str | None = typer.Option(None, "--node"),
    as_json: bool = JsonOpt,
) -> None:
    """GPUs drained for their health (fatal XID, ECC, row remap, thermal)."""
    path = "/api/v1/gpu-health" + (f"?node={segment(node)}" if node else "")
    items = fetch(ctx, path)["items"]
    if as_json:
        render.print_json({"items": items})
        return
    table = _table("GPU", "NODE", "SINCE (UTC)", "CAUSE", "XID", "WORK LOST", "WHY")
    for d in items:
        table.add_row(
            render.text(d["gpu_uuid"]), render.text(d["node"]),
            render.text(render.timestamp(d["since"])), render.text(d["cause"]),
            render.text(d["xid"]), render.text("yes" if d["device_lost"] else "no"),
            render.text(d["message"]),
        )  # fmt: skip
    render.print_list(table, len(items), "drained GPU", None)


@app.command("recover")
def recover(
    ctx: typer.Context,
    node: str = typer.Argument(..., help="The GPU's node."),
    gpu: str = typer.Argument(..., help="The drained GPU's UUID."),
    as_json: bool = JsonOpt,
) -> None:
    """Return a drained GPU to service (an operator's action, recorded as gpu.recover)."""
    out = send(ctx, "POST", f"/api/v1/nodes/{segment(node)}/gpus/{segment(gpu)}/recover")
    if as_json:
        render.print_json(out)
        return
    render.print_line(f"GPU {gpu} of node {node} is back in service")
    if out.get("node_cordoned"):
        render.print_line(f"node {node} is still cordoned: `proofplane nodes` admits it again",
                          style="yellow")  # fmt: skip


@app.command("idle-policy")
def idle_policy(
    ctx: typer.Context,
    tenant: str = typer.Argument(..., help="The tenant."),
    action: str | None = typer.Option(
        None, "--action", help="notify (an event) or reclaim (evict idle preemptible work)."
    ),
    window_minutes: float | None = typer.Option(None, "--window-minutes", min=1),
    threshold: float | None = typer.Option(
        None, "--threshold", help="Idle below this GR_ENGINE_ACTIVE ratio (default 0.05)."
    ),
    preemptible_priority: int | None = typer.Option(
        None, "--preemptible-priority", help="reclaim: workloads at or below this priority."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Show a tenant's idle policy, or set it (with any option)."""
    path = f"/api/v1/tenants/{segment(tenant)}/idle-policy"
    wanted = {"action": action, "window_s": None if window_minutes is None else
              window_minutes * 60, "threshold": threshold,
              "preemptible_priority": preemptible_priority}  # fmt: skip
    body = {k: v for k, v in wanted.items() if v is not None}
    if body:
        current = fetch(ctx, path)["idle_policy"]
        out = send(ctx, "PUT", path, {**current, **body})
    else:
        out = fetch(ctx, path)
    if as_json:
        render.print_json(out)
        return
    p = out["idle_policy"]
    note = " (the default: none set)" if out.get("default") else ""
    render.print_line(
        f"tenant {tenant}: {p['action']} when GR_ENGINE_ACTIVE stays below {p['threshold']:g} "
        f"for {p['window_s'] / 60:g} min; reclaim takes workloads of priority <= "
        f"{p['preemptible_priority']}{note}"
    )
