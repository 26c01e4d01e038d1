"""Check an evidence package offline: no server, no database, only its directory (and,
ideally, the verifier key the auditor holds, to pin).

1. every file the manifest lists is there, with its SHA-256 (a changed artifact is named);
   no other file is (besides the manifest and the bundle);
2. the verification bundle verifies: the checkpoint's signature, then each entry's leaf hash
   and inclusion proof (a changed entry is named by its index);
3. the bundle proves an ``evidence.package`` entry recording this manifest's SHA-256;
4. every entry an artifact cites is in the bundle with the leaf hash the artifact states.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proofplane.audit import bundle as bundle_mod
from proofplane.errors import ValidationFailed
from proofplane.service.evidence.package import BUNDLE, FORMAT, MANIFEST


class PackageMalformed(ValidationFailed):
    code = "package_malformed"


@dataclass
class PackageReport:
    ok: bool
    package: str = ""
    framework: str = ""
    files: int = 0
    entries: int = 0
    tree_size: int = 0
    origin: str = ""
    failures: list[str] = field(default_factory=list)


def _load(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise PackageMalformed(f"{what} is missing: {path}") from None
    except (OSError, ValueError) as exc:
        raise PackageMalformed(f"{what} cannot be read: {exc}") from None


def verify_package(directory: Path, trusted_key: str | None = None) -> PackageReport:
    if not directory.is_dir():
        raise PackageMalformed(f"{directory} is not a directory")
    manifest_path = directory / MANIFEST
    manifest = _load(manifest_path, "the manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PackageMalformed(f"{MANIFEST} is not a {FORMAT} manifest")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise PackageMalformed(f"{MANIFEST} has no file list")
    report = PackageReport(True, str(manifest.get("package")), str(manifest.get("framework")))
    report.files = len(listed)
    for rel, meta in sorted(listed.items()):
        target = directory / rel
        if not target.is_file():
            report.failures.append(f"{rel}: listed in the manifest but missing")
        elif hashlib.sha256(target.read_bytes()).hexdigest() != meta.get("sha256"):
            report.failures.append(
                f"{rel}: its SHA-256 does not match the manifest (changed after the package "
                "was made)"
            )
    for extra in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = extra.relative_to(directory).as_posix()
        if rel not in listed and rel not in (MANIFEST, BUNDLE):
            report.failures.append(f"{rel}: not listed in the manifest")
    raw = (directory / BUNDLE).read_bytes() if (directory / BUNDLE).is_file() else None
    if raw is None:
        report.failures.append(f"{BUNDLE}: missing")
        report.ok = False
        return report
    try:
        checked = bundle_mod.verify(raw, trusted_key)
        bundle = bundle_mod.parse(raw)
    except bundle_mod.BundleError as exc:
        raise PackageMalformed(f"{BUNDLE}: {exc}") from None
    report.failures += [f"{BUNDLE}: {x}" for x in checked.failures]
    report.entries, report.tree_size, report.origin = (
        checked.entries, checked.tree_size, checked.origin,
    )  # fmt: skip
    proven: dict[int, str] = {}
    recorded = False
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    for item in bundle["entries"]:
        try:
            index = int(item["index"])
            entry = json.loads(base64.b64decode(item["entry"]))
        except (KeyError, TypeError, ValueError):
            continue  # bundle_mod.verify has named it
        proven[index] = str(item.get("leaf_hash"))
        if (
            entry.get("action") == "evidence.package"
            and entry.get("target_id") == manifest.get("package")
            and (entry.get("details") or {}).get("manifest_sha256") == digest
        ):
            recorded = True
    if not recorded:
        report.failures.append(
            f"{MANIFEST}: no evidence.package entry in the bundle records this manifest's "
            f"SHA-256 ({digest[:16]}…): the manifest is not the one the log recorded"
        )
    for rel in sorted(r for r in listed if r.startswith("artifacts/")):
        target = directory / rel
        if not target.is_file():
            continue
        try:
            cites = json.loads(target.read_bytes()).get("cited_entries", [])
        except ValueError:
            report.failures.append(f"{rel}: not JSON")
            continue
        for c in cites:
            index = c.get("index")
            if proven.get(index) != c.get("leaf_hash"):
                report.failures.append(
                    f"{rel}: cites entry {index}, which the bundle does not prove with that "
                    "leaf hash"
                )
    report.ok = not report.failures
    return report
