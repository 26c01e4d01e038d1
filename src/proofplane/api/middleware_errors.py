"""The last line of defence (issue 19, §2): an exception no handler answers becomes a 500 in
the usual error shape, with a request id, and one log line.

Before, such an exception was answered 500 and then re-raised to the server, which logged its
whole traceback: one 2.4 KB request nested 400 levels deep wrote ~258 KB of log, and anyone
could send it. Now the server log gets exactly one line per failure, naming the exception
class and its message (first line, shortened), the route, the request id and the innermost
frame of proofplane's code that raised it; the client gets the request id in
``details.request_id`` and in the ``X-Request-ID`` header, to quote when reporting it. A missed
case stays visible (a 500, a log line to grep for) but is cheap.

A well-formed ``X-Request-ID`` sent by the client (a proxy's, say: at most 64 letters, digits,
``.``, ``_``, ``-``) is kept, so the line can be matched with the proxy's; otherwise a random
one is made. Only a failure needs one, so nothing is done per request.
"""

from __future__ import annotations

import logging
import re
import secrets
from types import TracebackType

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proofplane.api.errors import error_response

log = logging.getLogger("proofplane.api")

REQUEST_ID_HEADER = "X-Request-ID"
_WELL_FORMED_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_MAX_MESSAGE = 200


def request_id(scope: Scope) -> str:
    """The client's ``X-Request-ID`` when it is well formed, else a new random one."""
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            sent = value.decode("latin-1")
            if _WELL_FORMED_ID.fullmatch(sent):
                return sent
            break
    return secrets.token_hex(8)


# What must never reach a log line even when an exception's message quotes it: proofplane's
# bearer tokens (ppt_…, ppa_…), an Authorization header's credential, a JWT (an ID token).
_SECRET = re.compile(
    r"\b(pp[a-z])_[A-Za-z0-9_-]{16,}"
    r"|(?i:\b(bearer|basic)\s+)[A-Za-z0-9._~+/=-]+"
    r"|\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*"
)


def _redact(match: re.Match[str]) -> str:
    if match.group(1):
        return f"{match.group(1)}_<redacted>"
    if match.group(2):
        return f"{match.group(2)} <redacted>"
    return "<redacted>"


def _one_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = _SECRET.sub(_redact, first)
    if len(first) > _MAX_MESSAGE:
        first = first[:_MAX_MESSAGE] + "…"
    return first.encode("utf-8", "backslashreplace").decode()


def _origin(tb: TracebackType | None) -> str:
    """file:line in function of the innermost frame in proofplane's code (else the innermost
    frame at all): where to look, without the traceback."""
    ours = last = None
    while tb is not None:
        last = tb
        if "proofplane" in tb.tb_frame.f_code.co_filename:
            ours = tb
        tb = tb.tb_next
    frame = ours or last
    if frame is None:
        return "?"
    code = frame.tb_frame.f_code
    path = code.co_filename
    short = path[path.rfind("proofplane") :] if "proofplane" in path else path.rsplit("/", 1)[-1]
    return f"{short}:{frame.tb_lineno} in {code.co_name}"


def route_of(scope: Scope) -> str:
    """The route's path template when the request matched one, else the path."""
    route = scope.get("route")
    path = getattr(route, "path", None) or scope.get("path", "?")
    return f"{scope.get('method', '?')} {_one_line(str(path))}"


def log_unexpected(exc: BaseException, scope: Scope, rid: str) -> None:
    log.error(
        "unhandled %s: %s; %s; request id %s; at %s",
        type(exc).__qualname__,
        _one_line(str(exc)),
        route_of(scope),
        rid,
        _origin(exc.__traceback__),
    )


class ServerErrors:
    """ASGI middleware: any exception from the application → a 500 ``internal_error`` with a
    request id, and one log line (:func:`log_unexpected`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            rid = request_id(scope)
            log_unexpected(exc, scope, rid)
            if started:  # the answer is under way: nothing more can be said on it
                return
            response = error_response(
                500,
                "internal_error",
                "internal error; the server log has the details",
                {"request_id": rid},
            )
            response.headers[REQUEST_ID_HEADER] = rid
            await response(scope, receive, send)
