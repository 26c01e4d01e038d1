"""``proofplane nodes …``: list, inspect, change state, certify and register nodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from proofplane.cli import render
from proofplane.cli.client import ApiError, segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    client,
    fetch,
    parse_pairs,
    run_list,
    send,
)
from proofplane.model import NodeState

app = typer.Typer(help="GPU nodes: inventory, state, certifications.", no_args_is_help=True)


def _done(node: dict[str, Any], as_json: bool, message: str) -> None:
    if as_json:
        render.print_json(node)
    else:
        render.print_line(message)


@app.command("list")
def list_nodes(
    ctx: typer.Context,
    state: NodeState | None = typer.Option(None, "--state", help="Only nodes in this state."),
    region: str | None = typer.Option(None, "--region"),
    zone: str | None = typer.Option(None, "--zone"),
    certification: list[str] | None = typer.Option(
        None, "--certification", "-c", help="key=value the node must hold; repeatable."
    ),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List nodes with their state, GPUs and certifications."""
    parse_pairs(certification, "--certification")
    params = {
        "state": state.value if state else None,
        "region": region,
        "zone": zone,
        "certification": certification or None,
    }
    run_list(
        ctx,
        "/api/v1/nodes",
        params,
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.nodes_table,
        noun="node",
    )


@app.command("show")
def show_node(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    as_json: bool = JsonOpt,
) -> None:
    """Show one node: placement-relevant facts and every GPU."""
    node = fetch(ctx, f"/api/v1/nodes/{segment(name)}")
    if as_json:
        render.print_json(node)
    else:
        render.show_node(node)


@app.command("state")
def set_state(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    state: NodeState = typer.Argument(..., help="The state to move the node to."),
    reason: str | None = typer.Option(None, "--reason", "-r", help="Why (kept in the events)."),
    as_json: bool = JsonOpt,
) -> None:
    """Move a node to another state (cordon, fail, quarantine, re-admit, decommission).
    Work on a node that can no longer keep it is evicted and rescheduled."""
    node = send(
        ctx,
        "POST",
        f"/api/v1/nodes/{segment(name)}/state",
        {"state": state.value, "reason": reason},
    )
    why = f" ({node['state_reason']})" if node.get("state_reason") else ""
    _done(node, as_json, f"node {node['name']} is now {node['state']}{why}")


def governed(
    ctx: typer.Context, method: str, path: str, body: Any, as_json: bool
) -> dict[str, Any] | None:
    """The direct call; with change control on (409 ``change_request_required``), the change
    request the server named is created instead and its id printed (None is returned)."""
    try:
        return send(ctx, method, path, body)  # type: ignore[no-any-return]
    except ApiError as exc:
        if exc.code != "change_request_required" or not isinstance(exc.details, dict):
            raise
        change = send(ctx, "POST", "/api/v1/changes", exc.details["change"])
    if as_json:
        render.print_json(change)
    else:
        render.print_line(
            f"change control is on: change {change['id']} ({change['type']}) requested; it "
            f"applies once approved (proofplane changes show {change['id']})"
        )
    return None


@app.command("certify")
def certify(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    certification: str = typer.Argument(..., metavar="KEY=VALUE", help="e.g. hipaa=true"),
    as_json: bool = JsonOpt,
) -> None:
    """Grant a node a certification (only admitted nodes can be certified)."""
    ((key, value),) = parse_pairs([certification], "KEY=VALUE").items()
    node = governed(
        ctx,
        "POST",
        f"/api/v1/nodes/{segment(name)}/certifications",
        {"key": key, "value": value},
        as_json,
    )
    if node is None:
        return
    _done(
        node,
        as_json,
        f"node {node['name']} certified {key}={value}; "
        f"certifications: {render.pairs(node.get('certifications')) or '-'}",
    )


