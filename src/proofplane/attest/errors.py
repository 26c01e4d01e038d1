"""Errors of the attestation core: every parse failure names a machine-matchable reason."""

from __future__ import annotations


class AttestError(Exception):
    """Base class: ``reason`` is a short code a program can match, the message is for humans."""

    reason: str = "attest_error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.reason


class ParseError(AttestError):
    """Bytes that are not the structure they claim to be (truncated, bad tag, bad size, …)."""

    reason = "malformed"


class EventLogError(ParseError):
    """A TCG event log that cannot be parsed."""

    reason = "eventlog_malformed"


class TpmStructError(ParseError):
    """A TPM 2.0 structure (TPMS_ATTEST, TPMT_SIGNATURE, TPM2B_PUBLIC) that cannot be parsed."""

    reason = "tpm_struct_malformed"


class CertificateError(AttestError):
    """An EK certificate that does not chain to the configured CA bundle."""

    reason = "ek_cert_invalid"
