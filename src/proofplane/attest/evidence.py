"""Attestation values and their JSON codecs: what a node sends (:class:`Evidence`), what the
server expects (:class:`Expected`), what the verifier concludes (:class:`Verdict`), and the
hash that commits to one round (:func:`evidence_hash`).

Decoding never trusts its input: a missing field, a bad base64/hex string or a time without a
zone raises :class:`~proofplane.attest.errors.AttestError` with the reason
``evidence_malformed`` (``verified_at`` of a record included). The checks themselves live in
:mod:`proofplane.attest.verifier`.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proofplane.attest import tpm
from proofplane.attest.errors import AttestError
from proofplane.attest.policy import canonical_json


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise AttestError(f"{what} must be a base64 string", reason="evidence_malformed")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise AttestError(f"{what} is not valid base64", reason="evidence_malformed") from None


def _unhex(text: Any, what: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except (TypeError, ValueError):
        raise AttestError(f"{what} is not hex", reason="evidence_malformed") from None


def _iso(dt: datetime) -> str:
    return dt.isoformat()


def parse_time(text: Any, what: str) -> datetime:
    try:
        dt = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise AttestError(f"{what} is not an ISO 8601 time", reason="evidence_malformed") from None
    if dt.tzinfo is None:
        raise AttestError(f"{what} must carry a time zone", reason="evidence_malformed")
    return dt


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a node sends for one attestation round."""

    quote: bytes  # TPMS_ATTEST, exactly the bytes the AK signed
    signature: bytes  # TPMT_SIGNATURE
    pcrs: Mapping[str, Mapping[int, bytes]]  # bank → PCR index → value
    eventlog: bytes | None = None
    inventory: Mapping[str, Any] | None = None

    def to_json(self, *, include_eventlog: bool = True) -> dict[str, Any]:
        return {
            "quote": _b64(self.quote),
            "signature": _b64(self.signature),
            "pcrs": {
                b: {str(i): v.hex() for i, v in sorted(p.items())}
                for b, p in sorted(self.pcrs.items())
            },
            "eventlog": _b64(self.eventlog) if include_eventlog else None,
            "inventory": None if self.inventory is None else dict(self.inventory),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Evidence:
        if not isinstance(data, Mapping):
            raise AttestError("evidence must be a JSON object", reason="evidence_malformed")
        pcrs_in = data.get("pcrs")
        if not isinstance(pcrs_in, Mapping):
            raise AttestError("evidence.pcrs must be an object", reason="evidence_malformed")
        pcrs: dict[str, dict[int, bytes]] = {}
        for bank, values in pcrs_in.items():
            if not isinstance(values, Mapping):
                raise AttestError(
                    f"evidence.pcrs.{bank} must be an object", reason="evidence_malformed"
                )
            try:
                pcrs[str(bank)] = {int(i): _unhex(v, f"PCR {bank}:{i}") for i, v in values.items()}
            except ValueError:
                raise AttestError(
                    "PCR indexes must be integers", reason="evidence_malformed"
                ) from None
        inv = data.get("inventory")
        if inv is not None and not isinstance(inv, Mapping):
            raise AttestError("evidence.inventory must be an object", reason="evidence_malformed")
        log = data.get("eventlog")
        return cls(
            quote=_unb64(data.get("quote"), "evidence.quote"),
            signature=_unb64(data.get("signature"), "evidence.signature"),
            pcrs=pcrs,
            eventlog=None if log is None else _unb64(log, "evidence.eventlog"),
            inventory=inv,
        )


@dataclass(frozen=True, slots=True)
class Expected:
    """What the server knows before it sees the evidence: the nonce it issued (and when), the AK
    bound at enrollment, optionally the EK, and the last accepted quote's clock."""

    nonce: bytes
    nonce_issued_at: datetime
    ak_public: bytes  # TPM2B_PUBLIC / TPMT_PUBLIC of the bound AK
    ek_public: bytes | None = None
    previous_clock: tpm.ClockInfo | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce.hex(),
            "nonce_issued_at": _iso(self.nonce_issued_at),
            "ak_public": _b64(self.ak_public),
            "ek_public": _b64(self.ek_public),
            "previous_clock": None
            if self.previous_clock is None
            else self.previous_clock.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Expected:
        if not isinstance(data, Mapping):
            raise AttestError("expected must be a JSON object", reason="evidence_malformed")
        prev = data.get("previous_clock")
        ek = data.get("ek_public")
        try:
            clock = None if prev is None else tpm.ClockInfo.from_json(prev)
        except (KeyError, TypeError, ValueError):
            raise AttestError(
                "expected.previous_clock is malformed", reason="evidence_malformed"
            ) from None
        return cls(
            nonce=_unhex(data.get("nonce"), "expected.nonce"),
            nonce_issued_at=parse_time(data.get("nonce_issued_at"), "expected.nonce_issued_at"),
            ak_public=_unb64(data.get("ak_public"), "expected.ak_public"),
            ek_public=None if ek is None else _unb64(ek, "expected.ek_public"),
            previous_clock=clock,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome: ``ok`` only when ``reasons`` is empty. ``messages`` explains each reason;
    ``details`` carries what was observed (clock, secure boot state, rebooted, …)."""

    ok: bool
    reasons: tuple[str, ...]
    messages: Mapping[str, str]
    details: Mapping[str, Any]
    evidence_hash: str
    policy_id: str
    policy_hash: str
    clock: tpm.ClockInfo | None = None  # the quote's clock, once its signature verified

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reasons": list(self.reasons),
            "messages": dict(self.messages),
            "details": dict(self.details),
            "evidence_hash": self.evidence_hash,
            "policy_id": self.policy_id,
            "policy_hash": self.policy_hash,
            "clock": None if self.clock is None else self.clock.to_json(),
        }


def evidence_hash(
    evidence: Evidence, expected: Expected, eventlog_sha256: str | None = None
) -> str:
    """SHA-256 (hex) of the canonical JSON of evidence and expectation together.

    The document is ``{"evidence": …, "expected": …}`` as ``to_json`` writes them, except that the
    event log (tens of KiB) enters by its digest: ``"eventlog": null`` and
    ``"eventlog_sha256": "<hex>"`` (null without a log). An auditor recomputes it from a stored
    record with :func:`evidence_hash` or by hand.
    """
    ev = evidence.to_json(include_eventlog=False)
    if eventlog_sha256 is None and evidence.eventlog is not None:
        eventlog_sha256 = hashlib.sha256(evidence.eventlog).hexdigest()
    ev["eventlog_sha256"] = eventlog_sha256
    doc = {"evidence": ev, "expected": expected.to_json()}
    return hashlib.sha256(canonical_json(doc)).hexdigest()
