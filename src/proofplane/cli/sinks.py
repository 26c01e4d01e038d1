"""``proofplane sinks …``: SIEM export sinks (syslog/CEF over mutual TLS, OCSF, Splunk HEC).

``add``, ``list``, ``show``, ``remove`` and ``test`` talk to the API. ``flush`` runs one export
pass: through the API, or, with ``--db``, straight on the database (for a cron job or when the
server's exporter is off).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from proofplane.access import SYSTEM
from proofplane.audit.export.config import SINK_TYPES
from proofplane.cli import render
from proofplane.cli.client import CliError, segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    client,
    fetch,
    run_list,
    send,
)
from proofplane.cli.server import load_sink_policy, open_store, store_errors

app = typer.Typer(
    help="SIEM export sinks: syslog (CEF over mutual TLS), OCSF (file or HTTP), Splunk HEC.",
    no_args_is_help=True,
)


def sinks_table(sinks: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in ("NAME", "TYPE", "ENABLED", "CURSOR", "LAG", "LAST ERROR"):
        table.add_column(col, overflow="fold" if col == "LAST ERROR" else "ellipsis")
    for s in sinks:
        table.add_row(
            render.text(s["name"]),
            render.text(s["type"]),
            render.text("yes" if s["enabled"] else "no"),
            render.text(str(s["cursor"])),
            render.text(str(s["lag"]), "yellow" if s["lag"] else None),
            render.text(s.get("last_error") or "", "red"),
        )
    return table


def show(sink: dict[str, Any]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.title = f"Sink {sink['name']}"
    grid.title_justify = "left"
    grid.title_style = "bold"
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(overflow="fold")
    rows: list[tuple[str, Any]] = [
        ("type", sink["type"]),
        ("enabled", "yes" if sink["enabled"] else "no"),
        *((f"config.{k}", v) for k, v in sorted(sink["config"].items())),
        ("cursor", f"{sink['cursor']} of {sink['head']} (lag {sink['lag']})"),
        ("failures", sink["consecutive_failures"]),
        ("last error", sink.get("last_error") or "-"),
        ("last attempt", render.timestamp(sink.get("last_attempt_at"))),
        ("last success", render.timestamp(sink.get("last_success_at"))),
        ("created", render.timestamp(sink.get("created_at"))),
    ]
    for key, value in rows:
        grid.add_row(key, render.text(str(value)))
    render.console().print(grid)


@app.command("add")
def add(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Sink name (lowercase letters, digits, '-')."),
    sink_type: str = typer.Option(
        ..., "--type", "-t", help=f"One of: {', '.join(SINK_TYPES)}.", show_default=False
    ),
    url: str | None = typer.Option(
        None, "--url", help="syslog: tls://HOST:PORT; ocsf-http, splunk-hec: https://…"
    ),
    path: str | None = typer.Option(
        None, "--path", help="ocsf-file: a file name in the server's PROOFPLANE_SINK_DIR."
    ),
    ca_file: str | None = typer.Option(
        None, "--ca-file", help="CA bundle to verify the server (in PROOFPLANE_SINK_TLS_DIR)."
    ),
    cert_file: str | None = typer.Option(
        None, "--cert-file", help="syslog: client certificate (in PROOFPLANE_SINK_TLS_DIR)."
    ),
    key_file: str | None = typer.Option(
        None, "--key-file", help="syslog: client private key (in PROOFPLANE_SINK_TLS_DIR)."
    ),
    server_name: str | None = typer.Option(None, "--server-name", help="syslog: TLS name."),
    token: str | None = typer.Option(
        None,
        "--hec-token",
        envvar="PROOFPLANE_HEC_TOKEN",
        help="splunk-hec: the HEC token (better: set PROOFPLANE_HEC_TOKEN).",
    ),
    bearer_token: str | None = typer.Option(
        None, "--bearer-token", help="ocsf-http: sent as Authorization: Bearer."
    ),
    index: str | None = typer.Option(None, "--index", help="splunk-hec: index."),
    sourcetype: str | None = typer.Option(None, "--sourcetype", help="splunk-hec: sourcetype."),
    hec_ack: bool = typer.Option(
        False,
        "--hec-ack",
        help="splunk-hec: wait for indexer acknowledgement (for a token with useACK on).",
    ),
    hec_channel: str | None = typer.Option(
        None, "--hec-channel", help="splunk-hec: the request channel (a UUID; default derived)."
    ),
    ack_timeout: float | None = typer.Option(
        None, "--ack-timeout", help="splunk-hec: seconds to wait for the ack (default 30)."
    ),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, max=5000),
    start_at_end: bool = typer.Option(
        False, "--from-now", help="Skip the history: deliver only events from now on."
    ),
    disabled: bool = typer.Option(False, "--disabled", help="Add it switched off."),
    as_json: bool = JsonOpt,
) -> None:
    """Add a sink. The server validates it (URL, TLS files) before storing anything."""
    fields = {
        "url": url,
        "path": path,
        "ca_file": ca_file,
        "cert_file": cert_file,
        "key_file": key_file,
        "server_name": server_name,
        "token": token,
        "bearer_token": bearer_token,
        "index": index,
        "sourcetype": sourcetype,
        "batch_size": batch_size,
        "ack": True if hec_ack else None,
        "channel": hec_channel,
        "ack_timeout_s": ack_timeout,
    }
    body = {
        "name": name,
        "type": sink_type,
        "config": {k: v for k, v in fields.items() if v is not None},
        "enabled": not disabled,
        "start_at": "end" if start_at_end else "beginning",
    }
    sink = send(ctx, "POST", "/api/v1/sinks", body)
    if as_json:
        render.print_json(sink)
    else:
        render.print_line(f"sink {sink['name']} added")
        show(sink)


@app.command("list")
def list_sinks(
    ctx: typer.Context,
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List sinks with their cursors and lag."""
    run_list(
        ctx,
        "/api/v1/sinks",
        {},
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=sinks_table,
        noun="sink",
    )


