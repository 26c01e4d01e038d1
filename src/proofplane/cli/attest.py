"""``proofplane attest …``: offline attestation tools, and the server's policies.

``attest policy show|set FILE`` reads and sets the server's attestation policies.
``attest eventlog FILE`` parses a binary TCG event log (SHA-1 or crypto-agile) and prints the
replayed PCR values per bank; ``attest replay FILE`` re-verifies a stored evidence record and
exits 1 when the verdict is a rejection.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from proofplane.attest import AttestError, load_record, replay_record
from proofplane.attest import eventlog as el
from proofplane.cli.client import CliError
from proofplane.cli.common import fetch, send
from proofplane.cli.render import console, print_json, print_line

app = typer.Typer(help="Attestation: event logs and evidence, verified offline.",
                  no_args_is_help=True)  # fmt: skip

EXIT_USAGE = 2


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CliError(f"proofplane: no such file: {path}", exit_code=EXIT_USAGE) from None
    except IsADirectoryError:
        raise CliError(f"proofplane: {path} is a directory", exit_code=EXIT_USAGE) from None
    except OSError as exc:
        raise CliError(f"proofplane: cannot read {path}: {exc.strerror}",
                       exit_code=EXIT_USAGE) from None  # fmt: skip


@app.command("eventlog")
def eventlog_cmd(
    file: Path = typer.Argument(
        ...,
        help="Binary event log, e.g. a copy of /sys/kernel/security/tpm0/binary_bios_measurements.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print {bank: {pcr: hex}} as JSON."),
    events: bool = typer.Option(False, "--events", help="Also list the events (table only)."),
) -> None:
    """Parse a TCG event log and print the PCR values its replay gives, per bank."""
    blob = _read(file)
    try:
        log = el.parse_eventlog(blob)
        pcrs = el.replay(log)
    except AttestError as exc:
        raise CliError(f"proofplane: {file} is not a valid event log ({exc.reason}): "
                       f"{exc.message}") from None  # fmt: skip
    result = {bank: {str(i): v.hex() for i, v in values.items()} for bank, values in pcrs.items()}
    if as_json:
        print_json(result)
        return
    out = console()
    fmt = "crypto-agile" if log.crypto_agile else "SHA-1 (TCG 1.2)"
    out.print(
        f"{file}: {fmt}, {len(log.events)} events, banks {', '.join(log.banks)}"
        + (f", startup locality {log.startup_locality}" if log.startup_locality else "")
    )
    if events:
        t = Table("#", "PCR", "type", "sha256" if "sha256" in log.banks else log.banks[0],
                  "event", header_style="bold")  # fmt: skip
        bank = "sha256" if "sha256" in log.banks else log.banks[0]
        for ev in log.events:
            pcr = "-" if ev.pcr == el.WINDOWS_VIRTUAL_PCR else str(ev.pcr)
            t.add_row(str(ev.number), pcr, ev.type_name, ev.digests.get(bank, b"").hex()[:16],
                      el.describe_event(ev)[:60])  # fmt: skip
        out.print(t)
    t = Table("PCR", *pcrs, header_style="bold")
    for i in sorted({i for v in pcrs.values() for i in v}):
        t.add_row(str(i), *(pcrs[b][i].hex() if i in pcrs[b] else "-" for b in pcrs))
    out.print(t)


@app.command("replay")
def replay_cmd(
    file: Path = typer.Argument(..., help="An evidence record (JSON) stored by the verifier."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
) -> None:
    """Re-verify a stored evidence record offline; exit 1 when the verdict is a rejection."""
    blob = _read(file)
    try:
        record = load_record(blob)
    except AttestError as exc:
        raise CliError(f"proofplane: {file} is not an evidence record: {exc.message}",
                       exit_code=EXIT_USAGE) from None  # fmt: skip
    verdict = replay_record(record)
    recorded = record.verdict
    agrees = recorded is None or (
        bool(recorded.get("ok")) == verdict.ok
        and list(recorded.get("reasons") or []) == list(verdict.reasons)
        and recorded.get("evidence_hash") in (None, verdict.evidence_hash)
    )
    if as_json:
        print_json({"node": record.node, "verified_at": record.verified_at.isoformat(),
                    "verdict": verdict.to_json(), "matches_recorded_verdict": agrees})  # fmt: skip
    else:
        out = console()
        status = "[green]ACCEPTED[/]" if verdict.ok else "[red]REJECTED[/]"
        out.print(f"{record.node or file}: {status} (policy {verdict.policy_id}, "
                  f"as of {record.verified_at.isoformat()})")  # fmt: skip
        for reason in verdict.reasons:
            out.print(f"  {reason}: {verdict.messages.get(reason, '')}", markup=False)
        out.print(f"  evidence sha256 {verdict.evidence_hash}")
        if not agrees:
            out.print("[yellow]  the recorded verdict differs from this replay[/]")
    if not verdict.ok or not agrees:
        raise typer.Exit(1)


policy_app = typer.Typer(help="The server's attestation policies (one per node class).",
                         no_args_is_help=True)  # fmt: skip
app.add_typer(policy_app, name="policy")


@policy_app.command("show")
def policy_show(
    ctx: typer.Context,
    node_class: str | None = typer.Option(None, "--class", help="Only this node class."),
    as_json: bool = typer.Option(False, "--json", help="Print the API's JSON."),
) -> None:
    """Show the attestation policies: node class, enforcement, hash and rules."""
    items = fetch(ctx, "/api/v1/attestation/policy")["items"]
    if node_class is not None:
        items = [p for p in items if p["node_class"] == node_class]
    if as_json:
        print_json({"items": items})
        return
    if not items:
        print_line("no attestation policy set (nodes cannot be attested)")
    for p in items:
        mode = "enforced" if p["enforce"] else "observe only"
        print_line(f"class {p['node_class']}: {mode}, sha256 {p['policy_hash']}, "
                   f"set by {p['updated_by']} at {p['updated_at']}")  # fmt: skip
        print_json(p["policy"])


@policy_app.command("set")
def policy_set(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="A policy JSON document (its node_class is the key)."),
    observe: bool = typer.Option(
        False, "--observe", help="Record verdicts only: no admission or quarantine."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the API's JSON."),
) -> None:
    """Create or replace the policy of the node class the document names."""
    import json

    try:
        doc = json.loads(_read(file))
    except ValueError as exc:
        raise CliError(f"proofplane: {file} is not JSON: {exc}", exit_code=EXIT_USAGE) from None
    out = send(ctx, "PUT", "/api/v1/attestation/policy", {"policy": doc, "enforce": not observe})
    if as_json:
        print_json(out)
    else:
        print_line(f"policy for class {out['node_class']} set (sha256 {out['policy_hash']}, "
                   f"{'enforced' if out['enforce'] else 'observe only'})")  # fmt: skip
