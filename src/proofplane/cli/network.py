"""``proofplane network …``: tenants' network segments, each node's desired network state, the
agents' drift, and the segmentation map as evidence (issue 14)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from proofplane.cli import render
from proofplane.cli.client import CliError, segment
from proofplane.cli.common import AllOpt, CursorOpt, JsonOpt, LimitOpt, client, run_list, send

app = typer.Typer(
    help="Network segmentation: tenants' VXLAN VNIs and InfiniBand PKeys, each node's desired "
    "network state, drift, and the segmentation map.",
    no_args_is_help=True,
)
API = "/api/v1"
RENDER_FORMATS = ("json", "iproute2", "nftables", "partitions")
OutputOpt = typer.Option(None, "--output", "-o", help="Write to FILE instead of stdout.")


def _write(text: str, output: Path | None) -> None:
    if output is None:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"proofplane: cannot write {output}: {exc}") from None
    render.print_line(f"wrote {output}")


@app.command("segments")
def segments(
    ctx: typer.Context,
    tenant: str | None = typer.Option(None, "--tenant", "-t", help="Only this tenant's."),
    state: str = typer.Option(
        "active", "--state", help="active (default), released (cooling down and older), all."
    ),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List segments: each tenant's VXLAN VNI and InfiniBand PKey (and a per-workload tenant's
    workloads' own), and the nodes that carry them."""
    if state not in ("active", "released", "all"):
        raise typer.BadParameter("active, released or all", param_hint="--state")
    run_list(
        ctx,
        f"{API}/network/segments",
        {"tenant": tenant, "state": state},
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.segments_table,
        noun="segment",
    )


@app.command("render")
def render_node(
    ctx: typer.Context,
    node: str = typer.Argument(..., help="Node name."),
    fmt: str = typer.Option(
        "json", "--format", "-f", help="json, iproute2 (ip/bridge -batch), nftables, partitions."
    ),
    output: Path | None = OutputOpt,
) -> None:
    """Show a node's desired network state, as its agent gets it (json) or rendered: the
    ``ip -batch`` / ``bridge -batch`` lines, the nftables ruleset, OpenSM partitions.conf."""
    if fmt not in RENDER_FORMATS:
        raise typer.BadParameter(", ".join(RENDER_FORMATS), param_hint="--format")
    path = f"{API}/nodes/{segment(node)}/network"
    with client(ctx) as api:
        if fmt == "json":
            text = json.dumps(api.get(path), indent=2, ensure_ascii=False) + "\n"
        else:
            text = api.text("GET", f"{path}?format={fmt}")
    _write(text, output)


def _statuses(ctx: typer.Context) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    with client(ctx) as api:
        for page in api.pages(f"{API}/network/nodes", {"limit": 500}, follow=True):
            items.extend(page["items"])
    return items


@app.command("check")
def check(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """Drift report: every node with underlay facts, the desired generation and what its agent
    last applied. Exits 1 when a node's network drifted (its applied generation lags, what it
    applied is not the desired state, its ruleset differs, or its self-check failed)."""
    items = _statuses(ctx)
    drifting = [n for n in items if n.get("network_drift")]
    if as_json:
        render.print_json({"items": items, "drifting": [n["node"] for n in drifting]})
    else:
        render.print_list(render.network_nodes_table(items), len(items), "node", None)
        reporting = sum(1 for n in items if n.get("managed"))
        render.print_line(
            f"{reporting} of {len(items)} node(s) report their network; "
            f"{len(drifting)} drifted"
            + (f": {', '.join(n['node'] for n in drifting)}" if drifting else "")
        )
    if drifting:
        raise CliError(f"proofplane: network drift on {len(drifting)} node(s)")


@app.command("export")
def export(
    ctx: typer.Context,
    fmt: str = typer.Option("json", "--format", "-f", help="json or csv."),
    output: Path | None = OutputOpt,
) -> None:
    """The segmentation map (evidence): per tenant its VNIs, PKeys with their members, the
    nodes, its policy's hash and the last isolation check of those nodes."""
    if fmt not in ("json", "csv"):
        raise typer.BadParameter("json or csv", param_hint="--format")
    with client(ctx) as api:
        if fmt == "csv":
            text = api.text("GET", f"{API}/network/export?format=csv")
        else:
            text = json.dumps(api.get(f"{API}/network/export"), indent=2, ensure_ascii=False)
            text += "\n"
    _write(text, output)


@app.command("policy")
def policy(
    ctx: typer.Context,
    tenant: str = typer.Argument(..., help="Tenant name."),
    file: Path | None = typer.Option(
        None, "--file", help="A JSON file with the policy (subnet, allow, egress)."
    ),
    default: bool = typer.Option(False, "--default", help="Back to the default policy."),
    as_json: bool = JsonOpt,
) -> None:
    """Show a tenant's network policy, or set it (--file) or reset it (--default). Setting is
    a governed change: under change control, ask with `proofplane changes create network.policy
    --payload '{"tenant": "T", "policy": {...}}'`."""
    if file is not None and default:
        raise typer.BadParameter("--file or --default, not both", param_hint="--file")
    if file is None and not default:
        view = send(ctx, "GET", f"{API}/tenants/{segment(tenant)}/segments")
        out = {k: view[k] for k in ("tenant", "policy", "policy_sha256", "default")}
        render.print_json(out)
        return
    body: Any = None
    if file is not None:
        try:
            body = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CliError(f"proofplane: cannot read a JSON policy from {file}: {exc}") from None
    result = send(ctx, "PUT", f"{API}/tenants/{segment(tenant)}/network-policy", {"policy": body})
    if as_json:
        render.print_json(result)
    else:
        render.print_line(
            f"tenant {result['tenant']} network policy {result['policy_sha256'][:16]}…"
            + (" (default)" if result.get("default") else "")
        )
