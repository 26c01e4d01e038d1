"""Build an auditor's evidence package for one framework and period.

A package is a directory::

    manifest.json              every file below with its SHA-256 (the manifest's own hash is
                               recorded in the audit log: the evidence.package entry)
    control-map.yaml           the control map as shipped (data)
    controls.json              each control of the framework: claim, evidence, exceptions
    artifacts/<name>.json      the evidence, each citing the audit entries it rests on
    report.html, report.pdf    the same for a person who never used proofplane
    verification-bundle.json   every cited entry and the evidence.package entry, with
                               inclusion proofs against a checkpoint signed after it, and
                               the verifier key (the format of `proofplane audit
                               export-bundle`)

The manifest is signed through the log rather than with a key of its own: its hash goes into
an ``evidence.package`` event (the package is itself on the record), a checkpoint covering
that event is signed with the log's KMS key, and the bundle proves the event into it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import func, select

from proofplane import __version__
from proofplane.access import SYSTEM, Actor, Permission, authorize
from proofplane.audit import bundle as bundle_mod
from proofplane.audit import merkle, note
from proofplane.audit.canonical import entry_bytes
from proofplane.errors import ValidationFailed
from proofplane.service import audit as audit_svc
from proofplane.service import tenants as tenants_svc
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.service.evidence import collect
from proofplane.service.evidence.controls import Control, controls_for, framework_name, map_text
from proofplane.store import audit_log
from proofplane.store.tables import EventRow

FORMAT = "proofplane-evidence-package/v1"
MANIFEST = "manifest.json"
BUNDLE = "verification-bundle.json"
TEMPLATES = Path(__file__).resolve().parent / "templates"

_env = Environment(
    loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]), trim_blocks=True
)


class EmptyPeriod(ValidationFailed):
    code = "empty_period"


class FuturePeriod(ValidationFailed):
    code = "period_in_future"


@dataclass
class Package:
    id: str
    files: dict[str, bytes]  # relative path -> bytes, the manifest and the bundle included
    controls: int
    exceptions: int
    cited: int
    checkpoint_size: int


def check_period(start: datetime, end: datetime, now: datetime) -> None:
    """A period is ``[start, end)``, in the past, not empty."""
    for name, ts in (("from", start), ("to", end)):
        if ts.tzinfo is None:
            raise ValidationFailed(f"--{name} needs a time zone (UTC: …Z)", code="naive_time")
    if start >= end:
        raise EmptyPeriod(
            f"the period is empty: from {start.isoformat()} is not before to {end.isoformat()}",
            details={"from": start.isoformat(), "to": end.isoformat()},
        )
    if end > now:
        raise FuturePeriod(
            f"the period ends in the future ({end.isoformat()}, now is {now.isoformat()}): "
            "evidence exists only for what has happened",
            details={"to": end.isoformat(), "now": now.isoformat()},
        )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True, default=str) + "\n").encode()


def _entries(store: Store, indices: list[int]) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    with store.read() as s:
        for k in range(0, len(indices), 500):
            seqs = [i + 1 for i in indices[k : k + 500]]
            for row in s.scalars(select(EventRow).where(EventRow.seq.in_(seqs))):
                out[row.seq - 1] = entry_bytes(event_from_row(row))
    return out


def evaluate(controls: list[Control], arts: dict[str, collect.Artifact]) -> list[dict[str, Any]]:
    """Each control with its evidence's summaries and the exceptions its checks found."""
    out = []
    for c in controls:
        exceptions = [f"{name}: {x}" for name in c.checks for x in arts[name].exceptions]
        out.append(
            {
                "nist": c.nist,
                "nist_label": c.label,
                "nist_title": c.nist_title,
                "requirements": [{"id": r.id, "title": r.title} for r in c.requirements],
                "claim": c.claim,
                "evidence": [
                    {
                        "artifact": f"artifacts/{n}.json",
                        "title": arts[n].title,
                        "summary": arts[n].summary,
                        "cited": arts[n].cited_total,
                    }  # fmt: skip
                    for n in c.evidence
                ],
                "exceptions": exceptions,
                "status": "exceptions" if exceptions else "met",
            }
        )
    return out


