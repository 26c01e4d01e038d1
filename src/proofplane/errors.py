"""The error hierarchy. Every "no" carries a machine-readable code, a human message and details.

The API maps each class to one HTTP status; the CLI prints the message and exits non-zero.
Raising one of these inside a service function rolls the whole transaction back, so a refused
request leaves neither state nor event behind.
"""

from __future__ import annotations

from typing import Any


class ProofplaneError(Exception):
    """Base class: ``code`` is for programs, ``message`` for humans, ``details`` for both."""

    status: int = 400
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
    status = 404
    code = "not_found"


class Conflict(ProofplaneError):
    """The object already exists, or a uniqueness rule would break."""

    status = 409
    code = "conflict"


class InvalidState(ProofplaneError):
    """The object exists but its current state does not allow the operation."""

    status = 409
    code = "invalid_state"


class ValidationFailed(ProofplaneError):
    """The input is well-formed but breaks a rule (unknown SKU, bad tag, impossible request)."""

    status = 422
    code = "validation_failed"


class Unavailable(ProofplaneError):
    """A dependency (the database) cannot be reached right now."""

    status = 503
    code = "unavailable"
