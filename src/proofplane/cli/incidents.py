"""``proofplane incident …``: incidents (issue 12, §9), through the API.

``open NODE|TENANT --reason R`` quarantines the node (its work moves compliantly; a tenant is
not quarantined, only the incident is opened) and captures the evidence bundle; ``list``,
``show`` (with the timeline), ``update`` (forward: contained, resolved; severity, owner, a
note), ``close --postmortem`` and ``bundle ID -o FILE`` (checked offline with ``proofplane
audit verify-bundle FILE``; ``--records DIR`` also writes each attestation evidence record as
its own file for ``proofplane attest replay``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import CliError
from proofplane.cli.common import AllOpt, CursorOpt, JsonOpt, LimitOpt, client, fetch, run_list
from proofplane.cli.common import send as send_request

API = "/api/v1/incidents"
SEVERITIES = ("low", "medium", "high", "critical")
STATES = ("open", "contained", "resolved", "closed")

app = typer.Typer(
    help="Incidents: quarantine a node, capture the evidence, follow it to a post-mortem.",
    no_args_is_help=True,
)


def _choice(value: str | None, allowed: tuple[str, ...], option: str) -> str | None:
    if value is not None and value not in allowed:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}", param_hint=option)
    return value


def incidents_table(items: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in ("ID", "SUBJECT", "SEVERITY", "STATE", "OWNER", "OPENED", "REASON"):
        table.add_column(col, overflow="fold" if col == "REASON" else "ellipsis")
    for i in items:
        table.add_row(
            render.text(str(i["id"])),
            render.text(f"{i['subject_type']}/{i['subject']}"),
            render.text(i["severity"], "red" if i["severity"] in ("high", "critical") else None),
            render.text(i["state"]),
            render.text(i["owner"]),
            render.text(render.timestamp(i["opened_at"])),
            render.text(i["reason"]),
        )
    return table


def show_incident(inc: dict[str, Any]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.title = f"Incident {inc['id']}"
    grid.title_justify = "left"
    grid.title_style = "bold"
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(overflow="fold")
    rows: list[tuple[str, Any]] = [
        ("subject", f"{inc['subject_type']}/{inc['subject']}"),
        ("state", inc["state"]),
        ("severity", inc["severity"]),
        ("owner", inc["owner"]),
        ("reason", inc["reason"]),
        ("opened", f"{render.timestamp(inc['opened_at'])} by {inc['opened_by']}"),
        ("closed", render.timestamp(inc.get("closed_at"))),
        ("evidence", f"sha256 {inc['bundle_sha256']} ({inc['bundle_bytes']} bytes)"
         if inc.get("bundle_sha256") else "-"),
        ("post-mortem", inc.get("postmortem") or "-"),
    ]  # fmt: skip
    for key, value in rows:
        grid.add_row(key, render.text(str(value)))
    out = render.console()
    out.print(grid)
    timeline = inc.get("timeline") or []
    if timeline:
        t = Table("SEQ", "TIME", "ACTOR", "ACTION", "DETAILS", header_style="bold",
                  title="Timeline", title_justify="left")  # fmt: skip
        for e in timeline:
            t.add_row(str(e["seq"]), render.timestamp(e["ts"]), render.text(e["actor"]),
                      render.text(e["action"]), render.text(_summary(e["details"])))  # fmt: skip
        out.print(t)


def _summary(details: dict[str, Any]) -> str:
    keep = {k: v for k, v in details.items() if k not in ("bundle_sha256", "postmortem_sha256")}
    return json.dumps(keep, ensure_ascii=False, separators=(", ", ": "))


@app.command("open")
def open_cmd(
    ctx: typer.Context,
    subject: str = typer.Argument(..., help="A node (it is quarantined) or a tenant."),
    reason: str = typer.Option(..., "--reason", "-r", help="Why (on the timeline)."),
    severity: str = typer.Option("high", "--severity", help="low, medium, high or critical."),
    owner: str | None = typer.Option(None, "--owner", help="Who handles it (default: you)."),
    subject_type: str | None = typer.Option(
        None, "--type", help="node or tenant, when a node and a tenant share the name."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Open an incident: a node is quarantined (its work moves to nodes that satisfy its tags)
    and its evidence bundle captured; a tenant is not quarantined, the incident is opened."""
    _choice(severity, SEVERITIES, "--severity")
    _choice(subject_type, ("node", "tenant"), "--type")
    body = {"subject": subject, "reason": reason, "severity": severity, "owner": owner,
            "subject_type": subject_type}  # fmt: skip
    inc = send_request(ctx, "POST", API, body)
    if as_json:
        render.print_json(inc)
        return
    opened = next((e for e in inc.get("timeline") or [] if e["action"] == "incident.open"), None)
    quarantined = bool(opened and opened["details"].get("quarantined"))
    what = "node quarantined, its work moved" if quarantined else "no quarantine (tenant)"
    render.print_line(f"incident {inc['id']} opened on {inc['subject_type']}/{inc['subject']} "
                      f"({inc['severity']}, owner {inc['owner']}): {what}")  # fmt: skip
    fetch_it = f"proofplane incident bundle {inc['id']} -o incident-{inc['id']}.json"
    render.print_line(f"evidence bundle sha256 {inc['bundle_sha256']}: {fetch_it}")


