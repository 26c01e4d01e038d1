"""Attestation core (pure): TPM 2.0 quotes, TCG event logs, policies, verdicts.

Values in, values out: no database, no network, no clock (callers pass ``now``). The service
layer issues nonces, loads the bound AK and the previous clock, calls :func:`verify`, and stores
the :class:`EvidenceRecord` with the verdict.
"""

from proofplane.attest.errors import (
    AttestError,
    CertificateError,
    EventLogError,
    ParseError,
    TpmStructError,
)
from proofplane.attest.eventlog import Event, EventLog, parse_eventlog, replay
from proofplane.attest.facts import LogFacts, VerifierCache, analyze_eventlog
from proofplane.attest.policy import Policy, PolicyError, canonical_json
from proofplane.attest.record import EvidenceRecord, load_record, make_record, replay_record
from proofplane.attest.tpm import Attest, ClockInfo, Public, Signature, parse_attest, parse_public
from proofplane.attest.verifier import REASONS, Evidence, Expected, Verdict, evidence_hash, verify

__all__ = [
    "REASONS",
    "Attest",
    "AttestError",
    "CertificateError",
    "ClockInfo",
    "Event",
    "EventLog",
    "EventLogError",
    "Evidence",
    "EvidenceRecord",
    "Expected",
    "ParseError",
    "Policy",
    "PolicyError",
    "Public",
    "Signature",
    "TpmStructError",
    "VerifierCache",
    "LogFacts",
    "analyze_eventlog",
    "Verdict",
    "canonical_json",
    "evidence_hash",
    "load_record",
    "make_record",
    "parse_attest",
    "parse_eventlog",
    "parse_public",
    "replay",
    "replay_record",
    "verify",
]
