"""Every error the API returns has one shape: {"error": {"code", "message", "details"}}.

The HTTP status of a domain error is decided here, at the edge, not by the error: ``STATUS``
maps classes of the :class:`~proofplane.errors.ProofplaneError` tree to statuses, resolved
along the class's MRO (a subclass answers with its nearest listed ancestor's status; the root
answers 400). ``NOT_ANSWERS`` are the tree's branches that no route gives out as they are (the
pure core's and the I/O tools' own failures, which a service turns into a verdict or into one
of the errors above): one that reaches the API is a bug and is handled as any unexpected
exception is (500 ``internal_error``, the details in the server log).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proofplane.access.authz import Forbidden, Unauthenticated
from proofplane.access.oidc import OidcFailed, OidcMisconfigured, OidcUnavailable
from proofplane.agent.tpm.tpm2tools import TpmToolError
from proofplane.api.request_body import too_deep
from proofplane.attest.errors import AttestError
from proofplane.audit.bundle import BundleError
from proofplane.audit.note import NoteError
from proofplane.backends.base import BackendError, BackendUnavailable, DrainFailed, JobRejected
from proofplane.errors import (
    Conflict,
    InvalidState,
    NotFound,
    ProofplaneError,
    Unavailable,
    ValidationFailed,
)
from proofplane.govern.changes import NotAnApprover, SeparationOfDuties
from proofplane.hardware.nvml import NvmlError
from proofplane.network.desired import SubnetExhausted
from proofplane.network.policy import CrossTenantRule, InvalidNetworkPolicy, UnknownTenant
from proofplane.network.segments import InvalidSegment, SegmentInUse, SegmentPoolExhausted
from proofplane.service.access import (
    AccountLocked,
    InvalidOidcState,
    OidcProviderError,
    TooManyAttempts,
)
from proofplane.service.audit import ProofOutOfRange
from proofplane.service.sinks import DeliveryFailed
from proofplane.siem.transport import DeliveryError
from proofplane.sim.mig import MigSimError
from proofplane.sim.trace import TraceError
from proofplane.store.audit_log import LogCorrupted, ProofRangeError
from proofplane.store.audit_verify import Unverifiable

log = logging.getLogger("proofplane.api")

#: The HTTP status of each answered error class (subclasses inherit along their MRO).
STATUS: dict[type[ProofplaneError], int] = {
    ProofplaneError: 400,
    NotFound: 404,
    Conflict: 409,
    InvalidState: 409,
    ValidationFailed: 422,
    Unavailable: 503,
    # access
    Unauthenticated: 401,
    Forbidden: 403,
    SeparationOfDuties: 403,
    NotAnApprover: 403,
    AccountLocked: 423,
    TooManyAttempts: 429,  # (the login route adds Retry-After)
    OidcFailed: 401,
    OidcUnavailable: 502,
    OidcMisconfigured: 500,
    InvalidOidcState: 400,
    OidcProviderError: 400,
    # audit log and SIEM
    ProofOutOfRange: 400,
    LogCorrupted: 500,
    DeliveryFailed: 502,
    # execution engines
    BackendError: 502,
    BackendUnavailable: 503,
    JobRejected: 422,
    DrainFailed: 502,
    # network segmentation
    SegmentPoolExhausted: 409,
    SegmentInUse: 409,
    SubnetExhausted: 409,
    InvalidSegment: 422,
    InvalidNetworkPolicy: 422,
    UnknownTenant: 422,
    CrossTenantRule: 403,
}

#: Branches of the tree that are never an answer (see the module docstring): 500.
NOT_ANSWERS: tuple[type[ProofplaneError], ...] = (
    AttestError,
    NoteError,
    BundleError,
    ProofRangeError,
    Unverifiable,
    DeliveryError,
    NvmlError,
    TpmToolError,
    TraceError,
    MigSimError,
)


def is_answer(error: ProofplaneError | type[ProofplaneError]) -> bool:
    """Whether a route may give this error out: its nearest ancestor in ``STATUS`` or
    ``NOT_ANSWERS`` decides (a configuration error that is also a delivery failure, say
    ``TlsFilesInvalid(ValidationFailed, DeliveryError)``, answers as the ValidationFailed)."""
    cls = error if isinstance(error, type) else type(error)
    for klass in cls.__mro__:
        if klass in NOT_ANSWERS:
            return False
        if klass in STATUS:
            return True
    return True  # pragma: no cover - ProofplaneError is in STATUS


def status_for(error: ProofplaneError | type[ProofplaneError]) -> int:
    """The HTTP status an error (or an error class) answers with: its nearest ancestor's in
    ``STATUS`` (500 for the ``NOT_ANSWERS``)."""
    cls = error if isinstance(error, type) else type(error)
    if not is_answer(cls):
        return 500
    for klass in cls.__mro__:
        status = STATUS.get(klass)
        if status is not None:
            return status
    return 400  # pragma: no cover - ProofplaneError is in STATUS


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def error_response(status: int, code: str, message: str, details: Any = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"code": code, "message": message, "details": _json_safe(details)}},
    )


def _json_safe(value: Any) -> Any:
    """``details`` as JSON can hold them: an error that echoes the input it refuses (a NaN
    or an infinity in a request body) must not fail to render as a 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _clean(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pydantic's errors, minus what must not be echoed back (``input`` may hold secrets;
    ``ctx`` may hold exception objects that are not JSON)."""
    return [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in errors
    ]


def install(app: FastAPI) -> None:
    @app.exception_handler(ProofplaneError)
    async def _domain(_req: Request, exc: ProofplaneError) -> JSONResponse:
        if not is_answer(exc):
            raise exc  # a bug, not an answer: to the server-error handler below
        status = status_for(exc)
        response = error_response(status, exc.code, exc.message, exc.details)
        if status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="proofplane"'
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _clean(list(exc.errors()))
        if any(e["type"] == "json_invalid" for e in errors):
            return error_response(
                422, "malformed_json", "the request body is not valid JSON", errors
            )
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "request"
        return error_response(422, "validation_failed", f"{where}: {first['msg']}", errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's JSON parse gave up
            return await _domain(_req, too_deep())
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", req.method, req.url.path)
        return error_response(
            500, "internal_error", "internal error; the server log has the details"
        )
