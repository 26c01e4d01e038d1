"""Route lookup by path prefix: a request is matched only against the routes that can match it.

FastAPI (0.165) matches a request by walking the application's routes in order; every included
router (one per ``routes_*`` module, 16 of them) walks its own routes in turn, so every request
tried about 150 route patterns, and profiling the governance benchmark (issue 12) showed that
walk as ~15 % of the server's CPU. This index keeps FastAPI's own matching but narrows the list
it walks: for the first :data:`DEPTH` segments of the request path it keeps, in their order,
only the top-level routes that have some path whose literal beginning agrees with them (an
included router has as many paths as routes). A route's literal beginning is the segments
before its first ``{parameter}``; a route whose paths cannot be read (a ``Host``, an unknown
kind, a router with low-priority routes) is kept for every path.

Why the answer cannot change: a route left out cannot match the path at all (neither fully nor
by method alone), so the first full match, the first partial match (405), the trailing-slash
redirect (a slash does not change the segments) and the 404 are those of the whole list. The
narrowed list is a shallow copy of the application's router with its ``routes`` replaced, run
by FastAPI's own ``APIRouter.app``; ``scope["router"]`` stays the whole router, so
``url_for`` sees every route. Lists are cached per prefix, at most :data:`CACHE` of them (more
distinct prefixes than that are computed per request, not stored); routes added to the
application after :func:`install` rebuild the index.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from starlette.routing import BaseRoute, Router
from starlette.types import ASGIApp, Receive, Scope, Send

DEPTH = 3
CACHE = 1024

Prefix = tuple[str, ...]


def literal_prefix(path: str, depth: int = DEPTH) -> Prefix:
    """The whole literal segments of a route template before its first parameter (or an empty
    segment), at most ``depth`` of them: ``/api/v1/changes/{id}/approve`` -> ``("api", "v1",
    "changes")``, ``/`` -> ``()``."""
    out: list[str] = []
    for segment in path.split("/")[1:]:
        if "{" in segment or not segment or len(out) == depth:
            break
        out.append(segment)
    return tuple(out)


def request_key(path: str, depth: int = DEPTH) -> Prefix:
    """The first ``depth`` segments of a request path (a trailing slash adds none)."""
    parts = path.split("/", depth + 1)[1 : depth + 1]
    if parts and parts[-1] == "":
        parts.pop()
    return tuple(parts)


def route_paths(route: BaseRoute, prefix: str = "") -> list[str] | None:
    """Every path template ``route`` can match, or None when that cannot be told."""
    original = getattr(route, "original_router", None)
    if original is not None:  # FastAPI's included router: its routes under its prefix
        if getattr(original, "_low_priority_routes", None):
            return None
        context = getattr(route, "include_context", None)
        inner = prefix + (getattr(context, "prefix", "") or "")
        out: list[str] = []
        for child in original.routes:
            paths = route_paths(child, inner)
            if paths is None:
                return None
            out.extend(paths)
        return out
    path = getattr(route, "path_format", None)
    if not isinstance(path, str) or not path.startswith("/"):
        return None
    return [prefix + path]


def _can_match(prefixes: Sequence[Prefix] | None, key: Prefix) -> bool:
    if prefixes is None:
        return True
    return any(key[: len(p)] == p for p in prefixes)


class RouteIndex:
    """The application router's dispatch, narrowed per request path prefix."""

    def __init__(self, router: Router, fallback: Callable[[Scope, Receive, Send], Any]) -> None:
        self.router = router
        self.fallback = fallback
        self._cache: dict[Prefix, Router | None] = {}
        self._built_for: tuple[int, ...] = ()
        self._entries: list[tuple[BaseRoute, list[Prefix] | None]] = []

    def _rebuild(self) -> None:
        entries: list[tuple[BaseRoute, list[Prefix] | None]] = []
        for route in self.router.routes:
            paths = route_paths(route)
            prefixes = None if paths is None else sorted({literal_prefix(p) for p in paths})
            entries.append((route, prefixes))
        self._entries = entries
        self._cache = {}
        self._built_for = tuple(map(id, self.router.routes))

    def candidates(self, path: str) -> list[BaseRoute]:
        """The routes, in the application's order, that can match ``path``."""
        if tuple(map(id, self.router.routes)) != self._built_for:
            self._rebuild()
        key = request_key(path)
        return [route for route, prefixes in self._entries if _can_match(prefixes, key)]

    def router_for(self, path: str) -> Router | None:
        """The narrowed router for ``path``, or None when it would keep every route."""
        if len(self.router.routes) != len(self._built_for):
            self._rebuild()
        key = request_key(path)
        try:
            return self._cache[key]
        except KeyError:
            pass
        routes = self.candidates(path)
        narrowed: Router | None = None
        if len(routes) < len(self.router.routes):
            narrowed = copy.copy(self.router)
            narrowed.routes = routes
        if len(self._cache) < CACHE:
            self._cache[key] = narrowed
        return narrowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("root_path"):
            await self.fallback(scope, receive, send)
            return
        narrowed = self.router_for(scope["path"])
        if narrowed is None:
            await self.fallback(scope, receive, send)
            return
        scope.setdefault("router", self.router)  # url_for: the whole route table
        await narrowed.app(scope, receive, send)


def install(router: Router) -> RouteIndex | None:
    """Put the index in front of ``router``'s route walk. Only where the router's stack is its
    plain route walk (no router-level middleware, no body limit of its own): otherwise nothing
    changes and None is returned."""
    stack: ASGIApp = router.middleware_stack
    if stack != router.app:
        return None
    index = RouteIndex(router, router.app)
    router.middleware_stack = index
    return index
