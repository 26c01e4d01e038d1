"""``proofplane changes …``: change requests (issue 12): ask for a governed change, approve or
deny it (two other people for a certification grant), apply it, see what it would change, and
export the change register for an auditor.

``diff`` reads the cluster as it stands now through the API (the node's certifications, the
tenant's profile or quota, the attestation policy, the node's state) and shows what applying
the change would make of it. ``export`` writes the register (CSV or JSON): every event of a
change carries its audit-log index, which ``proofplane audit prove --index INDEX`` proves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import typer
from rich.table import Table
from rich.text import Text

from proofplane.cli import render
from proofplane.cli.client import ApiError, CliError, segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    client,
    fetch,
    iso_callback,
    run_list,
    send,
)

API = "/api/v1/changes"
STATE_STYLES = {
    "pending": "yellow",
    "approved": "cyan",
    "applied": "green",
    "denied": "red",
    "expired": "dim",
    "cancelled": "dim",
}

app = typer.Typer(
    help="Change requests: governed changes approved by others, applied, exported.",
    no_args_is_help=True,
)


# --- rendering ---------------------------------------------------------------------------------


def _state(change: dict[str, Any]) -> Text:
    text = Text(change["state"], style=STATE_STYLES.get(change["state"], ""))
    if change.get("emergency"):
        text.append(f" (emergency, review {change.get('review_state') or '-'})", style="magenta")
    return text


def _votes(votes: list[dict[str, Any]]) -> str:
    parts = []
    for v in votes:
        stale = "" if v.get("current", True) else " (void: an earlier payload)"
        comment = f": {v['comment']}" if v.get("comment") else ""
        parts.append(f"{v['by']} at {render.timestamp(v['at'])}{stale}{comment}")
    return "; ".join(parts)


def changes_table(changes: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in ("ID", "TYPE", "STATE", "PAYLOAD", "REQUESTED BY", "APPROVALS", "REQUESTED"):
        table.add_column(col, overflow="fold" if col == "PAYLOAD" else "ellipsis")
    for c in changes:
        current = [a["by"] for a in c["approvals"] if a.get("current", True)]
        table.add_row(
            render.text(c["id"]),
            render.text(c["type"]),
            _state(c),
            render.text(json.dumps(c["payload"], separators=(",", ":"))),
            render.text(c["requested_by"]),
            render.text(", ".join(current)),
            render.text(render.timestamp(c.get("requested_at"))),
        )
    return table


def show_change(c: dict[str, Any]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.title = f"Change {c['id']}: {c['type']}"
    grid.title_justify = "left"
    grid.title_style = "bold"
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(overflow="fold")
    rows: list[tuple[str, Text]] = [
        ("state", _state(c)),
        ("payload", render.text(json.dumps(c["payload"], sort_keys=True))),
        ("payload sha256", render.text(c["payload_sha256"])),
        ("reason", render.text(c.get("reason"))),
        (
            "requested",
            render.text(f"{c['requested_by']} at {render.timestamp(c.get('requested_at'))}"),
        ),  # fmt: skip
        ("last edited by", render.text(c.get("last_edited_by"))),
        ("approvals", render.text(_votes(c.get("approvals") or []))),
        ("denials", render.text(_votes(c.get("denials") or []))),
        ("expires", render.text(render.timestamp(c.get("expires_at")))),
        (
            "applied",
            render.text(
                f"{c['applied_by']} at {render.timestamp(c['applied_at'])}"
                if c.get("applied_by")
                else None
            ),
        ),  # fmt: skip
        ("error", render.text(c.get("error"), "red")),
    ]
    if c.get("emergency"):
        rows.append(("reviews", render.text(_votes(c.get("reviews") or []))))
        rows.append(("review due", render.text(render.timestamp(c.get("review_due_at")))))
    for key, value in rows:
        grid.add_row(key, value)
    render.console().print(grid)


def _done(change: dict[str, Any], as_json: bool, message: str) -> None:
    if as_json:
        render.print_json(change)
        return
    render.print_line(message)
    if change.get("error"):
        render.print_line(f"error: {change['error']}", "red")


def _next_step(change: dict[str, Any]) -> str:
    cid = change["id"]
    if change["state"] == "pending":
        return f"pending, waiting for approvals: proofplane changes approve {cid} (by someone else)"
    if change["state"] == "approved":
        return f"approved: apply it with proofplane changes apply {cid}"
    if change["state"] == "applied" and change.get("review_state") == "pending":
        return f"applied; it needs a review: proofplane changes review {cid}"
    return change["state"]


# --- arguments ---------------------------------------------------------------------------------


def parse_payload(raw: str) -> dict[str, Any]:
    """``--payload``: JSON text, or ``@FILE`` holding it; a mistake exits 2 before any request."""
    source = "--payload"
    if raw.startswith("@"):
        path = Path(raw[1:])
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint=source) from None
        source = f"--payload {path}"
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=source) from None
    if not isinstance(payload, dict):
        raise typer.BadParameter("the payload is a JSON object", param_hint=source)
    return payload


def _id(value: int) -> str:
    return segment(value)


ChangeArg = typer.Argument(..., min=1, help="The change's id.")
CommentOpt = typer.Option("", "--comment", "-m", help="Why (kept with the vote and its event).")


# --- commands ----------------------------------------------------------------------------------


@app.command("create")
def create(
    ctx: typer.Context,
    change_type: str = typer.Argument(..., metavar="TYPE", help="e.g. certification.grant"),
    payload: str = typer.Option(
        ...,
        "--payload",
        "-p",
        help='JSON, or @FILE: e.g. {"node":"n1","key":"hipaa","value":"true"}',
        show_default=False,
    ),  # fmt: skip
    reason: str = typer.Option("", "--reason", "-r", help="Why (shown to the approvers)."),
    emergency: bool = typer.Option(
        False, "--emergency", help="Admins, with --reason: apply now, review afterwards."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Ask for a governed change; others approve it, then it is applied."""
    body = {"type": change_type, "payload": parse_payload(payload), "reason": reason,
            "emergency": emergency}  # fmt: skip
    change = send(ctx, "POST", API, body)
    _done(change, as_json, f"change {change['id']} ({change['type']}) {_next_step(change)}")


