"""Errors of the attestation core: every parse failure names a machine-matchable reason.

They are :class:`~proofplane.errors.ProofplaneError` subclasses whose ``code`` is what the
verifier calls a *reason* (``eventlog_bad_pcr``, ``evidence_malformed``, …): the verifier turns
them into verdict reasons and the attestation service into ``ValidationFailed``; none is an
answer the API gives as it is.
"""

from __future__ import annotations

from typing import Any

from proofplane.errors import ProofplaneError


class AttestError(ProofplaneError):
    """Base class: ``reason`` (= ``code``) is a short code a program can match, the message is
    for humans."""

    code = "attest_error"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        code: str | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(message, code=reason if reason is not None else code, details=details)

    @property
    def reason(self) -> str:
        """The attestation core's word for ``code``."""
        return self.code


class ParseError(AttestError):
    """Bytes that are not the structure they claim to be (truncated, bad tag, bad size, …)."""

    code = "malformed"


class EventLogError(ParseError):
    """A TCG event log that cannot be parsed."""

    code = "eventlog_malformed"


class TpmStructError(ParseError):
    """A TPM 2.0 structure (TPMS_ATTEST, TPMT_SIGNATURE, TPM2B_PUBLIC) that cannot be parsed."""

    code = "tpm_struct_malformed"


class CertificateError(AttestError):
    """An EK certificate that does not chain to the configured CA bundle."""

    code = "ek_cert_invalid"
