"""HTTP latency and request counts by route template (issue 15, §3).

A plain ASGI layer between the security headers and the overload limiter, so it sees every
answer, refusals included: the time from the request's arrival to its answer's last byte, and
the status. The route is the template the router matched (``/api/v1/nodes/{name}``), read from
the scope after the request ran: never the raw path, which holds names and would make one series
per node or workload. A request no route matched is ``<unmatched>``; one answered before
routing (overload 429, body too large 413) is ``<refused>``.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proofplane.service.instruments import REFUSED, UNMATCHED, observe_http


class HttpMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the server answers when the application raises before starting

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is None:
                route = UNMATCHED if status in (404, 405) else REFUSED
            observe_http(scope.get("method", "GET"), route, status, time.perf_counter() - started)
