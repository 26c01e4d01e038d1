"""The error tree. Every "no" carries a machine-readable code, a human message and details.

One exception tree, as httpx has one: every error proofplane raises on purpose is a
:class:`ProofplaneError`, so a caller that wants "any proofplane failure" catches one class, and
every class has a stable snake_case ``code`` (the API's ``error.code``; the attestation core
calls it ``reason``). Where a class was a ``ValueError`` or ``RuntimeError`` before it joined
the tree it still is one, so no existing ``except`` changes meaning. The errors know nothing of
HTTP: the class → status table lives at the edge, in :mod:`proofplane.api.errors`; the CLI
prints the message and exits non-zero. Raising one of these inside a service function rolls
the whole transaction back, so a refused request leaves neither state nor event behind.

::

    ProofplaneError                bad_request             (this module)
    ├── NotFound                   not_found
    ├── Conflict                   conflict
    ├── InvalidState               invalid_state
    ├── ValidationFailed           validation_failed
    ├── Unavailable                unavailable
    │   access/ and service/access/: who may do what
    ├── Unauthenticated            unauthenticated         access.authz
    ├── Forbidden                  forbidden               access.authz
    ├── AccountLocked              account_locked          service.access
    ├── TooManyAttempts            too_many_attempts       service.access (429, by the login route)
    ├── OidcFailed                 oidc_failed             access.oidc
    │   └── UnknownSigningKey
    ├── OidcUnavailable            oidc_provider_unavailable  access.oidc
    ├── OidcMisconfigured          invalid_setting         access.oidc
    ├── InvalidOidcState           invalid_oidc_state      service.access
    ├── OidcProviderError          oidc_error              service.access
    │   attestation (attest/, pure; turned into verdict reasons by the verifier)
    ├── AttestError                attest_error            attest.errors
    │   ├── ParseError             malformed
    │   │   ├── EventLogError      eventlog_malformed
    │   │   └── TpmStructError     tpm_struct_malformed
    │   ├── CertificateError       ek_cert_invalid
    │   ├── CredentialError        credential_error        attest.credential
    │   └── PolicyError            policy_invalid          attest.policy
    │   the audit log (audit/ pure, store/ and service/ around it)
    ├── NoteError                  note_invalid            audit.note        (also ValueError)
    ├── BundleError                bundle_malformed        audit.bundle      (also ValueError)
    ├── LogCorrupted               audit_log_inconsistent  store.audit_log
    ├── ProofRangeError            proof_range_invalid     store.audit_log   (also ValueError)
    ├── Unverifiable               unverifiable            store.audit_verify
    ├── ProofOutOfRange            proof_out_of_range      service.audit
    │   SIEM export
    ├── DeliveryError              delivery_error          siem.transport
    ├── DestinationRefused         forbidden_sink_destination  siem.guard
    ├── Unresolvable               unresolvable_sink_host  siem.guard
    ├── DeliveryFailed             delivery_failed         service.sinks
    │   network segmentation (network/, pure)
    ├── SegmentPoolExhausted       segment_pool_exhausted  network.segments  (a Conflict)
    ├── SegmentInUse               segment_in_use          network.segments  (a Conflict)
    ├── SubnetExhausted            subnet_exhausted        network.desired   (a Conflict)
    ├── InvalidSegment             invalid_segment         network.segments  (a ValidationFailed)
    ├── InvalidNetworkPolicy       invalid_network_policy  network.policy    (a ValidationFailed)
    ├── UnknownTenant              unknown_tenant          network.policy    (a ValidationFailed)
    ├── CrossTenantRule            cross_tenant_rule       network.policy    (403)
    ├── PartitionsSyntaxError      invalid_partitions      network.render.partitions
    │                                                      (a ValidationFailed, also ValueError)
    │   hardware and the node agent's tools
    ├── NvmlError                  nvml_error              hardware.nvml
    │   └── NvmlUnavailable        nvml_unavailable
    ├── TpmToolError               tpm_tool_failed         agent.tpm.tpm2tools (also RuntimeError)
    │   trace replay
    ├── TraceError                 trace_invalid           sim.trace         (also ValueError)
    ├── MigSimError                mig_sim_invalid         sim.mig           (also ValueError)
    │   execution engines
    └── BackendError               backend_error           backends.base
        ├── BackendUnavailable     backend_unavailable
        ├── JobRejected            job_rejected
        └── DrainFailed            drain_failed

A ``code`` given to the constructor overrides the class's for that one error (``NotFound(…,
code="node_not_found")``); programs match the code, humans read the message.
"""

from __future__ import annotations

from typing import Any


class ProofplaneError(Exception):
    """Base class: ``code`` is for programs, ``message`` for humans, ``details`` for both."""

    code: str = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


class NotFound(ProofplaneError):
    code = "not_found"


class Conflict(ProofplaneError):
    """The object already exists, or a uniqueness rule would break."""

    code = "conflict"


class InvalidState(ProofplaneError):
    """The object exists but its current state does not allow the operation."""

    code = "invalid_state"


class ValidationFailed(ProofplaneError):
    """The input is well-formed but breaks a rule (unknown SKU, bad tag, impossible request)."""

    code = "validation_failed"


class Unavailable(ProofplaneError):
    """A dependency (the database) cannot be reached right now."""

    code = "unavailable"
