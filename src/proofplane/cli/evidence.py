"""``proofplane evidence …``: the auditor's evidence package (issue 16).

``package`` asks the server for one (``POST /api/v1/evidence/packages``, then polls the job
and downloads it) and unpacks it into ``-o DIR``; with ``--db`` it is built straight from the
database. ``verify`` re-checks a package offline and names what fails.
"""

from __future__ import annotations

import io
import tarfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath

import typer

from proofplane.cli.client import EXIT_USAGE, CliError
from proofplane.cli.common import client
from proofplane.cli.server import store_errors
from proofplane.errors import ProofplaneError

app = typer.Typer(
    help="The auditor's evidence package: build one per framework and period, verify it.",
    no_args_is_help=True,
)
API = "/api/v1/evidence/packages"
FRAMEWORKS = "hipaa|pci-dss|iso27001|nist-800-53|soc2|gdpr"


def parse_time(value: str, option: str) -> datetime:
    """An ISO 8601 time or date (a date is its midnight); without a zone, UTC."""
    try:
        ts = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not an ISO 8601 date or time (2026-11-01 or 2026-11-01T12:00:00Z)",
            param_hint=option,
        ) from None
    try:
        return ts.astimezone(UTC) if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    except OverflowError:
        raise typer.BadParameter(
            f"{value!r} is outside the years 1 to 9999 in UTC", param_hint=option
        ) from None


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CliError(f"proofplane: {out} exists and is not an empty directory", exit_code=2)


@app.command("package")
def package(
    ctx: typer.Context,
    framework: str = typer.Option(..., "--framework", help=FRAMEWORKS),
    start: str = typer.Option(..., "--from", help="Start of the period (ISO 8601, inclusive)."),
    end: str = typer.Option(..., "--to", help="End of the period (ISO 8601, exclusive)."),
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's evidence."),
    out: Path = typer.Option(..., "--out", "-o", help="The directory to write (new or empty)."),
    db: str | None = typer.Option(None, "--db", help="Build straight from this database."),
    wait: float = typer.Option(600, "--wait", min=1, help="Seconds to wait for the server."),
) -> None:
    """Build the evidence package for FRAMEWORK over [--from, --to) and write it to -o DIR:
    control map, artifacts, report (HTML, PDF), verification bundle, manifest."""
    t0, t1 = parse_time(start, "--from"), parse_time(end, "--to")
    _check_out(out)
    if db is not None:
        pid, controls, exceptions = _build_db(db, framework, t0, t1, tenant, out)
    else:
        pid, controls, exceptions = _build_server(ctx, framework, t0, t1, tenant, out, wait)
    typer.echo(
        f"wrote evidence package {pid} to {out}: {controls} controls, {exceptions} with "
        f"exceptions; check it with: proofplane evidence verify {out}"
    )


def _build_db(
    url: str, framework: str, start: datetime, end: datetime, tenant: str | None, out: Path
) -> tuple[str, int, int]:
    from proofplane.access import SYSTEM
    from proofplane.audit import note
    from proofplane.config import Settings
    from proofplane.service import audit as audit_svc
    from proofplane.service import evidence as evidence_svc
    from proofplane.service.context import Store

    with store_errors("evidence package"):
        store = Store(url)
        try:
            try:
                signed = audit_svc.latest_checkpoint(store, SYSTEM)
                origin = note.parse_checkpoint(signed[: signed.rfind("\n\n") + 1]).origin
            except ProofplaneError:
                origin = audit_svc.origin_for(Settings().cluster_id)
            pkg = evidence_svc.build_package(
                store, SYSTEM, audit_svc.AuditKeys(origin=origin), framework=framework,
                start=start, end=end, tenant=tenant, now=datetime.now(UTC),
                session_ttl=Settings().session_ttl,
            )  # fmt: skip
        except ProofplaneError as exc:
            raise CliError(f"proofplane: {exc.code}: {exc.message}") from None
        finally:
            store.dispose()
    evidence_svc.write_package(pkg, out)
    return pkg.id, pkg.controls, pkg.exceptions


def _build_server(
    ctx: typer.Context,
    framework: str,
    start: datetime,
    end: datetime,
    tenant: str | None,
    out: Path,
    wait: float,
) -> tuple[str, int, int]:
    body = {"framework": framework, "from": start.isoformat(), "to": end.isoformat(),
            "tenant": tenant}  # fmt: skip
    with client(ctx) as c:
        job = c.post(API, body)
        deadline = time.monotonic() + wait
        while job["status"] == "running":
            if time.monotonic() > deadline:
                raise CliError(f"proofplane: evidence job {job['id']} still running after {wait}s")
            time.sleep(0.5)
            job = c.get(f"{API}/{job['id']}")
        if job["status"] != "done":
            err = job.get("error") or {}
            raise CliError(
                f"proofplane: the evidence package failed: {err.get('code')}: {err.get('message')}"
            )
        data = c.content(f"{API}/{job['id']}/download")
    unpack(data, out)
    return str(job["package"]), int(job["controls"]), int(job["exceptions"])


def unpack(data: bytes, out: Path) -> None:
    """Unpack the server's tar.gz into ``out``: regular files under one top directory only."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            parts = PurePosixPath(m.name).parts
            if not m.isfile() or len(parts) < 2 or ".." in parts or parts[0].startswith("/"):
                raise CliError(f"proofplane: the server's package holds an unsafe entry {m.name!r}")
        out.mkdir(parents=True, exist_ok=True)
        for m in members:
            target = out.joinpath(*PurePosixPath(m.name).parts[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(m)
            assert source is not None
            target.write_bytes(source.read())


@app.command("verify")
def verify(
    directory: Path = typer.Argument(..., help="A package written by `evidence package`."),
    trusted: str | None = typer.Option(
        None, "--key", help="The verifier key you trust (<name>+<id>+<base64>, or a file)."
    ),
) -> None:
    """Re-check a package offline: every file against the manifest, the manifest against its
    evidence.package entry, every cited entry's inclusion proof against the signed checkpoint.
    Names each artifact or entry that fails."""
    from proofplane.cli.audit import trusted_key
    from proofplane.service import evidence as evidence_svc

    started = time.perf_counter()
    try:
        report = evidence_svc.verify_package(directory, trusted_key(trusted))
    except evidence_svc.PackageMalformed as exc:
        raise CliError(f"proofplane: {exc.message}", exit_code=EXIT_USAGE) from None
    if not report.ok:
        raise CliError(
            f"proofplane: evidence package {report.package} does NOT verify",
            lines=report.failures,
        )
    pinned = "" if trusted else " (key not pinned: pass --key to pin it)"
    took = timedelta(seconds=time.perf_counter() - started).total_seconds()
    typer.echo(
        f"ok: package {report.package} ({report.framework}): {report.files} files match the "
        f"manifest, {report.entries} entries included in {report.origin} at size "
        f"{report.tree_size}{pinned} [{took:.2f}s]"
    )