@app.command("list")
def list_changes(
    ctx: typer.Context,
    state: str | None = typer.Option(None, "--state", help="pending, approved, applied, …"),
    change_type: str | None = typer.Option(None, "--type", help="e.g. certification.grant"),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    follow: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Change requests, newest first."""
    run_list(ctx, API, {"state": state, "type": change_type}, limit=limit, cursor=cursor,
             follow=follow, as_json=as_json, table=changes_table, noun="change")  # fmt: skip


@app.command("show")
def show(ctx: typer.Context, change_id: int = ChangeArg, as_json: bool = JsonOpt) -> None:
    """One change request: its payload, approvals, denials, and what became of it."""
    change = fetch(ctx, f"{API}/{_id(change_id)}")
    if as_json:
        render.print_json(change)
    else:
        show_change(change)


@app.command("edit")
def edit(
    ctx: typer.Context,
    change_id: int = ChangeArg,
    payload: str = typer.Option(
        ..., "--payload", "-p", help="JSON, or @FILE.", show_default=False
    ),  # fmt: skip
    as_json: bool = JsonOpt,
) -> None:
    """Replace an open request's payload (every earlier approval is void)."""
    change = send(ctx, "PATCH", f"{API}/{_id(change_id)}", {"payload": parse_payload(payload)})
    _done(change, as_json, f"change {change['id']} edited; {_next_step(change)}")


def _vote(ctx: typer.Context, change_id: int, action: str, comment: str) -> dict[str, Any]:
    return send(ctx, "POST", f"{API}/{_id(change_id)}/{action}", {"comment": comment})  # type: ignore[no-any-return]


@app.command("approve")
def approve(
    ctx: typer.Context, change_id: int = ChangeArg, comment: str = CommentOpt,
    as_json: bool = JsonOpt,
) -> None:  # fmt: skip
    """Approve the payload as it stands (never your own request, nor one you last edited)."""
    change = _vote(ctx, change_id, "approve", comment)
    _done(change, as_json, f"change {change['id']} approved by you; {_next_step(change)}")


@app.command("deny")
def deny(
    ctx: typer.Context, change_id: int = ChangeArg, comment: str = CommentOpt,
    as_json: bool = JsonOpt,
) -> None:  # fmt: skip
    """Deny it (one denial denies the request)."""
    change = _vote(ctx, change_id, "deny", comment)
    _done(change, as_json, f"change {change['id']} {change['state']}")


@app.command("review")
def review(
    ctx: typer.Context, change_id: int = ChangeArg, comment: str = CommentOpt,
    as_json: bool = JsonOpt,
) -> None:  # fmt: skip
    """Review an applied emergency change (its post-implementation review)."""
    change = _vote(ctx, change_id, "review", comment)
    _done(change, as_json, f"change {change['id']} reviewed; review {change['review_state']}")


@app.command("apply")
def apply(ctx: typer.Context, change_id: int = ChangeArg, as_json: bool = JsonOpt) -> None:
    """Apply an approved change (re-checked against the cluster now)."""
    change = send(ctx, "POST", f"{API}/{_id(change_id)}/apply", {})
    _done(change, as_json, f"change {change['id']} applied by {change['applied_by']}")


@app.command("cancel")
def cancel(
    ctx: typer.Context, change_id: int = ChangeArg, comment: str = CommentOpt,
    as_json: bool = JsonOpt,
) -> None:  # fmt: skip
    """Withdraw an open request (its requester, or an admin)."""
    change = _vote(ctx, change_id, "cancel", comment)
    _done(change, as_json, f"change {change['id']} cancelled")


# --- diff --------------------------------------------------------------------------------------


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; a non-object is itself (at ``prefix``)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value} if prefix else ({} if value in (None, {}) else {"": value})


