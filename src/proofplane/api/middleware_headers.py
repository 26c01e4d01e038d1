"""Security headers on every response (issue 19, §6), errors and 404s included.

The API answers JSON, so the policy is the strictest that still lets a console served from the
same origin work: its own scripts, styles, images and API calls only, no inline script, no
plugins, never framed. ``Strict-Transport-Security`` is sent only on requests that arrived over
TLS (``scope["scheme"] == "https"``: uvicorn serving TLS itself, or a trusted proxy's
``X-Forwarded-Proto`` with ``--proxy-headers``): over plain HTTP a browser ignores it anyway.
A header the route set itself is left as it is.

``/docs`` (Swagger UI, only with ``PROOFPLANE_API_DOCS=1``, for development) loads its script
and styles from jsDelivr and starts with an inline script; its page alone gets
:data:`DOCS_CONTENT_SECURITY_POLICY`, which allows exactly that.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
DOCS_CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'self' https://cdn.jsdelivr.net; img-src 'self' data: https://fastapi.tiangolo.com; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
HSTS = "max-age=31536000; includeSubDomains"

HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


class SecurityHeaders:
    """ASGI middleware adding :data:`HEADERS` (and HSTS over TLS) to every HTTP response."""

    def __init__(self, app: ASGIApp, csp_overrides: Mapping[str, str] | None = None) -> None:
        self.app = app
        self.csp_overrides = {
            path: (b"content-security-policy", csp.encode())
            for path, csp in (csp_overrides or {}).items()
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = HEADERS
        override = self.csp_overrides.get(scope.get("path", ""))
        if override is not None:
            extra = tuple(h for h in HEADERS if h[0] != override[0]) + (override,)
        if scope.get("scheme") == "https":
            extra = (*HEADERS, (b"strict-transport-security", HSTS.encode()))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                headers.extend((n, v) for n, v in extra if n not in present)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)
