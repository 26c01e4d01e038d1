"""``proofplane workloads …``: submit, list, inspect and cancel workloads."""

from __future__ import annotations

from typing import Any

import typer

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    fetch,
    parse_pairs,
    run_list,
    send,
)
from proofplane.model import IsolationLevel, WorkloadStatus

app = typer.Typer(help="Workloads: submit, inspect, cancel.", no_args_is_help=True)


@app.command("submit")
def submit(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name (lowercase letters, digits, '-')."),
    command: list[str] | None = typer.Argument(
        None, help="The command to run; put it after `--` when it has options of its own."
    ),
    tenant: str = typer.Option(..., "--tenant", "-t", help="The tenant it runs for."),
    tag: list[str] | None = typer.Option(
        None, "--tag", help="key=value compliance tag; repeatable (e.g. --tag hipaa=true)."
    ),
    isolation: IsolationLevel | None = typer.Option(
        None, "--isolation", help="Default: what the GPU request implies, raised to the floor."
    ),
    gpus: int | None = typer.Option(
        None, "--gpus", "-g", min=1, help="Whole GPUs, or MIG instances with --mig-profile."
    ),
    model: str | None = typer.Option(None, "--model", help="Pin a GPU SKU, e.g. H100-80GB."),
    mig_profile: str | None = typer.Option(None, "--mig-profile", help="e.g. 3g.40gb"),
    share_milli: int | None = typer.Option(
        None, "--share-milli", help="A fraction of one GPU in thousandths (1-999)."
    ),
    priority: int = typer.Option(0, "--priority", min=-1000, max=1000),
    as_json: bool = JsonOpt,
) -> None:
    """Submit a workload; it is placed at once on compliant capacity or waits with a reason.

    Example: proofplane workloads submit my-job --tenant research-lab --gpus 2 -- python train.py
    """
    request: dict[str, Any] = {
        "model": model,
        "mig_profile": mig_profile,
        "share_milli": share_milli,
    }
    if gpus is not None:
        request["count"] = gpus
    body: dict[str, Any] = {
        "name": name,
        "tenant": tenant,
        "tags": parse_pairs(tag, "--tag"),
        "isolation": isolation.value if isolation else None,
        "gpus": {k: v for k, v in request.items() if v is not None},
        "priority": priority,
        "command": list(command or []),
    }
    workload = send(ctx, "POST", "/api/v1/workloads", body)
    if as_json:
        render.print_json(workload)
    else:
        render.workload_outcome(workload, "submitted")


@app.command("list")
def list_workloads(
    ctx: typer.Context,
    tenant: str | None = typer.Option(None, "--tenant", "-t"),
    status: WorkloadStatus | None = typer.Option(None, "--status"),
    node: str | None = typer.Option(None, "--node", help="Only workloads placed on this node."),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List workloads with their status, request and node."""
    run_list(
        ctx,
        "/api/v1/workloads",
        {"tenant": tenant, "status": status.value if status else None, "node": node},
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.workloads_table,
        noun="workload",
    )


@app.command("show")
def show(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    as_json: bool = JsonOpt,
) -> None:
    """Show one workload: where it was placed, or why it waits."""
    workload = fetch(ctx, f"/api/v1/workloads/{segment(name)}")
    if as_json:
        render.print_json(workload)
    else:
        render.show_workload(workload)


@app.command("cancel")
def cancel(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    reason: str | None = typer.Option(None, "--reason", "-r"),
    as_json: bool = JsonOpt,
) -> None:
    """Cancel a workload; its capacity is freed and offered to waiting work."""
    workload = send(ctx, "POST", f"/api/v1/workloads/{segment(name)}/cancel", {"reason": reason})
    if as_json:
        render.print_json(workload)
    else:
        render.workload_outcome(workload, "cancelled")