@app.command("uncertify")
def uncertify(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    key: str = typer.Argument(..., help="The certification key to revoke, e.g. hipaa."),
    as_json: bool = JsonOpt,
) -> None:
    """Revoke a certification; work that needed it is moved off the node."""
    path = f"/api/v1/nodes/{segment(name)}/certifications/{segment(key)}"
    node = governed(ctx, "DELETE", path, None, as_json)
    if node is None:
        return
    _done(
        node,
        as_json,
        f"node {node['name']} no longer certified {key}; "
        f"certifications: {render.pairs(node.get('certifications')) or '-'}",
    )


@app.command("register")
def register(
    ctx: typer.Context,
    file: Path = typer.Option(
        ...,
        "--file",
        "-f",
        exists=True,
        dir_okay=False,
        readable=True,
        help="A JSON node description (the body of POST /api/v1/nodes).",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Register a node from a JSON file; it starts in state `registered`."""
    try:
        body = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {file}: {exc}", param_hint="--file") from exc
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(
            f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            param_hint="--file",
        ) from exc
    node = send(ctx, "POST", "/api/v1/nodes", body)
    _done(
        node,
        as_json,
        f"node {node['name']} registered ({render.gpu_summary(node.get('gpus', []))}), "
        f"state {node['state']}",
    )


@app.command("agent-credential")
def agent_credential(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    ttl_days: int = typer.Option(90, "--ttl-days", min=1, max=90, help="Lifetime in days."),
    as_json: bool = JsonOpt,
) -> None:
    """Issue a credential for the node's agent (it grants no user or tenant access). It is
    printed once."""
    issued = send(
        ctx, "POST", f"/api/v1/nodes/{segment(name)}/agent-credentials", {"ttl_days": ttl_days}
    )
    if as_json:
        render.print_json(issued)
    else:
        render.issued_token(issued, f"agent credential for {name}")


@app.command("attest")
def attest_status(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    as_json: bool = JsonOpt,
) -> None:
    """Show the node's TPM identity (EK hash, bound AK) and its latest attestation verdict."""
    st = fetch(ctx, f"/api/v1/nodes/{segment(name)}/attestation")
    if as_json:
        render.print_json(st)
        return
    bound = f"AK {st['ak_name']} bound {st['bound_at']}" if st["bound"] else "no bound AK"
    render.print_line(f"node {st['node']}: {st['state']}"
                      + (f" ({st['state_reason']})" if st.get("state_reason") else ""))  # fmt: skip
    render.print_line(f"  class {st['node_class']}; {bound}; EK sha256 {st['ek_sha256'] or '-'}")
    latest = st.get("latest")
    if latest is None:
        render.print_line("  no attestation yet")
        return
    verdict = "ACCEPTED" if latest["ok"] else "REJECTED"
    render.print_line(f"  latest: {verdict} at {latest['at']} (evidence {latest['id']}, "
                      f"policy {latest['policy_id']})")  # fmt: skip
    for reason in latest["reasons"]:
        render.print_line(f"    {reason}: {latest['messages'].get(reason, '')}")
    render.print_line(f"  evidence sha256 {latest['evidence_hash']}")


@app.command("evidence")
def evidence(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Node name."),
    limit: int = typer.Option(20, "--limit", min=1, max=500),
    save: Path | None = typer.Option(
        None, "--save", help="Write the newest evidence record here (for 'attest replay')."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """List the node's attestation attempts, newest first."""
    with client(ctx) as api:
        page = api.get(
            f"/api/v1/nodes/{segment(name)}/evidence",
            {"limit": limit, "records": "true" if (as_json or save) else "false"},
        )
    items = page["items"]
    if save is not None and items:
        save.write_text(json.dumps(items[0]["record"], indent=2), encoding="utf-8")
    if as_json:
        render.print_json(page)
        return
    for e in items:
        verdict = "ok" if e["ok"] else "REJECTED " + ",".join(e["reasons"])
        render.print_line(f"{e['id']:>6}  {e['at']}  {verdict}  {e['evidence_hash'][:16]}")
    if not items:
        render.print_line(f"node {name}: no attestation attempts")
