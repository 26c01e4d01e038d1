"""The ``proofplane`` command: the root app, its global options and the error boundary.

Exit statuses: 0 success, 1 the API or the store said no, 2 a usage error (bad arguments),
3 the server cannot be reached. Expected failures print one message to stderr, never a traceback.
"""

from __future__ import annotations

from typing import Any

import click
import typer
from typer.core import TyperGroup

from proofplane import __version__
from proofplane.cli import (
    agent,
    alerts,
    attest,
    audit,
    auth,
    backends,
    changes,
    events,
    evidence,
    incidents,
    keys,
    network,
    nodes,
    pki,
    runbooks,
    server,
    sim,
    sinks,
    telemetry,
    tenants,
    tokens,
    usage,
    users,
    workloads,
)
from proofplane.cli.client import DEFAULT_SERVER, CliError
from proofplane.cli.common import CliState


class ProofplaneGroup(TyperGroup):
    """The root command group: every subcommand runs inside ``invoke``, so this is the one place
    a CliError becomes a message on stderr and an exit status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as exc:
            click.echo(exc.message, err=True)
            for line in exc.lines:
                click.echo(line, err=True)
            raise typer.Exit(exc.exit_code) from None


app = typer.Typer(
    name="proofplane",
    cls=ProofplaneGroup,
    help="proofplane: a control plane for attested, compliance-aware GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"proofplane {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    server_url: str = typer.Option(
        DEFAULT_SERVER,
        "--server",
        "-s",
        envvar="PROOFPLANE_SERVER",
        help="The proofplane API server the client commands talk to.",
    ),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar="PROOFPLANE_TOKEN",
        help="Bearer token for the API (default: the one 'proofplane login' stored for the "
        "server).",
        show_default=False,
    ),
    ca_file: str | None = typer.Option(
        None,
        "--ca-file",
        envvar="PROOFPLANE_CA_FILE",
        help="PEM CA certificate(s) to verify an https:// server with (e.g. the CA that "
        "'proofplane up --tls' prints); default: the usual public CAs.",
        show_default=False,
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """proofplane: a control plane for attested, compliance-aware GPU clusters.

    Start a demo control plane with `proofplane up`, then try `proofplane nodes list`.
    Sign in to a server with `proofplane login`.
    """
    ctx.obj = CliState(server=server_url, token=token or None, ca_file=ca_file or None)


app.command("serve", rich_help_panel="Server")(server.serve)
app.command("up", rich_help_panel="Server")(server.up)
app.add_typer(server.db_app, name="db", rich_help_panel="Server")
app.command("login", rich_help_panel="Access")(auth.login)
app.command("logout", rich_help_panel="Access")(auth.logout)
app.command("whoami", rich_help_panel="Access")(auth.whoami)
app.add_typer(auth.mfa_app, name="mfa", rich_help_panel="Access")
app.add_typer(users.app, name="users", rich_help_panel="Access")
app.add_typer(tokens.app, name="tokens", rich_help_panel="Access")
app.add_typer(nodes.app, name="nodes", rich_help_panel="Client")
app.add_typer(tenants.app, name="tenants", rich_help_panel="Client")
app.add_typer(network.app, name="network", rich_help_panel="Client")
app.add_typer(workloads.app, name="workloads", rich_help_panel="Client")
app.add_typer(events.app, name="events", rich_help_panel="Client")
app.add_typer(telemetry.app, name="telemetry", rich_help_panel="Client")
app.add_typer(usage.app, name="usage", rich_help_panel="Client")
app.add_typer(usage.cost_app, name="cost", rich_help_panel="Client")
app.add_typer(backends.app, name="backends", rich_help_panel="Client")
app.command("capacity", rich_help_panel="Client")(alerts.capacity)
app.add_typer(alerts.app, name="alerts", rich_help_panel="Audit")
app.add_typer(audit.app, name="audit", rich_help_panel="Audit")
app.add_typer(changes.app, name="changes", rich_help_panel="Audit")
app.add_typer(evidence.app, name="evidence", rich_help_panel="Audit")
app.add_typer(sinks.app, name="sinks", rich_help_panel="Audit")
app.add_typer(incidents.app, name="incident", rich_help_panel="Audit")
app.add_typer(runbooks.app, name="runbooks", rich_help_panel="Audit")
app.add_typer(keys.app, name="keys", rich_help_panel="Access")
app.add_typer(sim.app, name="sim", rich_help_panel="Simulation")
app.add_typer(attest.app, name="attest", rich_help_panel="Attestation")
app.add_typer(pki.app, name="pki", rich_help_panel="Attestation")
app.command("agent", rich_help_panel="Attestation")(agent.agent)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
