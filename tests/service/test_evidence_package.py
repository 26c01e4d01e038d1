"""The auditor's evidence package on the demo: every framework builds from the live record,
its NIST titles are NIST's (the OSCAL catalog), the PDF reads as pages, the package verifies
offline, and a changed artifact, entry or manifest is named; bad input is a clear error."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ci import SHARED, unavailable
from console_world import HOSPITAL, World, build_world
from proofplane.access import SYSTEM, Actor, Forbidden, Role
from proofplane.errors import NotFound, ValidationFailed
from proofplane.service import evidence

CATALOG = SHARED / "data" / "oscal" / "NIST_SP-800-53_rev5_catalog.json"
DAY = timedelta(days=1)


@pytest.fixture(scope="module", autouse=True)
def _catalog() -> None:
    if not CATALOG.is_file():
        unavailable(f"NIST's OSCAL catalog is missing: {CATALOG}")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("evidence"))


def _build(world: World, framework: str = "hipaa", tenant: str | None = None, **kw):
    now = datetime.now(UTC)
    return evidence.build_package(
        world.store, kw.pop("actor", SYSTEM), world.keys, framework=framework,
        start=kw.pop("start", now - DAY), end=kw.pop("end", now), tenant=tenant, now=now,
        session_ttl=timedelta(hours=1), catalog=CATALOG,
    )  # fmt: skip


@pytest.fixture(scope="module")
def package_dir(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pkg") / "hipaa"
    evidence.write_package(_build(world), out)
    return out


def _copy(package_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(package_dir, out)
    return out


def test_the_control_map_has_25_controls_titled_from_oscal() -> None:
    controls, source = evidence.controls_for("nist-800-53", CATALOG)
    assert len(controls) >= 25 and source == str(CATALOG)
    catalog = json.loads(CATALOG.read_text())
    titles = {c["id"]: c["title"] for g in catalog["catalog"]["groups"] for c in g["controls"]}
    for c in controls:
        assert c.nist_title == titles[c.nist]  # NIST's words, read, not retyped
    assert {c.nist for c in controls} >= {"ac-2", "au-9", "ia-2", "si-7", "sc-8"}


@pytest.mark.parametrize("framework", evidence.FRAMEWORKS)
def test_every_framework_maps_controls(framework: str) -> None:
    controls, _ = evidence.controls_for(framework, CATALOG)
    assert len(controls) >= 5
    assert all(c.requirements and c.evidence and c.claim for c in controls)


def test_hipaa_maps_164_312_a_to_e() -> None:
    controls, _ = evidence.controls_for("hipaa", CATALOG)
    ids = {r.id for c in controls for r in c.requirements}
    for section in ("164.312(a)", "164.312(b)", "164.312(c)", "164.312(d)", "164.312(e)"):
        assert any(i.startswith(section) for i in ids), section


def test_the_demo_package_verifies_offline(package_dir: Path) -> None:
    report = evidence.verify_package(package_dir)
    assert report.ok, report.failures
    assert report.entries > 10 and report.framework == "hipaa"
    names = {p.name for p in (package_dir / "artifacts").iterdir()}
    assert {"accounts.json", "role-permissions.json", "auth-settings.json", "tokens.json",
            "attestation.json", "placement-compliance.json", "siem-sinks.json",
            "audit-log-verification.json", "key-inventory.json", "change-register.json",
            "segmentation.json"} <= names  # fmt: skip
    placement = json.loads((package_dir / "artifacts" / "placement-compliance.json").read_text())
    assert placement["data"]["placements_checked"] >= 5
    assert "hipaa=true" in placement["data"]["by_tag"] and placement["exceptions"] == []
    attest = json.loads((package_dir / "artifacts" / "attestation.json").read_text())
    assert "par-a100-01" in attest["data"]["nodes"]  # the drifting node's failure is listed
    assert any("par-a100-01" in x for x in attest["exceptions"])
    assert attest["data"]["simulated_nodes"]  # simulated attesters are said to be simulated
    log = json.loads((package_dir / "artifacts" / "audit-log-verification.json").read_text())
    assert log["data"]["ok"] is True


def test_the_bundle_is_the_audit_bundle_format(package_dir: Path) -> None:
    """`proofplane audit verify-bundle` (any RFC 9162 verifier) checks it as it is."""
    from proofplane.audit import bundle

    raw = (package_dir / "verification-bundle.json").read_bytes()
    report = bundle.verify(raw)
    assert report.ok and report.entries == len(json.loads(raw)["entries"])


def test_the_report_reads_as_pages(package_dir: Path, tmp_path: Path) -> None:
    for tool in ("pdftoppm", "pdftotext"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (apt-get install poppler-utils)")
    pdf = package_dir / "report.pdf"
    assert pdf.read_bytes().startswith(b"%PDF-")
    subprocess.run(["pdftoppm", "-png", "-r", "50", str(pdf), str(tmp_path / "page")], check=True)
    pages = sorted(tmp_path.glob("page-*.png"))
    assert len(pages) >= 3 and all(p.stat().st_size > 5_000 for p in pages)
    text = subprocess.run(
        ["pdftotext", str(pdf), "-"], check=True, capture_output=True, text=True
    ).stdout
    assert "164.312(b) Audit controls" in text and "Account Management" in text
    assert "proofplane evidence verify" in text
    html = (package_dir / "report.html").read_text()
    assert "Claim." in html and "Exceptions." in html


def test_a_changed_artifact_is_named(package_dir: Path, tmp_path: Path) -> None:
    out = _copy(package_dir, tmp_path)
    path = out / "artifacts" / "placement-compliance.json"
    path.write_text(path.read_text().replace('"exceptions": []', '"exceptions": [] '))
    report = evidence.verify_package(out)
    assert not report.ok
    assert any(f.startswith("artifacts/placement-compliance.json: its SHA-256") for f in
               report.failures)  # fmt: skip


def test_a_changed_entry_is_named(package_dir: Path, tmp_path: Path) -> None:
    out = _copy(package_dir, tmp_path)
    path = out / "verification-bundle.json"
    bundle = json.loads(path.read_text())
    victim = bundle["entries"][3]
    entry = json.loads(base64.b64decode(victim["entry"]))
    entry["actor"] = "someone-else"
    victim["entry"] = base64.b64encode(json.dumps(entry).encode()).decode()
    path.write_text(json.dumps(bundle))
    report = evidence.verify_package(out)
    assert not report.ok
    assert (
        f"verification-bundle.json: entry {victim['index']}: the leaf hash does not match"
        " the entry" in report.failures
    )


def test_a_rewritten_manifest_and_an_extra_file_are_named(package_dir, tmp_path) -> None:
    out = _copy(package_dir, tmp_path)
    (out / "artifacts" / "accounts.json").write_text('{"accounts": []}\n')
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["artifacts/accounts.json"]["sha256"] = hashlib.sha256(
        b'{"accounts": []}\n'
    ).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "artifacts" / "extra.json").write_text("{}")
    report = evidence.verify_package(out)
    assert not report.ok
    assert any("manifest.json: no evidence.package entry" in f for f in report.failures)
    assert "artifacts/extra.json: not listed in the manifest" in report.failures


def test_a_pinned_key_that_is_not_the_logs_fails(package_dir: Path) -> None:
    report = evidence.verify_package(package_dir, "proofplane/default+00000000+AQ" + "A" * 42)
    assert not report.ok
    assert "verification-bundle.json: the bundle is signed by a key you do not trust" in (
        report.failures
    )


def test_not_a_package_is_malformed(tmp_path: Path) -> None:
    with pytest.raises(evidence.PackageMalformed):
        evidence.verify_package(tmp_path / "nope")
    with pytest.raises(evidence.PackageMalformed):
        evidence.verify_package(tmp_path)  # no manifest
    (tmp_path / "manifest.json").write_text("[1]")
    with pytest.raises(evidence.PackageMalformed):
        evidence.verify_package(tmp_path)


def test_a_tenant_package(world: World, tmp_path: Path) -> None:
    pkg = _build(world, "gdpr", tenant=HOSPITAL)
    evidence.write_package(pkg, tmp_path / "t")
    assert evidence.verify_package(tmp_path / "t").ok
    placement = json.loads((tmp_path / "t" / "artifacts" / "placement-compliance.json").read_text())
    assert set(placement["data"]["by_tag"]) <= {"hipaa=true", "gdpr-zone=frankfurt"}
    with pytest.raises(ValidationFailed) as refused:
        evidence.write_package(pkg, tmp_path / "t")  # not empty: refused
    assert refused.value.code == "output_not_empty"


def test_bad_input_is_a_clear_error(world: World) -> None:
    now = datetime.now(UTC)
    with pytest.raises(evidence.UnknownFramework) as unknown:
        _build(world, "sox")
    assert unknown.value.code == "unknown_framework" and "hipaa" in unknown.value.message
    with pytest.raises(evidence.EmptyPeriod):
        _build(world, start=now - DAY, end=now - DAY)
    with pytest.raises(evidence.EmptyPeriod):
        _build(world, start=now, end=now - DAY)
    with pytest.raises(evidence.EmptyPeriod) as nothing:  # before anything happened
        _build(world, start=now - 400 * DAY, end=now - 399 * DAY)
    assert "no event was recorded" in nothing.value.message
    with pytest.raises(evidence.FuturePeriod) as future:
        _build(world, start=now + DAY, end=now + 2 * DAY)
    assert future.value.code == "period_in_future"
    with pytest.raises(NotFound):
        _build(world, tenant="no-such-tenant")
    developer = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({HOSPITAL}))
    with pytest.raises(Forbidden):
        _build(world, actor=developer)


def test_a_placement_outside_its_certification_is_an_exception(tmp_path: Path) -> None:
    """The log, not the scheduler's word, decides: a workload.place of a hipaa=true workload
    on a node never certified hipaa=true (written straight into the log here, as a faulty or
    forged component would) is listed with its entry, and the controls that check placement
    say so."""
    world = build_world(tmp_path)
    with world.store.write(SYSTEM) as tx:
        row = tx.record(
            "workload.place",
            "workload",
            "rogue-job",
            details={"node": "use-h100-04", "tags": {"hipaa": "true"}, "tenant": HOSPITAL},
        )
    index = row.seq - 1
    pkg = _build(world, "hipaa")
    placement = json.loads(pkg.files["artifacts/placement-compliance.json"])
    assert placement["exceptions"] == [
        f"entry {index}: {HOSPITAL}/rogue-job placed on use-h100-04: use-h100-04 was not "
        "certified hipaa=true"
    ]
    assert placement["data"]["exceptions_total"] == 1
    assert index in [c["index"] for c in placement["cited_entries"]]  # cited, so provable
    controls = json.loads(pkg.files["controls.json"])["controls"]
    assert any(c["nist"] == "ac-4" and c["status"] == "exceptions" for c in controls)
    assert b"rogue-job" in pkg.files["report.html"]


def test_a_package_on_each_store(demo, tmp_path: Path) -> None:
    """The same package from SQLite and from PostgreSQL (the queries extract detail fields in
    the database: JSON paths differ by dialect); the demo here is loaded, not attested, so
    every tagged placement is an exception (no node passed attestation)."""
    from proofplane.config import Settings
    from proofplane.service import audit as audit_svc

    keys = audit_svc.AuditKeys(origin=audit_svc.origin_for(Settings().cluster_id))
    now = datetime.now(UTC)
    audit_svc.sign_checkpoint(demo, SYSTEM, keys, now)
    pkg = evidence.build_package(
        demo, SYSTEM, keys, framework="pci-dss", start=now - DAY, end=datetime.now(UTC),
        tenant=None, now=datetime.now(UTC), session_ttl=timedelta(hours=1), catalog=CATALOG,
    )  # fmt: skip
    evidence.write_package(pkg, tmp_path / "p")
    assert evidence.verify_package(tmp_path / "p").ok
    placement = json.loads(pkg.files["artifacts/placement-compliance.json"])
    data = placement["data"]
    assert (
        data["placements_checked"] >= 5 and data["exceptions_total"] == data["placements_checked"]
    )
    assert "had not passed its latest attestation" in placement["exceptions"][0]
    assert "hipaa=true" in data["by_tag"]
