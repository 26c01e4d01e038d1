"""Stored evidence records: one JSON document an auditor can re-verify offline.

A record holds the evidence, what the server expected, the policy, the time of the original
verification and the verdict reached then. :func:`replay_record` re-runs the pure verifier with
the recorded time as ``now``, so a record verifies the same way years later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proofplane.attest.errors import AttestError
from proofplane.attest.evidence import Evidence, Expected, Verdict, parse_time
from proofplane.attest.facts import VerifierCache
from proofplane.attest.policy import Policy
from proofplane.attest.verifier import verify

RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class EvidenceRecord:
    node: str
    evidence: Evidence
    expected: Expected
    policy: Policy
    verified_at: datetime
    verdict: Mapping[str, Any] | None = None  # the verdict as recorded, if any

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "node": self.node,
            "evidence": self.evidence.to_json(),
            "expected": self.expected.to_json(),
            "policy": self.policy.to_json(),
            "verified_at": self.verified_at.isoformat(),
            "verdict": None if self.verdict is None else dict(self.verdict),
        }

    @classmethod
    def from_json(cls, data: Any) -> EvidenceRecord:
        if not isinstance(data, Mapping):
            raise AttestError("an evidence record is a JSON object", reason="record_invalid")
        if data.get("version") != RECORD_VERSION:
            raise AttestError(
                f"unsupported record version {data.get('version')!r}", reason="record_invalid"
            )
        for key in ("evidence", "expected", "policy", "verified_at"):
            if key not in data:
                raise AttestError(f"the record has no {key!r}", reason="record_invalid")
        verdict = data.get("verdict")
        return cls(
            node=str(data.get("node", "")),
            evidence=Evidence.from_json(data["evidence"]),
            expected=Expected.from_json(data["expected"]),
            policy=Policy.from_json(data["policy"]),
            verified_at=parse_time(data["verified_at"], "verified_at"),
            verdict=verdict if isinstance(verdict, Mapping) else None,
        )


def make_record(
    node: str,
    evidence: Evidence,
    expected: Expected,
    policy: Policy,
    now: datetime,
    *,
    cache: VerifierCache | None = None,
) -> tuple[EvidenceRecord, Verdict]:
    """Verify and wrap the result in a record (what the service stores for each attempt).
    ``cache``: as for :func:`~proofplane.attest.verifier.verify` (the same verdict)."""
    verdict = verify(evidence, expected, policy, now, cache=cache)
    return EvidenceRecord(node, evidence, expected, policy, now, verdict.to_json()), verdict


def load_record(text: str | bytes) -> EvidenceRecord:
    """Parse a record from JSON text; AttestError(reason='record_invalid') when it is not one."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AttestError(f"not JSON: {exc}", reason="record_invalid") from None
    return EvidenceRecord.from_json(data)


def replay_record(record: EvidenceRecord) -> Verdict:
    """Re-verify a record as of its recorded verification time."""
    return verify(record.evidence, record.expected, record.policy, record.verified_at)
