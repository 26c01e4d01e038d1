"""``proofplane runbooks list|show``: the response procedures the control plane ships and
publishes (issue 12). A new version is published through a ``runbook.publish`` change; ``show
ID --raw`` prints the document to start the next version from."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import JsonOpt, client

app = typer.Typer(help="Runbooks: the steps that answer alerts and incidents.",
                  no_args_is_help=True)  # fmt: skip


def runbooks_table(items: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold")
    for col in ("ID", "VERSION", "TITLE", "TRIGGERS", "SOURCE"):
        table.add_column(col, overflow="fold")
    for rb in items:
        table.add_row(
            render.text(rb["id"]),
            render.text(f"v{rb['version']}"),
            render.text(rb["title"]),
            render.text(", ".join(rb["triggers"]) or "(started by hand)"),
            render.text(rb["source"]),
        )
    return table


@app.command("list")
def list_runbooks(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """Every runbook at its current version, with the events it answers."""
    with client(ctx) as api:
        answer = api.get("/api/v1/runbooks")
    if as_json:
        render.print_json(answer)
        return
    if not answer["items"]:
        render.print_line("no runbooks")
        return
    render.console().print(runbooks_table(answer["items"]))


@app.command("show")
def show_runbook(
    ctx: typer.Context,
    runbook_id: str = typer.Argument(..., metavar="ID", help="The runbook's id (runbooks list)."),
    version: int | None = typer.Option(None, "--version", min=1, help="An older version."),
    raw: bool = typer.Option(
        False,
        "--raw",
        help="Print the document itself (header and steps), e.g. to write its next version from.",
    ),  # fmt: skip
    as_json: bool = JsonOpt,
) -> None:
    """One runbook: its header, then its steps."""
    params = {"version": version} if version is not None else None
    with client(ctx) as api:
        rb = api.get(f"/api/v1/runbooks/{segment(runbook_id)}", params)
    if as_json:
        render.print_json(rb)
        return
    if raw:
        typer.echo(rb["text"], nl=False)
        return
    render.print_line(f"{rb['id']} v{rb['version']}: {rb['title']}", "bold")
    render.print_line(f"answers: {', '.join(rb['triggers']) or '(started by hand)'}")
    where = rb["source"] if rb["event_seq"] is None else f"{rb['source']} (event {rb['event_seq']})"
    render.print_line(f"source: {where}; versions: {', '.join(map(str, rb['versions']))}")
    typer.echo("")
    typer.echo(rb["steps"], nl=False)
