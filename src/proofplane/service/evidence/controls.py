"""The evidence package's control map: ``data/evidence/controls.yaml`` (data, not code), with
each NIST SP 800-53 rev5 control's title read from NIST's OSCAL catalog."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from proofplane.errors import NotFound, ValidationFailed

FRAMEWORKS = ("hipaa", "pci-dss", "iso27001", "nist-800-53", "soc2", "gdpr")
CATALOG_FILE = "NIST_SP-800-53_rev5_catalog.json"
CATALOG_ENV = "PROOFPLANE_OSCAL_CATALOG"


class UnknownFramework(ValidationFailed):
    code = "unknown_framework"


@dataclass(frozen=True, slots=True)
class Requirement:
    id: str
    title: str


@dataclass(frozen=True, slots=True)
class Control:
    nist: str  # the OSCAL control id (ac-2)
    nist_title: str
    requirements: tuple[Requirement, ...]  # of the framework asked for
    claim: str
    evidence: tuple[str, ...]
    checks: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.nist.upper()


def map_text() -> str:
    """The control map as shipped (what the package carries as ``control-map.yaml``)."""
    return (resources.files("proofplane") / "data" / "evidence" / "controls.yaml").read_text()


def check_framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise UnknownFramework(
            f"unknown framework {framework!r}: one of {', '.join(FRAMEWORKS)}",
            details={"framework": framework, "known": list(FRAMEWORKS)},
        )
    return framework


def catalog_path() -> Path | None:
    """Where NIST's OSCAL catalog is: ``PROOFPLANE_OSCAL_CATALOG``, else the shared data
    beside the checkout (``../shared/data/oscal/``), else None."""
    given = os.environ.get(CATALOG_ENV)
    if given:
        return Path(given)
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        candidate = base.parent / "shared" / "data" / "oscal" / CATALOG_FILE
        if candidate.is_file():
            return candidate
    return None


@cache
def _titles(path: str) -> dict[str, str]:
    data = json.loads(Path(path).read_text("utf-8"))
    out: dict[str, str] = {}

    def walk(controls: list[dict[str, Any]]) -> None:
        for c in controls:
            out[c["id"]] = c["title"]
            walk(c.get("controls", []))

    for group in data["catalog"].get("groups", []):
        walk(group.get("controls", []))
    return out


def nist_titles(path: Path | None = None) -> tuple[dict[str, str], str]:
    """Control id -> title from the OSCAL catalog, and where it came from."""
    path = path or catalog_path()
    if path is None or not path.is_file():
        raise NotFound(
            f"NIST's OSCAL catalog ({CATALOG_FILE}) was not found: set {CATALOG_ENV}",
            code="oscal_catalog_missing",
        )
    try:
        return _titles(str(path)), str(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValidationFailed(
            f"{path} is not an OSCAL catalog: {exc}", code="oscal_catalog_invalid"
        ) from None


def controls_for(framework: str, catalog: Path | None = None) -> tuple[list[Control], str]:
    """The controls that map to ``framework`` (all of them for nist-800-53), titled from the
    catalog; and the catalog's path."""
    check_framework(framework)
    data = yaml.safe_load(map_text())
    titles, source = nist_titles(catalog)
    out = []
    for c in data["controls"]:
        nist = c["nist"]
        if nist not in titles:
            raise ValidationFailed(
                f"control map: {nist} is not in the OSCAL catalog", code="control_map_invalid"
            )
        if framework == "nist-800-53":
            reqs: tuple[Requirement, ...] = (Requirement(nist.upper(), titles[nist]),)
        else:
            reqs = tuple(
                Requirement(str(r["id"]), r["title"]) for r in c["maps"].get(framework, [])
            )
            if not reqs:
                continue
        out.append(
            Control(
                nist,
                titles[nist],
                reqs,
                c["claim"],
                tuple(c["evidence"]),
                tuple(c.get("checks", ())),
            )  # fmt: skip
        )
    return out, source


def framework_name(framework: str) -> str:
    data = yaml.safe_load(map_text())
    return str(data["frameworks"][check_framework(framework)]["name"])