@app.command("show")
def show_sink(
    ctx: typer.Context, name: str = typer.Argument(..., help="Sink name."), as_json: bool = JsonOpt
) -> None:
    """Show one sink (secrets redacted)."""
    sink = fetch(ctx, f"/api/v1/sinks/{segment(name)}")
    if as_json:
        render.print_json(sink)
    else:
        show(sink)


@app.command("remove")
def remove(
    ctx: typer.Context, name: str = typer.Argument(..., help="Sink name."), as_json: bool = JsonOpt
) -> None:
    """Remove a sink (its cursor goes with it)."""
    sink = send(ctx, "DELETE", f"/api/v1/sinks/{segment(name)}")
    if as_json:
        render.print_json(sink)
    else:
        render.print_line(f"sink {sink['name']} removed (cursor was {sink['cursor']})")


@app.command("test")
def test(
    ctx: typer.Context, name: str = typer.Argument(..., help="Sink name."), as_json: bool = JsonOpt
) -> None:
    """Send one synthetic message (sink.test, seq 0) to the sink now."""
    sink = send(ctx, "POST", f"/api/v1/sinks/{segment(name)}/test")
    if as_json:
        render.print_json(sink)
    else:
        render.print_line(f"sink {sink['name']} accepted the test message", "green")


@app.command("flush")
def flush(
    ctx: typer.Context,
    names: list[str] | None = typer.Argument(None, help="Only these sinks (default: all)."),
    db: str | None = typer.Option(
        None,
        "--db",
        help="Run the pass here, straight on this database URL, instead of on the server.",
    ),
    attempts: int = typer.Option(
        3, "--attempts", min=1, max=10, help="With --db: tries per batch (exponential backoff)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Run one export pass: deliver every sink's backlog now. Exit 1 if a sink failed."""
    if db is not None:
        from proofplane.service import sinks as sinks_svc

        policy = load_sink_policy()
        store = open_store(db)
        store.sink_policy = policy
        retry = sinks_svc.RetryPolicy(attempts=attempts)
        try:
            with store_errors("flush"):
                raw = sinks_svc.export_once(store, SYSTEM, names=names or None, retry=retry)
        finally:
            store.dispose()
        results = [
            {"name": r.name, "delivered": r.delivered, "cursor": r.cursor, "error": r.error}
            for r in raw
        ]
    else:
        with client(ctx) as api:
            answer = api.request("POST", "/api/v1/sinks/flush", params={"name": names or None})
        results = answer["results"]
    if as_json:
        render.print_json({"results": results})
    else:
        for r in results:
            if r["error"]:
                render.print_line(
                    f"{r['name']}: FAILED at cursor {r['cursor']}: {r['error']}", "red"
                )
            else:
                render.print_line(
                    f"{r['name']}: delivered {r['delivered']} event(s), cursor {r['cursor']}"
                )
        if not results:
            render.print_line("no sinks to flush")
    if any(r["error"] for r in results):
        raise typer.Exit(1)


@app.command("validate-ocsf")
def validate_ocsf(
    file: Path = typer.Argument(
        ..., help="An OCSF export: JSON lines (ocsf-file) or a JSON array."
    ),
    schema_dir: Path = typer.Option(
        ...,
        "--schema",
        help="An OCSF schema directory (github.com/ocsf/ocsf-schema at the export's version).",
    ),
    warnings: bool = typer.Option(
        False, "--warnings", help="Also report warnings (missing recommended attributes…)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Check every event of an OCSF export against the published schema, offline. Exit 1 if
    any event has an error."""
    from proofplane.audit.export import ocsf_schema
    from proofplane.siem.ocsf_files import load_schema

    try:
        schema = load_schema(schema_dir)
        events = _ocsf_events(file)
    except ocsf_schema.SchemaError as exc:
        raise CliError(exc.message) from None
    report = []
    for where, event in events:
        found = schema.validate(event, warn_recommended=warnings)
        shown = found if warnings else ocsf_schema.errors(found)
        report.extend({"event": where, "severity": f.severity, "code": f.code,
                       "path": f.path, "message": f.message} for f in shown)  # fmt: skip
    failed = any(r["severity"] == ocsf_schema.ERROR for r in report)
    if as_json:
        render.print_json({"events": len(events), "schema": schema.version, "findings": report})
    else:
        for r in report:
            style = "red" if r["severity"] == ocsf_schema.ERROR else "yellow"
            render.print_line(f"{r['event']}: {r['severity']} {r['code']} at "
                              f"{r['path'] or '<event>'}: {r['message']}", style)  # fmt: skip
        verdict = "FAIL" if failed else "ok"
        render.print_line(
            f"{len(events)} event(s) checked against OCSF {schema.version}: {verdict}"
        )
    if failed:
        raise typer.Exit(1)


def _ocsf_events(file: Path) -> list[tuple[str, Any]]:
    """(where, event) for each event of a JSON-lines file or a JSON array."""
    from proofplane.audit.export.ocsf_schema import SchemaError

    try:
        text = file.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"cannot read {file}: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{file}: not JSON: {exc}") from None
        return [(f"{file.name}[{i}]", e) for i, e in enumerate(items)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{file.name}:{n}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{file.name}:{n}: not JSON: {exc}") from None
    return out
