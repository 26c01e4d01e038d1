"""``proofplane login | logout | whoami`` and ``proofplane mfa enroll | confirm``.

A login stores the session token in the credentials file for that server (see
``proofplane.cli.credentials``); every client command then sends it. Passwords, TOTP codes and
tokens are read from hidden prompts or stdin and never printed.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import click
import qrcode
import typer
from rich.text import Text

from proofplane.cli import credentials, render
from proofplane.cli.client import ApiClient, ApiError, ServerUnreachable
from proofplane.cli.common import JsonOpt, client, resolve_token, state

mfa_app = typer.Typer(help="Second factor (TOTP): enroll an authenticator.", no_args_is_help=True)

PasswordStdinOpt = typer.Option(
    False,
    "--password-stdin",
    help="Read the password from the first line of stdin (for scripts) instead of a prompt.",
)


def read_password_stdin() -> str:
    """The first line of stdin, without its line ending (exit 2 when there is none)."""
    line = sys.stdin.readline()
    password = line.rstrip("\r\n")
    if not password:
        raise typer.BadParameter("no password on stdin", param_hint="--password-stdin")
    return password


def _who(me: dict[str, Any]) -> str:
    roles = ", ".join(me.get("roles") or []) or "no roles"
    tenants = me.get("tenants") or []
    return f"{me['username']} ({roles}{' on ' + ', '.join(tenants) if tenants else ''})"


# --- login / logout / whoami -------------------------------------------------------------------


def login(
    ctx: typer.Context,
    username: str | None = typer.Option(
        None, "--username", "-u", help="Default: prompt for it.", show_default=False
    ),
    password_stdin: bool = PasswordStdinOpt,
    totp: str | None = typer.Option(
        None,
        "--totp",
        help="A TOTP code or a recovery code (default: prompt when the account needs one).",
        show_default=False,
    ),
) -> None:
    """Log in with a username and password (and a TOTP code when the account has MFA); the
    session token is stored for this server and used by every other command."""
    server = state(ctx).server
    if username is None:
        username = typer.prompt("Username", err=True).strip()
    password = (
        read_password_stdin()
        if password_stdin
        else typer.prompt("Password", hide_input=True, err=True)
    )
    body: dict[str, Any] = {"username": username, "password": password}
    if totp:
        body["totp"] = totp
    with ApiClient(server, auth_hints=False) as api:
        try:
            issued = api.post("/api/v1/auth/login", body)
        except ApiError as exc:
            if exc.code != "mfa_required" or totp:
                raise
            body["totp"] = typer.prompt("TOTP code (or a recovery code)", err=True).strip()
            issued = api.post("/api/v1/auth/login", body)
    if issued.get("mfa_enrollment_required"):
        path = credentials.store(
            server,
            token=issued["token"],
            username=username,
            expires_at=issued.get("expires_at"),
            kind="enrollment",
        )
        render.print_line(
            f"{username}'s roles require a second factor (TOTP), and none is set up yet.",
            style="yellow",
        )
        render.print_line(
            f"An enrollment session (valid until {render.timestamp(issued.get('expires_at'))}) "
            f"is stored in {path}: run 'proofplane mfa enroll' now, then log in again."
        )
        return
    with ApiClient(server, token=issued["token"]) as api:
        me = api.get("/api/v1/auth/me")
    path = credentials.store(
        server,
        token=issued["token"],
        username=me.get("username", username),
        expires_at=issued.get("expires_at"),
        kind=issued.get("kind", "session"),
    )
    render.print_line(f"logged in to {api.server} as {_who(me)}", style="green")
    render.print_line(
        f"session valid until {render.timestamp(issued.get('expires_at'))}; stored in {path}"
    )


def logout(ctx: typer.Context) -> None:
    """End the session on the server and forget the stored credentials for it (locally even
    when the server cannot be reached)."""
    st = state(ctx)
    where = credentials.server_key(st.server)
    stored = credentials.lookup(st.server)
    token = resolve_token(ctx)
    if token is None:
        render.print_line(f"not logged in to {where}")
        return
    # The stored entry is forgotten only when it is the credential being logged out.
    forget = stored is not None and stored["token"] == token
    problem = None
    try:
        with ApiClient(st.server, token=token) as api:
            api.post("/api/v1/auth/logout")
    except ServerUnreachable as exc:
        if not forget:
            raise
        problem = f"the server could not be reached ({exc.why})"
    except ApiError as exc:
        if exc.status != 401 or not forget:
            raise
        problem = "the server no longer accepts the stored credentials"
    if forget:
        credentials.remove(st.server)
    if problem is not None:
        click.echo(
            f"proofplane: {problem}; removed the stored credentials for {where} locally",
            err=True,
        )
        return
    who = f" ({stored['username']})" if stored and stored.get("username") else ""
    render.print_line(f"logged out of {where}{who}")
    if stored and forget and stored.get("kind") == "api":
        render.print_line(
            "the API token itself stays valid until it expires or is revoked "
            "('proofplane tokens revoke ID')",
            style="yellow",
        )


def whoami(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """Show who the current credentials belong to: roles, tenants, token."""
    with client(ctx) as api:
        me = api.get("/api/v1/auth/me")
    if as_json:
        render.print_json(me)
    else:
        render.show_me(me, api.server)


# --- MFA ---------------------------------------------------------------------------------------


def qr_text(data: str) -> str:
    """``data`` as a QR code drawn with block characters, for a terminal."""
    qr = qrcode.QRCode()
    qr.add_data(data)
    buf = io.StringIO()
    qr.print_ascii(out=buf, invert=True)
    return buf.getvalue()


def _confirm(ctx: typer.Context, code: str) -> list[str]:
    with client(ctx) as api:
        answer = api.post("/api/v1/auth/mfa/confirm", {"totp": code.strip()})
    return list(answer["recovery_codes"])


def _after_confirm(ctx: typer.Context, username: str) -> bool:
    """Confirming ends the user's sessions: forget the stored one if it is theirs."""
    server = state(ctx).server
    stored = credentials.lookup(server)
    if stored is not None and stored.get("username") == username and stored.get("kind") != "api":
        return credentials.remove(server)
    return False


