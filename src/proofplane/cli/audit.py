"""``proofplane audit …``: signed checkpoints, proofs, whole-log verification (through the
server, or straight on the database with ``--db``), and offline evidence bundles."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from proofplane.audit import bundle as bundle_mod
from proofplane.audit import merkle, note
from proofplane.cli.client import EXIT_USAGE, ApiError, CliError
from proofplane.cli.common import client, iso_callback
from proofplane.cli.server import store_errors

app = typer.Typer(
    help="The tamper-evident audit log: checkpoints, proofs, verification, bundles.",
    no_args_is_help=True,
)
API = "/api/v1/audit"

KeyOpt = typer.Option(
    None,
    "--key",
    help="The verifier key you trust (<name>+<id>+<base64>, or a file holding it). Default: "
    "the verifier keys the server publishes (audit key --all), or with --db those of the key "
    "inventory in the database (and a legacy key file's). Pinning is the stronger check.",
)


def trusted_key(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    text = path.read_text() if "+" not in value and path.exists() else value
    try:
        return note.parse_verifier_key(text).text()
    except note.NoteError as exc:
        raise CliError(f"proofplane: --key: {exc}", exit_code=EXIT_USAGE) from exc


def _print(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


@app.command("checkpoint")
def checkpoint(
    ctx: typer.Context,
    sign: bool = typer.Option(False, "--sign", help="Sign a new checkpoint now (operator)."),
) -> None:
    """Print the newest signed checkpoint (or sign one now with --sign)."""
    with client(ctx) as c:
        typer.echo(c.text("POST" if sign else "GET", f"{API}/checkpoint"), nl=False)


@app.command("key")
def key(
    ctx: typer.Context,
    all_keys: bool = typer.Option(
        False,
        "--all",
        help="Every verifier key the log was signed with (one per version of the KMS key "
        "audit-checkpoint, and a legacy key file's), with its validity period.",
    ),
    as_json: bool = typer.Option(False, "--json", help="With --all: print JSON."),
) -> None:
    """Print the verifier key new checkpoints are signed with (or all of them with --all)."""
    with client(ctx) as c:
        if not all_keys:
            typer.echo(c.text("GET", f"{API}/key"), nl=False)
            return
        data = c.get(f"{API}/verifiers")
    if as_json:
        _print(data)
        return
    for v in data["verifiers"]:
        which = "legacy key file" if v["legacy"] else f"{v['kms_key']} v{v['version']}"
        until = v["valid_until"] or ("now (current)" if v["current"] else "-")
        since = v["valid_from"] or "-"
        typer.echo(f"{v['verifier']}")
        typer.echo(f"  {which}; valid {since} .. {until}; {v['checkpoints']} checkpoint(s)")


def _server_verifiers(c: Any) -> list[note.VerifierKey]:
    """The verifier keys the server publishes (every version's, oldest first)."""
    return [note.parse_verifier_key(v["verifier"]) for v in c.get(f"{API}/verifiers")["verifiers"]]


@app.command("prove")
def prove(
    ctx: typer.Context,
    index: int | None = typer.Option(None, "--index", min=0, help="Prove this entry's inclusion."),
    old_size: int | None = typer.Option(None, "--old-size", min=1, help="Prove consistency."),
    tree_size: int | None = typer.Option(
        None, "--tree-size", min=1, help="Default: the newest checkpoint's size."
    ),
    trusted: str | None = KeyOpt,
) -> None:
    """Fetch an inclusion (--index) or consistency (--old-size) proof, check it against the
    newest signed checkpoint, and print it. Exits 1 if it does not verify."""
    if (index is None) == (old_size is None):
        raise CliError("proofplane: give exactly one of --index or --old-size", exit_code=2)
    with client(ctx) as c:
        pinned = trusted_key(trusted)
        vks = [note.parse_verifier_key(pinned)] if pinned else _server_verifiers(c)
        cp = note.verify_checkpoint(c.text("GET", f"{API}/checkpoint"), vks)
        size = tree_size or cp.size
        if size != cp.size:
            raise CliError("proofplane: --tree-size must be the checkpoint's size to verify")
        if index is not None:
            p = c.get(f"{API}/proof/inclusion", {"index": index, "tree_size": size})
            proof = [bytes.fromhex(h) for h in p["proof"]]
            ok = merkle.verify_inclusion(
                bytes.fromhex(p["leaf_hash"]), index, size, proof, cp.root_hash
            )
        else:
            assert old_size is not None
            p = c.get(f"{API}/proof/consistency", {"old_size": old_size, "new_size": size})
            old_root = _root_from_entries(c, old_size)
            proof = [bytes.fromhex(h) for h in p["proof"]]
            ok = merkle.verify_consistency(old_size, size, old_root, cp.root_hash, proof)
    _print({**p, "root": cp.root_hash.hex(), "verified": ok})
    if not ok:
        raise CliError("proofplane: the proof does not verify against the signed checkpoint")


def _iter_entries(c: Any, size: int) -> Any:
    for start in range(0, size, 1000):
        page = c.get(f"{API}/entries", {"start": start, "end": min(size, start + 1000)})
        yield from page["entries"]


def _root_from_entries(c: Any, size: int) -> bytes:
    return merkle.root([base64.b64decode(e["entry"]) for e in _iter_entries(c, size)])


@app.command("verify")
def verify(
    ctx: typer.Context,
    db: str | None = typer.Option(
        None, "--db", help="Verify straight on this database URL, without a server."
    ),
    trusted: str | None = KeyOpt,
    origin: str | None = typer.Option(None, "--origin", help="Expected origin line."),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=1,
        help="With --db on SQLite: processes for the recomputation (default: one per CPU "
        "for large logs).",
    ),
    require_checkpoint: bool = typer.Option(
        False,
        "--require-checkpoint",
        help="Exit 3 when no signed checkpoint exists yet (otherwise that is reported and the "
        "log is checked against its stored tree only).",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Recompute the whole log from the events and check it against the newest signed
    checkpoint. Exits 1 naming the first index that does not match. With no signed checkpoint
    yet, says so (``"checkpoint": null``, ``"verified_against_checkpoint": false``) and exits 0,
    or 3 with --require-checkpoint."""
    if db is not None:
        report = _verify_db(db, trusted_key(trusted), origin, workers)
    else:
        report = _verify_server(ctx, trusted_key(trusted), origin)
    if as_json:
        _print(report)
    if not report["ok"]:
        where = report.get("first_bad_index")
        head = f"first bad index: {where}" if where is not None else "the log does not verify"
        raise CliError(f"proofplane: audit verify FAILED: {head}", lines=report["problems"])
    if report["checkpoint"] is None:
        if not as_json:
            typer.echo(
                f"ok: {report['events']} entries recomputed against the stored tree; "
                "NO signed checkpoint yet: nothing verified against a signature"
            )
        if require_checkpoint:
            raise CliError(
                "proofplane: audit verify: no signed checkpoint to verify against "
                "(--require-checkpoint)",
                lines=["sign one: 'proofplane audit checkpoint --sign' (or let the signer run)"],
                exit_code=3,
            )
        return
    if not as_json:
        typer.echo(
            f"ok: {report['events']} entries recomputed; checkpoint size "
            f"{report['checkpoint_size']} verified"
        )


def _verify_db(
    url: str, trusted: str | None, origin: str | None, workers: int | None = None
) -> dict[str, Any]:
    from proofplane.service import audit as audit_svc
    from proofplane.service.context import Store

    with store_errors("audit verify"):
        store = Store(url)
        try:
            if trusted is None:
                keys = audit_svc.AuditKeys(origin=origin or "proofplane/default")
                vks = audit_svc.known_verifiers(store, keys)
            else:
                vks = [note.parse_verifier_key(trusted)]
            return audit_svc.verify_log(store, vks, origin, workers=workers).to_dict()
        finally:
            store.dispose()


def _verify_server(ctx: typer.Context, trusted: str | None, origin: str | None) -> dict[str, Any]:
    problems: list[str] = []
    first_bad: int | None = None
    with client(ctx) as c:
        vks = [note.parse_verifier_key(trusted)] if trusted else _server_verifiers(c)
        try:
            signed = c.text("GET", f"{API}/checkpoint")
        except ApiError as exc:
            if exc.code != "no_checkpoint":
                raise
            # nothing signed yet: the server's entries have no size to be checked against
            return {
                "ok": True,
                "events": 0,
                "tree_size": None,
                "checkpoint_size": None,
                "first_bad_index": None,
                "problems": ["no signed checkpoint: nothing to verify against"],
                "checkpoint": None,
                "verified_against_checkpoint": False,
            }
        try:
            cp = note.verify_checkpoint(signed, vks, origin)
        except note.NoteError as exc:
            raise CliError(f"proofplane: the checkpoint does not verify: {exc}") from exc
        leaves = []
        for e in _iter_entries(c, cp.size):
            leaf = merkle.leaf_hash(base64.b64decode(e["entry"]))
            if leaf.hex() != e["leaf_hash"] and first_bad is None:
                first_bad = e["index"]
                problems.append(f"index {e['index']}: the entry does not hash to its leaf")
            leaves.append(leaf)
    if merkle.root_of_hashes(leaves) != cp.root_hash:
        problems.append(f"the entries do not reproduce the checkpoint root at size {cp.size}")
    return {
        "ok": not problems,
        "events": len(leaves),
        "tree_size": cp.size,
        "checkpoint_size": cp.size,
        "first_bad_index": first_bad,
        "problems": problems,
        "checkpoint": {"size": cp.size, "root_hash": cp.root_hash.hex()},
        "verified_against_checkpoint": not problems,
    }


@app.command("export-bundle")
def export_bundle(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", "-o", help="The bundle file to write."),
    since: str | None = typer.Option(None, "--since", callback=iso_callback),
    until: str | None = typer.Option(None, "--until", callback=iso_callback),
    tenant: str | None = typer.Option(None, "--tenant", help="Only events about this tenant."),
    db: str | None = typer.Option(None, "--db", help="Export straight from this database."),
) -> None:
    """Write one file with the selected events, the newest checkpoint, an inclusion proof
    per event and the verifier key; `proofplane audit verify-bundle` checks it offline."""
    t0 = datetime.fromisoformat(since) if since else None
    t1 = datetime.fromisoformat(until) if until else None
    data = _export_db(db, t0, t1, tenant) if db is not None else _export_server(ctx, t0, t1, tenant)
    out.write_text(json.dumps(data, indent=1) + "\n")
    typer.echo(f"wrote {len(data['entries'])} entries to {out}")


def _export_db(
    url: str, since: datetime | None, until: datetime | None, tenant: str | None
) -> dict[str, Any]:
    from proofplane.access import SYSTEM
    from proofplane.service import audit as audit_svc
    from proofplane.service.context import Store

    with store_errors("audit export-bundle"):
        store = Store(url)
        try:
            signed = audit_svc.latest_checkpoint(store, SYSTEM)
            origin = note.parse_checkpoint(signed[: signed.rfind("\n\n") + 1]).origin
            keys = audit_svc.AuditKeys(origin=origin)
            return audit_svc.export_bundle(
                store, SYSTEM, keys, since=since, until=until, tenant=tenant, now=datetime.now(UTC)
            )
        finally:
            store.dispose()


def _export_server(
    ctx: typer.Context, since: datetime | None, until: datetime | None, tenant: str | None
) -> dict[str, Any]:
    with client(ctx) as c:
        signed = c.text("GET", f"{API}/checkpoint")
        try:
            vk = note.signed_by(signed, _server_verifiers(c))
        except note.NoteError as exc:
            raise CliError(f"proofplane: the checkpoint does not verify: {exc}") from exc
        vkey = vk.text()
        cp = note.verify_checkpoint(signed, vk)
        items = []
        for e in _iter_entries(c, cp.size):
            raw = base64.b64decode(e["entry"])
            event = json.loads(raw)
            ts = datetime.fromisoformat(event["ts"].replace("Z", "+00:00"))
            if (since and ts < since) or (until and ts >= until):
                continue
            if tenant is not None and not (
                (event["target_type"] == "tenant" and event["target_id"] == tenant)
                or event["details"].get("tenant") == tenant
            ):
                continue
            p = c.get(f"{API}/proof/inclusion", {"index": e["index"], "tree_size": cp.size})
            items.append((e["index"], raw, [bytes.fromhex(h) for h in p["proof"]]))
    return bundle_mod.make_bundle(
        checkpoint=signed,
        verifier_key=vkey,
        items=items,
        created_at=datetime.now(UTC),
        selection={
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
            "tenant": tenant,
        },
    )


@app.command("verify-bundle")
def verify_bundle(
    path: Path = typer.Argument(..., help="A bundle written by export-bundle."),
    trusted: str | None = KeyOpt,
) -> None:
    """Check a bundle offline (no server, no database): the checkpoint signature, then every
    entry's leaf hash and inclusion proof. Pin the key with --key."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CliError(f"proofplane: cannot read {path}: {exc.strerror}", exit_code=2) from exc
    try:
        report = bundle_mod.verify(raw, trusted_key(trusted))
    except bundle_mod.BundleError as exc:
        raise CliError(f"proofplane: malformed bundle: {exc}", exit_code=2) from exc
    if not report.ok:
        raise CliError("proofplane: bundle does NOT verify", lines=report.failures)
    pinned = "" if trusted else " (key not pinned: pass --key to pin it)"
    typer.echo(
        f"ok: {report.entries} entries included in {report.origin} at size "
        f"{report.tree_size}{pinned}"
    )
