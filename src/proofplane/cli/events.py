"""``proofplane events …``: the append-only record of every decision and change."""

from __future__ import annotations

import typer

from proofplane.cli import render
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    fetch,
    iso_callback,
    run_list,
)
from proofplane.model import Outcome

app = typer.Typer(help="The event log: every change and decision, in order.", no_args_is_help=True)


@app.command("list")
def list_events(
    ctx: typer.Context,
    action: str | None = typer.Option(
        None, "--action", "-a", help="Exact action, or a prefix ending in * (e.g. 'workload.*')."
    ),
    target_type: str | None = typer.Option(None, "--target-type", help="node, tenant, workload…"),
    target_id: str | None = typer.Option(None, "--target-id", help="e.g. a node name."),
    actor: str | None = typer.Option(None, "--actor"),
    outcome: Outcome | None = typer.Option(None, "--outcome"),
    since: str | None = typer.Option(
        None, "--since", callback=iso_callback, help="ISO 8601 time; UTC when no zone is given."
    ),
    until: str | None = typer.Option(None, "--until", callback=iso_callback),
    newest: bool = typer.Option(False, "--newest", "-n", help="Newest first."),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List events, oldest first (--newest for the latest first)."""
    run_list(
        ctx,
        "/api/v1/events",
        {
            "action": action,
            "target_type": target_type,
            "target_id": target_id,
            "actor": actor,
            "outcome": outcome.value if outcome else None,
            "since": since,
            "until": until,
            "order": "desc" if newest else None,
        },
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.events_table,
        noun="event",
    )


@app.command("show")
def show_event(
    ctx: typer.Context,
    seq: int = typer.Argument(..., min=1, help="The event's sequence number."),
    as_json: bool = JsonOpt,
) -> None:
    """Show one event with its full details."""
    event = fetch(ctx, f"/api/v1/events/{seq}")
    if as_json:
        render.print_json(event)
    else:
        render.show_event(event)