@app.command("list")
def list_cmd(
    ctx: typer.Context,
    state: str | None = typer.Option(None, "--state", help="open, contained, resolved, closed."),
    subject: str | None = typer.Option(None, "--subject", help="Only this node or tenant."),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    follow: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Incidents, newest first."""
    _choice(state, STATES, "--state")
    run_list(ctx, API, {"state": state, "subject": subject}, limit=limit, cursor=cursor,
             follow=follow, as_json=as_json, table=incidents_table, noun="incident")  # fmt: skip


@app.command("show")
def show_cmd(
    ctx: typer.Context,
    incident_id: int = typer.Argument(..., min=1, help="The incident's id."),
    as_json: bool = JsonOpt,
) -> None:
    """An incident and its timeline."""
    inc = fetch(ctx, f"{API}/{incident_id}")
    if as_json:
        render.print_json(inc)
    else:
        show_incident(inc)


@app.command("update")
def update_cmd(
    ctx: typer.Context,
    incident_id: int = typer.Argument(..., min=1, help="The incident's id."),
    state: str | None = typer.Option(None, "--state", help="contained or resolved (forward)."),
    severity: str | None = typer.Option(None, "--severity", help="low, medium, high, critical."),
    owner: str | None = typer.Option(None, "--owner", help="A new owner."),
    note: str | None = typer.Option(None, "--note", help="A line on the timeline."),
    as_json: bool = JsonOpt,
) -> None:
    """Move an incident forward, change its severity or owner, or add a note."""
    _choice(state, STATES, "--state")
    _choice(severity, SEVERITIES, "--severity")
    body = {k: v for k, v in (("state", state), ("severity", severity), ("owner", owner),
                              ("note", note)) if v is not None}  # fmt: skip
    if not body:
        raise typer.BadParameter("give --state, --severity, --owner or --note")
    inc = send_request(ctx, "PATCH", f"{API}/{incident_id}", body)
    if as_json:
        render.print_json(inc)
    else:
        render.print_line(f"incident {inc['id']}: {inc['state']}, {inc['severity']}, "
                          f"owner {inc['owner']}")  # fmt: skip


@app.command("close")
def close_cmd(
    ctx: typer.Context,
    incident_id: int = typer.Argument(..., min=1, help="The incident's id."),
    postmortem: str | None = typer.Option(None, "--postmortem", help="The post-mortem text."),
    postmortem_file: Path | None = typer.Option(
        None, "--postmortem-file", help="Read the post-mortem from this file (e.g. Markdown)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Close an incident with its post-mortem."""
    if (postmortem is None) == (postmortem_file is None):
        raise typer.BadParameter("give exactly one of --postmortem and --postmortem-file")
    if postmortem_file is not None:
        try:
            postmortem = postmortem_file.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"proofplane: cannot read {postmortem_file}: {exc}",
                           exit_code=2) from None  # fmt: skip
    inc = send_request(ctx, "POST", f"{API}/{incident_id}/close", {"postmortem": postmortem})
    if as_json:
        render.print_json(inc)
    else:
        render.print_line(f"incident {inc['id']} closed")


@app.command("bundle")
def bundle_cmd(
    ctx: typer.Context,
    incident_id: int = typer.Argument(..., min=1, help="The incident's id."),
    out: Path = typer.Option(..., "--out", "-o", help="Write the evidence bundle here."),
    records: Path | None = typer.Option(
        None,
        "--records",
        help="Also write each attestation evidence record into this folder "
        "(one file each, for `proofplane attest replay`).",
    ),
) -> None:
    """Download the evidence bundle, byte for byte (its SHA-256 checked against the incident's);
    check it offline with `proofplane audit verify-bundle FILE`."""
    with client(ctx) as api:
        inc = api.get(f"{API}/{incident_id}")
        text = api.text("GET", f"{API}/{incident_id}/bundle")
    raw = text.encode("utf-8")
    digest = hashlib.sha256(raw).hexdigest()
    if digest != inc.get("bundle_sha256"):
        raise CliError(f"proofplane: the bundle's sha256 {digest} is not the incident's "
                       f"{inc.get('bundle_sha256')}")  # fmt: skip
    try:
        out.write_bytes(raw)
    except OSError as exc:
        raise CliError(f"proofplane: cannot write {out}: {exc.strerror}", exit_code=2) from None
    written = 0
    if records is not None:
        evidence = (json.loads(raw).get("incident") or {}).get("attestation") or []
        try:
            records.mkdir(parents=True, exist_ok=True)
            for item in evidence:
                name = f"{inc['subject']}-evidence-{int(item['evidence_id'])}.json"
                (records / name).write_text(json.dumps(item["record"], indent=1) + "\n")
                written += 1
        except OSError as exc:
            raise CliError(f"proofplane: cannot write into {records}: {exc.strerror}",
                           exit_code=2) from None  # fmt: skip
    typer.echo(f"wrote incident {incident_id}'s evidence bundle to {out} (sha256 {digest})")
    if records is not None:
        typer.echo(f"wrote {written} attestation evidence record(s) to {records}")
