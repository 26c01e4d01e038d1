"""A bound on request bodies (issue 19, §3): more than the limit is 413 ``payload_too_large``.

Without it a 10 MB ``command`` was stored for good in the append-only event log and shipped to
every SIEM. The bytes are counted as they arrive, so neither a missing ``Content-Length``
(chunked transfer) nor a false one gets more through; a declared length over the limit is
refused before anything is read. A route that needs more (a node's evidence, with its event
logs) gets its own limit by endpoint (:func:`route_limits`).

When the body grows past the limit while the application reads it, this middleware answers
413 itself and tells the application that the client went away, so no endpoint runs on a
partial body; whatever the application then tries to answer is dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: (path pattern, methods, limit): a route's own body limit.
RouteLimit = tuple[re.Pattern[str], frozenset[str], int]


def route_limits(
    routes: Iterable[BaseRoute], limits: Mapping[Callable[..., Any], int]
) -> list[RouteLimit]:
    """The path patterns and methods of the routes whose endpoint is a key of ``limits``, each
    with its limit. Every endpoint named must be among ``routes`` (a router's, included in the
    application without a further prefix)."""
    out: list[RouteLimit] = []
    found: set[Callable[..., Any]] = set()
    for route in routes:
        if isinstance(route, Route) and route.endpoint in limits:
            limit = limits[route.endpoint]
            out.append((route.path_regex, frozenset(route.methods or ()), limit))
            found.add(route.endpoint)
    missing = [getattr(e, "__name__", repr(e)) for e in limits if e not in found]
    if missing:
        raise ValueError(f"no route for the body limits of {', '.join(missing)}")
    return out


def too_large(limit: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The 413 answer in the API's error shape: status, headers, body."""
    body = json.dumps(
        {
            "error": {
                "code": "payload_too_large",
                "message": f"the request body is larger than {limit} bytes",
                "details": {"limit": limit},
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return 413, headers, body


class BodyLimit:
    """ASGI middleware: request bodies of at most ``limit`` bytes, or a route's own limit."""

    def __init__(self, app: ASGIApp, limit: int, routes: Sequence[RouteLimit] = ()) -> None:
        self.app = app
        self.limit = limit
        self.routes = tuple(routes)

    def limit_for(self, scope: Scope) -> int:
        """The body limit of the request ``scope``: its route's own, else the default."""
        path, method = scope.get("path", ""), scope.get("method", "")
        for pattern, methods, limit in self.routes:
            if (not methods or method in methods) and pattern.match(path):
                return limit
        return self.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _answer(send, limit)
            return

        received = 0
        answered = False  # this middleware sent the 413
        started = False  # a response has started (ours or the application's)

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # the application's answer to a body it never got in full
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def counted_receive() -> Message:
            nonlocal received, answered, started
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if not started:
                        await _answer(send, limit)
                        answered = started = True
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counted_receive, guarded_send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before this runs
    return None


async def _answer(send: Send, limit: int) -> None:
    status, headers, body = too_large(limit)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
