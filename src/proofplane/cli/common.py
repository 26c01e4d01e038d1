"""What the client command modules share: the API client of this invocation (with its bearer
token), argument parsers, and the list-command plumbing (one page, or every page with
``--all``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import typer
from rich.table import Table

from proofplane.cli import credentials, render
from proofplane.cli.client import DEFAULT_SERVER, ApiClient


@dataclass
class CliState:
    server: str = DEFAULT_SERVER
    token: str | None = None  # --token / PROOFPLANE_TOKEN
    ca_file: str | None = None  # --ca-file / PROOFPLANE_CA_FILE: CAs to check https with


def state(ctx: typer.Context) -> CliState:
    return ctx.find_object(CliState) or CliState()


def resolve_token(ctx: typer.Context) -> str | None:
    """The bearer token for this invocation: ``--token`` (or PROOFPLANE_TOKEN), else the one
    stored for this server by ``proofplane login``; None when there is neither."""
    st = state(ctx)
    if st.token:
        return st.token
    entry = credentials.lookup(st.server)
    return entry["token"] if entry else None


def client(ctx: typer.Context) -> ApiClient:
    """The API client for the ``--server`` given to the root command, with its token, checking
    an https server against ``--ca-file``."""
    st = state(ctx)
    return ApiClient(st.server, token=resolve_token(ctx), ca_file=st.ca_file)


# --- options every list / show command takes ---------------------------------------------------

JsonOpt = typer.Option(False, "--json", help="Print the API's JSON instead of a table.")
LimitOpt = typer.Option(None, "--limit", min=1, max=500, help="Page size (server default 100).")
CursorOpt = typer.Option(None, "--cursor", help="Start at this page (a previous `next`).")
AllOpt = typer.Option(False, "--all", help="Follow `next` cursors and show every page.")


# --- local argument parsing (a mistake here exits 2 before any request is made) -----------------


def parse_pairs(values: list[str] | None, option: str) -> dict[str, str]:
    """``["hipaa=true", ...]`` → ``{"hipaa": "true"}``; malformed → BadParameter (exit 2)."""
    out: dict[str, str] = {}
    for raw in values or []:
        key, sep, value = raw.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(
                f"{raw!r} is not key=value (e.g. hipaa=true)", param_hint=option
            )
        if key in out and out[key] != value:
            raise typer.BadParameter(f"{key!r} is given twice", param_hint=option)
        out[key] = value
    return out


def iso_callback(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        datetime.fromisoformat(value)
    except ValueError as exc:
        raise typer.BadParameter(
            f"{value!r} is not an ISO 8601 time (e.g. 2025-06-01T12:00:00Z or 2025-06-01)"
        ) from exc
    return value


# --- list and show -----------------------------------------------------------------------------


def run_list(
    ctx: typer.Context,
    path: str,
    params: dict[str, Any],
    *,
    limit: int | None,
    cursor: str | None,
    follow: bool,
    as_json: bool,
    table: Callable[[list[dict[str, Any]]], Table],
    noun: str,
) -> None:
    """Fetch one page (or all, with ``follow``) and print it as JSON or as a table."""
    with client(ctx) as api:
        items: list[dict[str, Any]] = []
        next_cursor: str | None = None
        for page in api.pages(path, {**params, "limit": limit, "cursor": cursor}, follow=follow):
            items.extend(page["items"])
            next_cursor = page.get("next")
    if as_json:
        render.print_json({"items": items, "next": next_cursor})
    else:
        render.print_list(table(items), len(items), noun, next_cursor)


def fetch(ctx: typer.Context, path: str) -> Any:
    with client(ctx) as api:
        return api.get(path)


def send(ctx: typer.Context, method: str, path: str, body: Any = None) -> Any:
    with client(ctx) as api:
        return api.request(method, path, body=body)