def build_package(
    store: Store,
    actor: Actor,
    keys: audit_svc.AuditKeys,
    *,
    framework: str,
    start: datetime,
    end: datetime,
    tenant: str | None,
    now: datetime,
    session_ttl: timedelta,
    catalog: Path | None = None,
) -> Package:
    """Collect, render, record and prove the package (see the module's docstring)."""
    authorize(actor, Permission.AUDIT_READ)
    check_period(start, end, now)
    controls, catalog_source = controls_for(framework, catalog)
    if tenant is not None:
        tenants_svc.get_tenant(store, SYSTEM, tenant)  # 404 for a tenant that does not exist
    with store.read() as s:
        events = s.scalar(select(func.count()).where(EventRow.ts >= start, EventRow.ts < end))
    if not events:
        raise EmptyPeriod(
            f"no event was recorded from {start.isoformat()} to {end.isoformat()}: "
            "there is nothing to show for that period",
            details={"from": start.isoformat(), "to": end.isoformat()},
        )
    period = collect.Period(start, end, tenant, now, session_ttl)
    arts = collect.collect_all(store, period, keys)
    evaluated = evaluate(controls, arts)
    cited = sorted({i for a in arts.values() for i in a.cited})
    entries = _entries(store, cited)
    package_id = "ev-" + now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(4)
    head = {
        "package": package_id,
        "framework": framework,
        "framework_name": framework_name(framework),
        "period": {"from": start.isoformat(), "to": end.isoformat()},
        "tenant": tenant,
        "created_at": now.isoformat(),
    }
    files: dict[str, bytes] = {"control-map.yaml": map_text().encode()}
    for a in arts.values():
        files[f"artifacts/{a.name}.json"] = _json(
            {
                **head,
                "artifact": a.name,
                "title": a.title,
                "summary": a.summary,
                "data": a.data,
                "exceptions": a.exceptions,
                "cited_total": a.cited_total,
                "cited_entries": [
                    {"index": i, "leaf_hash": merkle.leaf_hash(entries[i]).hex()}
                    for i in a.cited
                    if i in entries
                ],
            }
        )
    files["controls.json"] = _json({**head, "oscal_catalog": catalog_source,
                                    "controls": evaluated})  # fmt: skip
    html = render_report(head, evaluated, arts, catalog_source)
    files["report.html"] = html.encode()
    files["report.pdf"] = render_pdf(html)
    manifest = _json(
        {
            "format": FORMAT,
            **head,
            "generator": f"proofplane {__version__}",
            "files": {
                path: {"sha256": _sha(data), "bytes": len(data)}
                for path, data in sorted(files.items())
            },
        }
    )
    files[MANIFEST] = manifest
    with store.write(actor, now) as tx:
        row = tx.record(
            "evidence.package",
            "evidence",
            package_id,
            details={
                "framework": framework,
                "from": start.isoformat(),
                "to": end.isoformat(),
                "tenant": tenant,
                "manifest_sha256": _sha(manifest),
                "files": len(files) + 1,
                "cited_entries": len(entries),
            },
        )
        package_index = row.seq - 1
    signed = audit_svc.sign_checkpoint(store, SYSTEM, keys, now)
    assert signed is not None
    verifier = note.signed_by(signed, audit_svc.known_verifiers(store, keys))
    cp = note.verify_checkpoint(signed, verifier)
    entries.update(_entries(store, [package_index]))
    items = []
    with store.read() as s:
        for index in sorted(entries):
            _, proof = audit_log.inclusion(s, index, cp.size)
            items.append((index, entries[index], proof))
    bundle = bundle_mod.make_bundle(
        checkpoint=signed,
        verifier_key=verifier.text(),
        items=items,
        created_at=now,
        selection={
            "evidence_package": package_id,
            "from": start.isoformat(),
            "to": end.isoformat(),
            "tenant": tenant,
        },  # fmt: skip
    )
    files[BUNDLE] = _json(bundle)
    return Package(
        package_id,
        files,
        len(evaluated),
        sum(1 for c in evaluated if c["exceptions"]),
        len(items),
        cp.size,
    )


def render_report(
    head: dict[str, Any],
    controls: list[dict[str, Any]],
    arts: dict[str, collect.Artifact],
    catalog_source: str,
) -> str:
    return _env.get_template("report.html").render(
        head=head,
        controls=controls,
        artifacts=list(arts.values()),
        catalog=Path(catalog_source).name,
        met=sum(1 for c in controls if c["status"] == "met"),
    )


def render_pdf(html: str) -> bytes:
    """The report as PDF (WeasyPrint: HTML and CSS, no browser)."""
    from weasyprint import HTML  # imported here: half a second, only when a PDF is made

    pdf = HTML(string=html, base_url=str(TEMPLATES)).write_pdf()
    assert pdf is not None
    return bytes(pdf)


def write_package(package: Package, directory: Path) -> None:
    """Write the package's files under ``directory`` (created; must be empty if it exists)."""
    if directory.exists() and any(directory.iterdir()):
        raise ValidationFailed(
            f"{directory} is not empty: give a new or empty directory", code="output_not_empty"
        )
    for path, data in package.files.items():
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
