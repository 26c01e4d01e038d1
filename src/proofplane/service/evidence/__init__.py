"""The auditor's evidence package (issue 16): a control map per framework, evidence from the
live record, a report (HTML and PDF), and a verification bundle that proves every cited
audit entry into a signed checkpoint; ``verify_package`` re-checks it all offline."""

from proofplane.service.evidence.controls import FRAMEWORKS, UnknownFramework, controls_for
from proofplane.service.evidence.package import (
    EmptyPeriod,
    FuturePeriod,
    Package,
    build_package,
    check_period,
    write_package,
)
from proofplane.service.evidence.verify import PackageMalformed, PackageReport, verify_package

__all__ = [
    "FRAMEWORKS",
    "EmptyPeriod",
    "FuturePeriod",
    "Package",
    "PackageMalformed",
    "PackageReport",
    "UnknownFramework",
    "build_package",
    "check_period",
    "controls_for",
    "verify_package",
    "write_package",
]
