"""``proofplane pki …``: the node agents' channel certificates (issue 13): list what the agent
CA issued (with revocations), revoke one by serial, print the CA certificate a server's
``--tls-client-ca`` trusts for agents."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import JsonOpt, client, send

app = typer.Typer(
    help="Agent channel certificates: list, revoke, the agent CA.", no_args_is_help=True
)


def certificates_table(items: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold")
    for col in ("SERIAL", "NODE", "ISSUED", "NOT AFTER", "REVOKED"):
        table.add_column(col, overflow="fold" if col == "SERIAL" else "ellipsis")
    for c in items:
        revoked = c["revoked_at"]
        table.add_row(
            render.text(c["serial"]),
            render.text(c["node"]),
            render.text(render.timestamp(c["issued_at"])),
            render.text(render.timestamp(c["not_after"])),
            render.text(
                f"{render.timestamp(revoked)} ({c['revoke_reason']})" if revoked else "", "red"
            ),
        )
    return table


@app.command("list")
def list_certificates(
    ctx: typer.Context,
    node: str | None = typer.Option(None, "--node", help="Only this node's certificates."),
    as_json: bool = JsonOpt,
) -> None:
    """Every agent certificate issued, with its revocation."""
    with client(ctx) as api:
        answer = api.get("/api/v1/pki/certificates", {"node": node})
    if as_json:
        render.print_json(answer)
        return
    if not answer["items"]:
        render.print_line("no agent certificates issued")
        return
    render.console().print(certificates_table(answer["items"]))


@app.command("revoke")
def revoke(
    ctx: typer.Context,
    serial: str = typer.Argument(..., help="The certificate's serial (hex, from pki list)."),
    as_json: bool = JsonOpt,
) -> None:
    """Revoke one agent certificate now: it goes on the CRL and stops authenticating."""
    answer = send(ctx, "POST", f"/api/v1/pki/certificates/{segment(serial)}/revoke", None)
    if as_json:
        render.print_json(answer)
    else:
        render.print_line(f"certificate {answer['serial']} of node {answer['node']} revoked")


@app.command("ca")
def ca(ctx: typer.Context) -> None:
    """Print the agent CA certificate (PEM), for a server's --tls-client-ca."""
    with client(ctx) as api:
        typer.echo(api.text("GET", "/api/v1/pki/ca"), nl=False)