def _print_recovery_codes(codes: list[str], username: str) -> None:
    out = render.console()
    out.print()
    out.print(
        Text(
            "Recovery codes: STORE THESE NOW, somewhere safe. They are shown only this once; "
            "each works once in place of a TOTP code if you lose your authenticator.",
            style="bold yellow",
        ),
        soft_wrap=True,
    )
    for c in codes:
        out.print(Text(f"  {c}"))
    out.print()
    render.print_line(
        f"MFA is now on for {username}. Your enrollment session has ended: run "
        "'proofplane login' again, with a code from your authenticator.",
        style="green",
    )


@mfa_app.command("enroll")
def mfa_enroll(
    ctx: typer.Context,
    code: str | None = typer.Option(
        None,
        "--code",
        help="The first code from the authenticator (default: prompt for it).",
        show_default=False,
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help='Print {"secret", "otpauth_uri"} (and "recovery_codes" once confirmed with '
        "--code) as JSON; without --code, confirm later with 'proofplane mfa confirm'.",
    ),
) -> None:
    """Set up a TOTP authenticator: shows a QR code and the secret, then asks for a first code
    to turn MFA on, and prints single-use recovery codes."""
    with client(ctx) as api:
        me = api.get("/api/v1/auth/me")
        begun = api.post("/api/v1/auth/mfa/enroll")
    username = me["username"]
    if as_json:
        result: dict[str, Any] = {"secret": begun["secret"], "otpauth_uri": begun["otpauth_uri"]}
        if code is not None:
            result["recovery_codes"] = _confirm(ctx, code)
            _after_confirm(ctx, username)
        render.print_json(result)
        return
    out = render.console()
    out.print(
        Text(f"Scan this QR code with your authenticator app ({username}):", style="bold"),
        soft_wrap=True,
    )
    sys.stdout.write(qr_text(begun["otpauth_uri"]))
    sys.stdout.flush()
    out.print(Text("or enter this secret by hand (TOTP, SHA-1, 6 digits, 30 s):"))
    out.print(Text(f"  {begun['secret']}", style="bold"))
    out.print(Text(f"otpauth URI: {begun['otpauth_uri']}"), soft_wrap=True)
    out.print()
    if code is not None:
        codes = _confirm(ctx, code)
    else:
        codes = []
        for attempt in range(3):
            entered = typer.prompt("Code from the authenticator", err=True)
            try:
                codes = _confirm(ctx, entered)
                break
            except ApiError as exc:
                if exc.code != "invalid_totp" or attempt == 2:
                    raise
                click.echo("that code is not valid; try the next one", err=True)
    _after_confirm(ctx, username)
    _print_recovery_codes(codes, username)


@mfa_app.command("confirm")
def mfa_confirm(
    ctx: typer.Context,
    code: str = typer.Argument(..., help="The current code from the authenticator."),
    as_json: bool = typer.Option(False, "--json", help='Print {"recovery_codes"} as JSON.'),
) -> None:
    """Turn MFA on with a first code, after 'proofplane mfa enroll --json'."""
    with client(ctx) as api:
        me = api.get("/api/v1/auth/me")
    codes = _confirm(ctx, code)
    _after_confirm(ctx, me["username"])
    if as_json:
        render.print_json({"recovery_codes": codes})
    else:
        _print_recovery_codes(codes, me["username"])
