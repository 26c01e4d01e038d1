"""``proofplane tokens …``: API tokens for scripts and automation, each with an expiry."""

from __future__ import annotations

import re

import typer

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import JsonOpt, client, send

app = typer.Typer(help="API tokens: create, list, revoke, rotate.", no_args_is_help=True)

MIN_SECONDS = 60
MAX_SECONDS = 90 * 86400  # the API's limit: 90 days
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d{1,10})([smhd]?)")


def parse_duration(value: str, option: str = "--expires-in") -> int:
    """``3600``, ``30m``, ``12h``, ``7d``, ``90d`` → seconds; from 1 minute to 90 days, else
    BadParameter (exit 2)."""
    m = _DURATION.fullmatch(value.strip().lower())
    if m is None:
        raise typer.BadParameter(
            f"{value!r} is not a duration: seconds, or a number with s, m, h or d "
            "(e.g. 3600, 30m, 12h, 7d)",
            param_hint=option,
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if seconds > MAX_SECONDS:
        raise typer.BadParameter(
            f"{value!r} is longer than 90 days, the most a token may live", param_hint=option
        )
    if seconds < MIN_SECONDS:
        raise typer.BadParameter(f"{value!r} is shorter than 1 minute", param_hint=option)
    return seconds


@app.command("create")
def create_token(
    ctx: typer.Context,
    expires_in: str = typer.Option(
        ...,
        "--expires-in",
        "-e",
        help="How long it lives: seconds, or 30m, 12h, 7d … (at most 90d; created with an "
        "API token, no longer than that token).",
    ),
    role: list[str] | None = typer.Option(
        None,
        "--role",
        "-r",
        help="Carry only these of your roles; repeatable (default: all of yours).",
        show_default=False,
    ),
    tenant: list[str] | None = typer.Option(
        None,
        "--tenant",
        "-t",
        help="Reach only these of your tenants; repeatable (default: all of yours).",
        show_default=False,
    ),
    name: str = typer.Option("", "--name", "-n", help="What it is for (shown in lists)."),
    as_json: bool = JsonOpt,
) -> None:
    """Create an API token for yourself. It is printed once; only its id is shown again."""
    body = {
        "expires_in": parse_duration(expires_in),
        "roles": sorted(set(role)) if role else None,
        "tenants": sorted(set(tenant)) if tenant else None,
        "name": name,
    }
    issued = send(ctx, "POST", "/api/v1/tokens", body)
    if as_json:
        render.print_json(issued)
    else:
        render.issued_token(issued, "API token")


@app.command("list")
def list_tokens(
    ctx: typer.Context,
    owner: str | None = typer.Option(
        None, "--owner", help="Another user's tokens (admins and auditors).", show_default=False
    ),
    include_inactive: bool = typer.Option(
        False, "--all", help="Include revoked tokens (expired ones are always listed)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """List your tokens (admins and auditors: everyone's, or --owner's)."""
    with client(ctx) as api:
        page = api.get(
            "/api/v1/tokens",
            {"owner": owner, "include_inactive": "true" if include_inactive else None},
        )
    items = page.get("items", []) if isinstance(page, dict) else []
    if as_json:
        render.print_json({"items": items, "next": None})
    else:
        render.print_list(render.tokens_table(items), len(items), "token", None)


@app.command("revoke")
def revoke_token(
    ctx: typer.Context,
    token_id: str = typer.Argument(..., metavar="ID", help="The token's id (tok_…)."),
    as_json: bool = JsonOpt,
) -> None:
    """Revoke a token: it stops working at once."""
    info = send(ctx, "DELETE", f"/api/v1/tokens/{segment(token_id)}")
    if as_json:
        render.print_json(info)
    else:
        render.print_line(f"token {info['id']} revoked")


@app.command("rotate")
def rotate_token(
    ctx: typer.Context,
    token_id: str = typer.Argument(..., metavar="ID", help="The token's id (tok_…)."),
    expires_in: str | None = typer.Option(
        None,
        "--expires-in",
        "-e",
        help="The new token's lifetime (default: the old one's).",
        show_default=False,
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Replace one of your API tokens with a new secret of the same scope; the old one, and
    the tokens it minted, stop working. Only the owner rotates (an admin revokes instead)."""
    body = {"expires_in": parse_duration(expires_in)} if expires_in is not None else None
    issued = send(ctx, "POST", f"/api/v1/tokens/{segment(token_id)}/rotate", body)
    if as_json:
        render.print_json(issued)
    else:
        render.print_line(f"token {token_id} revoked and replaced by {issued['id']}")
        render.issued_token(issued, "new API token")