def changed_keys(before: Any, after: Any) -> list[dict[str, Any]]:
    """Every dotted key whose value differs, with the two values (None: absent)."""
    old, new = _flatten(before), _flatten(after)
    return [{"key": k, "before": old.get(k), "after": new.get(k)}
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]  # fmt: skip


def _get_or_none(api: Any, path: str) -> Any:
    try:
        return api.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def current_and_after(api: Any, change: dict[str, Any]) -> tuple[str, Any, Any]:
    """What the change touches, its current value (through the API), and the value applying
    it would leave."""
    kind, p = change["type"], change["payload"]
    if kind in ("certification.grant", "certification.revoke"):
        node = api.get(f"/api/v1/nodes/{segment(p['node'])}")
        certs = dict(node.get("certifications") or {})
        after = dict(certs)
        if kind == "certification.grant":
            after[p["key"]] = p["value"]
        else:
            after.pop(p["key"], None)
        return f"node {p['node']}: certifications", certs, after
    if kind == "tenant.profile":
        tenant = _get_or_none(api, f"/api/v1/tenants/{segment(p['tenant'])}")
        before = None if tenant is None else {"description": tenant["description"],
                                              "profile": tenant["profile"]}  # fmt: skip
        description = p.get("description")
        if description is None:
            description = tenant["description"] if tenant else ""
        return (f"tenant {p['tenant']}: profile", before,
                {"description": description, "profile": p["profile"]})  # fmt: skip
    if kind == "quota.set":
        tenant = _get_or_none(api, f"/api/v1/tenants/{segment(p['tenant'])}")
        return (f"tenant {p['tenant']}: quota", None if tenant is None else tenant["quota"],
                {"gpus": p.get("gpus"), "mig_slices": p.get("mig_slices")})  # fmt: skip
    if kind == "attestation.policy":
        node_class = p.get("node_class", "default")
        items = api.get("/api/v1/attestation/policy").get("items", [])
        now = next((i for i in items if i.get("node_class") == node_class), None)
        before = None if now is None else {"policy": now["policy"], "enforce": now["enforce"]}
        after = {"policy": {**p["policy"], "node_class": node_class},
                 "enforce": p.get("enforce", True)}  # fmt: skip
        return f"attestation policy {node_class}", before, after
    if kind in ("node.decommission", "node.readmit"):
        node = api.get(f"/api/v1/nodes/{segment(p['node'])}")
        state = "decommissioned" if kind == "node.decommission" else "admitted"
        return f"node {p['node']}: state", {"state": node["state"]}, {"state": state}
    return kind, None, p


