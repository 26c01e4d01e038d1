"""The route index (api/route_index.py) chooses exactly the route FastAPI's whole walk chooses.

For every route template of the application (parameters filled in), with and without a trailing
slash, cut short, extended, and for random paths, under every method: the first full match and
the first partial (method) match over the narrowed list are those over the whole list. End to
end, a 404, a 405 and a normal answer are unchanged through the installed index.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.routing import BaseRoute, Match

from proofplane.api import route_index
from proofplane.api.app import create_app
from proofplane.service.context import Store

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


@pytest.fixture(scope="module")
def app() -> Any:
    return create_app(None)  # type: ignore[arg-type]


def _scope(path: str, method: str) -> dict[str, Any]:
    return {
        "type": "http",
        "path": path,
        "method": method,
        "root_path": "",
        "headers": [],
        "query_string": b"",
    }


def _chosen(routes: list[BaseRoute], path: str, method: str) -> tuple[str, int | None]:
    """What the walk picks: ("full", i) for the first full match, else ("partial", i), else
    ("none", None); i is the route's identity, so two lists are compared route for route."""
    partial = None
    for route in routes:
        match, _ = route.matches(_scope(path, method))
        if match == Match.FULL:
            return "full", id(route)
        if match == Match.PARTIAL and partial is None:
            partial = id(route)
    return ("partial", partial) if partial is not None else ("none", None)


def _templates(app: Any) -> list[str]:
    paths = []
    for route in app.router.routes:
        paths.extend(route_index.route_paths(route) or [])
    return sorted(set(paths))


def _filled(template: str, value: str = "x1") -> str:
    return re.sub(r"\{[^}]+\}", value, template)


def _index(app: Any) -> route_index.RouteIndex:
    index = app.router.middleware_stack
    assert isinstance(index, route_index.RouteIndex), "create_app installs the index"
    return index


def test_index_is_installed_and_narrows(app: Any) -> None:
    index = _index(app)
    total = len(app.router.routes)
    narrowed = index.router_for("/api/v1/changes/abc/approve")
    assert narrowed is not None and len(narrowed.routes) < total / 4
    assert len(_templates(app)) > 100  # the whole table was read, not a part of it


def test_literal_prefix_and_request_key() -> None:
    assert route_index.literal_prefix("/api/v1/changes/{id}/approve") == ("api", "v1", "changes")
    assert route_index.literal_prefix("/api/{v}/x") == ("api",)
    assert route_index.literal_prefix("/") == ()
    assert route_index.literal_prefix("/a/b/c/d/e") == ("a", "b", "c")
    assert route_index.request_key("/api/v1/changes/") == ("api", "v1", "changes")
    assert route_index.request_key("/api/v1") == ("api", "v1")
    assert route_index.request_key("/api/v1/") == ("api", "v1")
    assert route_index.request_key("/") == ()


def test_every_route_chooses_the_same(app: Any) -> None:
    index = _index(app)
    whole = list(app.router.routes)
    checked = 0
    for template in _templates(app):
        path = _filled(template)
        variants = {path, path + "/", path.rstrip("/") or "/", path + "/extra", path[:-1] or "/"}
        variants.add(path.rsplit("/", 1)[0] or "/")
        for variant in variants:
            narrowed = index.candidates(variant)
            for method in METHODS:
                assert _chosen(narrowed, variant, method) == _chosen(whole, variant, method), (
                    variant,
                    method,
                )
                checked += 1
    assert checked > 1000


@settings(max_examples=300, deadline=None)
@given(
    segments=st.lists(
        st.sampled_from(["api", "v1", "changes", "nodes", "x", "", "audit", "static", "healthz"])
        | st.text("abc-_.%", min_size=1, max_size=6),
        max_size=6,
    ),
    method=st.sampled_from(METHODS),
)
def test_random_paths_choose_the_same(app: Any, segments: list[str], method: str) -> None:
    path = "/" + "/".join(segments)
    assert _chosen(_index(app).candidates(path), path, method) == _chosen(
        list(app.router.routes), path, method
    )


def test_a_route_added_later_is_found(app: Any) -> None:
    local = create_app(None)  # type: ignore[arg-type]
    index = _index(local)
    assert index.router_for("/api/v1/late-addition") is not None  # cached, without it

    @local.get("/api/v1/late-addition")
    def late() -> dict[str, str]:
        return {"late": "yes"}

    routes = index.candidates("/api/v1/late-addition")
    assert any(getattr(r, "path", None) == "/api/v1/late-addition" for r in routes)
    # and the list a request is dispatched on (cached before the route was added) has it too
    narrowed = index.router_for("/api/v1/late-addition")
    assert narrowed is not None
    assert any(getattr(r, "path", None) == "/api/v1/late-addition" for r in narrowed.routes)
    with TestClient(local) as client:
        assert client.get("/api/v1/late-addition").json() == {"late": "yes"}


def test_answers_through_the_index(tmp_path: Any) -> None:
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    try:
        from proofplane.store import migrate

        migrate.upgrade(store.engine)
        with TestClient(create_app(store)) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            missing = client.get("/api/v1/no-such-thing")
            assert missing.status_code == 404
            wrong = client.delete("/healthz")
            assert wrong.status_code == 405
            unauth = client.post("/api/v1/changes/abc/approve", json={})
            assert unauth.status_code == 401
    finally:
        store.dispose()
