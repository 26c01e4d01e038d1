"""``proofplane users …``: local user accounts, their roles and tenants."""

from __future__ import annotations

from typing import Any

import typer

from proofplane.access.roles import Role
from proofplane.cli import render
from proofplane.cli.auth import PasswordStdinOpt, read_password_stdin
from proofplane.cli.client import segment
from proofplane.cli.common import AllOpt, CursorOpt, JsonOpt, LimitOpt, fetch, run_list, send

app = typer.Typer(help="Users: accounts, roles, tenants, locks.", no_args_is_help=True)

_ROLES = ", ".join(r.value for r in Role)
RoleOpt = typer.Option(
    None, "--role", "-r", help=f"A role ({_ROLES}); repeatable.", show_default=False
)
TenantOpt = typer.Option(
    None,
    "--tenant",
    "-t",
    help="A tenant the developer / tenant-admin roles act on; repeatable.",
    show_default=False,
)


def _done(user: dict[str, Any], as_json: bool, message: str) -> None:
    if as_json:
        render.print_json(user)
    else:
        render.print_line(message)


def _roles(values: list[str] | None) -> list[str] | None:
    """Role names checked locally, so a typo exits 2 before any request."""
    if values is None:
        return None
    known = {r.value for r in Role}
    for v in values:
        if v not in known:
            raise typer.BadParameter(f"{v!r} is not a role ({_ROLES})", param_hint="--role")
    return sorted(set(values))


@app.command("create")
def create_user(
    ctx: typer.Context,
    username: str = typer.Argument(..., help="Lowercase letters, digits and . _ @ -."),
    role: list[str] | None = RoleOpt,
    tenant: list[str] | None = TenantOpt,
    password_stdin: bool = PasswordStdinOpt,
    no_password: bool = typer.Option(
        False, "--no-password", help="No password: the user signs in through SSO only."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Create a local user (the password is prompted for twice unless given on stdin)."""
    if password_stdin and no_password:
        raise typer.BadParameter(
            "--password-stdin and --no-password exclude each other", param_hint="--no-password"
        )
    if not role:
        raise typer.BadParameter("give at least one --role", param_hint="--role")
    roles = _roles(role)
    password: str | None = None
    if password_stdin:
        password = read_password_stdin()
    elif not no_password:
        password = typer.prompt(
            f"Password for {username}", hide_input=True, confirmation_prompt=True, err=True
        )
    body = {
        "username": username,
        "password": password,
        "roles": roles,
        "tenants": sorted(set(tenant or [])),
    }
    user = send(ctx, "POST", "/api/v1/users", body)
    _done(
        user,
        as_json,
        f"user {user['username']} created ({', '.join(user['roles'])}"
        + (f" on {', '.join(user['tenants'])}" if user["tenants"] else "")
        + ")",
    )


@app.command("list")
def list_users(
    ctx: typer.Context,
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List users with their roles, tenants, MFA and lock status."""
    run_list(
        ctx,
        "/api/v1/users",
        {},
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.users_table,
        noun="user",
    )


@app.command("show")
def show_user(
    ctx: typer.Context,
    username: str = typer.Argument(..., help="Username."),
    as_json: bool = JsonOpt,
) -> None:
    """Show one user."""
    user = fetch(ctx, f"/api/v1/users/{segment(username)}")
    if as_json:
        render.print_json(user)
    else:
        render.show_user(user)


@app.command("update")
def update_user(
    ctx: typer.Context,
    username: str = typer.Argument(..., help="Username."),
    role: list[str] | None = typer.Option(
        None, "--role", "-r", help="Replace the roles with these; repeatable.", show_default=False
    ),
    tenant: list[str] | None = typer.Option(
        None,
        "--tenant",
        "-t",
        help="Replace the tenants with these; repeatable.",
        show_default=False,
    ),
    disable: bool | None = typer.Option(
        None,
        "--disable/--enable",
        help="Disable the account (ends its sessions) or enable it again.",
        show_default=False,
    ),
    password_stdin: bool = typer.Option(
        False, "--password-stdin", help="Set a new password, read from the first line of stdin."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Change a user's roles, tenants, password or disabled flag. Their sessions end."""
    body: dict[str, Any] = {}
    if role:
        body["roles"] = _roles(role)
    if tenant:
        body["tenants"] = sorted(set(tenant))
    if disable is not None:
        body["disabled"] = disable
    if password_stdin:
        body["password"] = read_password_stdin()
    if not body:
        raise typer.BadParameter(
            "nothing to change: give --role, --tenant, --disable/--enable or --password-stdin"
        )
    user = send(ctx, "PATCH", f"/api/v1/users/{segment(username)}", body)
    shown = {"disabled": "disabled" if disable else "enabled"}
    changed = ", ".join(shown.get(k, k) for k in body)
    _done(user, as_json, f"user {user['username']} updated ({changed})")


@app.command("unlock")
def unlock_user(
    ctx: typer.Context,
    username: str = typer.Argument(..., help="Username."),
    as_json: bool = JsonOpt,
) -> None:
    """Lift a lock after repeated failed logins (and reset the failure count)."""
    user = send(ctx, "POST", f"/api/v1/users/{segment(username)}/unlock")
    _done(user, as_json, f"user {user['username']} unlocked")