@app.command("diff")
def diff(ctx: typer.Context, change_id: int = ChangeArg, as_json: bool = JsonOpt) -> None:
    """What applying the change would change, as the cluster stands now."""
    with client(ctx) as api:
        change = api.get(f"{API}/{_id(change_id)}")
        target, before, after = current_and_after(api, change)
    out = {"change": change["id"], "type": change["type"], "state": change["state"],
           "target": target, "before": before, "after": after,
           "changes": changed_keys(before, after)}  # fmt: skip
    if as_json:
        render.print_json(out)
        return
    table = Table(header_style="bold", caption_justify="left")
    for col in ("KEY", "NOW", "AFTER APPLYING"):
        table.add_column(col, overflow="fold")
    for c in out["changes"]:
        table.add_row(render.text(c["key"]), render.text(_cell(c["before"]), "red"),
                      render.text(_cell(c["after"]), "green"))  # fmt: skip
    table.title = f"change {change['id']} ({change['type']}, {change['state']}): {target}"
    table.title_justify = "left"
    table.caption = "no difference: applying it changes nothing now" if not out["changes"] else (
        f"{len(out['changes'])} difference{'s' if len(out['changes']) != 1 else ''}")  # fmt: skip
    render.console().print(table)


def _cell(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value)


# --- the change register -----------------------------------------------------------------------


@app.command("export")
def export(
    ctx: typer.Context,
    start: str | None = typer.Option(
        None, "--from", callback=iso_callback, help="ISO 8601 (UTC without a zone)."
    ),  # fmt: skip
    end: str | None = typer.Option(
        None, "--to", callback=iso_callback, help="ISO 8601, exclusive."
    ),  # fmt: skip
    fmt: str = typer.Option("json", "--format", "-f", help="json or csv."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write to FILE."),
) -> None:
    """The change register (CM-3 / A.8.32 evidence): approvers with times, separation-of-duties
    checks, who applied what and when, and each event's audit-log index (prove one with
    ``proofplane audit prove --index INDEX``)."""
    if fmt not in ("json", "csv"):
        raise typer.BadParameter("json or csv", param_hint="--format")
    query = urlencode({k: v for k, v in (("from", start), ("to", end), ("format", fmt)) if v})
    with client(ctx) as api:
        if fmt == "csv":
            text = api.text("GET", f"{API}/export?{query}")
        else:
            text = json.dumps(api.get(f"{API}/export", {"from": start, "to": end}), indent=2,
                              ensure_ascii=False) + "\n"  # fmt: skip
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"proofplane: cannot write {output}: {exc}") from None
    rows = text.count("\n") - 1 if fmt == "csv" else len(json.loads(text)["items"])
    render.print_line(f"wrote {rows} change{'s' if rows != 1 else ''} to {output}; prove an "
                      "event with proofplane audit prove --index INDEX")  # fmt: skip


# --- approval rules ----------------------------------------------------------------------------

rules_app = typer.Typer(
    help="Approval rules: how many people, holding which roles, approve each change type.",
    no_args_is_help=True,
)
app.add_typer(rules_app, name="rules")


def rules_table(items: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in ("TYPE", "APPROVALS", "ROLES", "SOURCE"):
        table.add_column(col)
    for r in items:
        source = r["source"]
        if source == "set":
            source = f"set by {r.get('updated_by')} at {render.timestamp(r.get('updated_at'))}"
        table.add_row(render.text(r["type"]), render.text(r["approvals"]),
                      render.text(", ".join(r["roles"])), render.text(source))  # fmt: skip
    return table


@rules_app.command("list")
def rules_list(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """Every change type's rule (set by an admin, or the default)."""
    data = fetch(ctx, f"{API}/rules")
    if as_json:
        render.print_json(data)
    else:
        render.print_list(rules_table(data["items"]), len(data["items"]), "rule", None)


@rules_app.command("set")
def rules_set(
    ctx: typer.Context,
    change_type: str = typer.Argument(..., metavar="TYPE", help="e.g. certification.grant"),
    approvals: int = typer.Option(..., "--approvals", "-n", min=1, help="Distinct approvers."),
    roles: list[str] = typer.Option(
        ..., "--role", "-r", help="Who may approve (repeat): admin, security-officer, tenant-admin."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Set a change type's approval rule (admins). With change control on, a change.rules
    change is requested instead (it may loosen control: two other people approve it)."""
    from proofplane.cli.nodes import governed

    body = {"approvals": approvals, "roles": roles}
    rule = governed(ctx, "PUT", f"{API}/rules/{segment(change_type)}", body, as_json)
    if rule is None:
        return
    if as_json:
        render.print_json(rule)
    else:
        render.print_line(f"{rule['type']} now needs {rule['approvals']} approval(s) from "
                          f"{', '.join(rule['roles'])}")  # fmt: skip
