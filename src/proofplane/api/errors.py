"""Every error the API returns has one shape: {"error": {"code", "message", "details"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proofplane.errors import ProofplaneError

log = logging.getLogger("proofplane.api")

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
        content={"error": {"code": code, "message": message, "details": details}},
    )


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
        response = error_response(exc.status, exc.code, exc.message, exc.details)
        if exc.status == 401:
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
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", req.method, req.url.path)
        return error_response(
            500, "internal_error", "internal error; the server log has the details"
        )
