"""``proofplane backends list|jobs``, and ``logs`` (``proofplane workloads logs NAME``).

``logs`` and ``workload_jobs`` are plain functions: cli/workloads.py registers ``logs`` in the
workloads group and shows the jobs in ``workloads show``.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import JsonOpt, client, fetch

API = "/api/v1"

app = typer.Typer(help="Execution backends: the engine that runs placed workloads.",
                  no_args_is_help=True)  # fmt: skip


def backends_table(items: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in ("NAME", "CONFIGURED", "HEALTHY", "DETAILS"):
        table.add_column(col, overflow="fold" if col == "DETAILS" else "ellipsis")
    for b in items:
        details = {k: v for k, v in b.items() if k not in ("name", "configured", "healthy") and v}
        healthy = b.get("healthy")
        table.add_row(
            render.text(b["name"], "bold" if b["configured"] else None),
            render.text("yes" if b["configured"] else "-"),
            render.text(
                "-" if healthy is None else ("yes" if healthy else "no"),
                None if healthy is None else ("green" if healthy else "red"),
            ),
            render.text(render.pairs({k: str(v) for k, v in details.items()})),
        )
    return table


@app.command("list")
def list_backends(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """The configured engine (PROOFPLANE_BACKEND on the server), its health and options."""
    data = fetch(ctx, f"{API}/backends")
    if as_json:
        render.print_json(data)
        return
    render.console().print(backends_table(data["items"]))


@app.command("jobs")
def jobs(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    tenant: str | None = typer.Option(
        None, "--tenant", "-t", help="When several tenants share it."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """A workload's engine jobs: backend, engine job id, last reported state."""
    data = workload_jobs(ctx, name, tenant)
    if as_json:
        render.print_json(data)
        return
    table = Table(header_style="bold")
    for col in ("BACKEND", "JOB ID", "STATE", "MESSAGE", "UPDATED"):
        table.add_column(col, overflow="fold" if col == "MESSAGE" else "ellipsis")
    for j in data["items"]:
        table.add_row(
            render.text(j["backend"]),
            render.text(j["job_id"]),
            render.text(j["state"]),
            render.text(j.get("message") or ""),
            render.text(render.timestamp(j["updated_at"])),
        )
    render.console().print(table)


def workload_jobs(ctx: typer.Context, name: str, tenant: str | None) -> dict[str, Any]:
    """GET /workloads/{name}/jobs: the workload's engine jobs, oldest first."""
    with client(ctx) as api:
        return api.get(  # type: ignore[no-any-return]
            f"{API}/workloads/{segment(name)}/jobs", params={"tenant": tenant}
        )


def logs(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    stderr: bool = typer.Option(False, "--stderr", help="Show standard error, not output."),
    tail: int | None = typer.Option(None, "--tail", min=1, help="Only the last N bytes."),
    tenant: str | None = typer.Option(
        None, "--tenant", "-t", help="The workload's tenant, when several tenants use the name."
    ),
) -> None:
    """Print the captured output of a workload's latest run (local executor)."""
    params: dict[str, Any] = {"stream": "stderr" if stderr else "stdout", "tenant": tenant}
    if tail:
        params["tail"] = tail
    with client(ctx) as api:
        data = api.get(f"{API}/workloads/{segment(name)}/logs", params=params)
    if data["job_id"] is None:
        render.print_line(f"workload {name} has not run yet", "yellow")
        return
    sys.stdout.write(data["text"])
    sys.stdout.flush()
