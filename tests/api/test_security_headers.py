"""Security headers on every response, and no CDN scripts by default (issue 19, §6)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from proofplane.api.app import create_app
from proofplane.api.middleware_headers import CONTENT_SECURITY_POLICY, HSTS
from proofplane.config import Settings, from_env
from proofplane.errors import ValidationFailed
from proofplane.service.context import Store

API = "/api/v1"
TOKEN = "ppt_test-admin-token-0123456789abcdef"  # conftest's bootstrap admin token


def secured(r: Any, *, tls: bool = False) -> None:
    h = r.headers
    assert h["x-content-type-options"] == "nosniff", (r.request.url, dict(h))
    assert h["referrer-policy"] == "no-referrer"
    assert h["x-frame-options"] == "DENY"
    assert h["content-security-policy"] == CONTENT_SECURITY_POLICY
    csp = CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    if tls:
        assert h["strict-transport-security"] == HSTS
    else:
        assert "strict-transport-security" not in h


@pytest.fixture
def broken(client: TestClient, store: Store) -> Iterator[TestClient]:
    """An API with one extra route that fails unexpectedly (a 500 from the outermost layer)."""
    app = create_app(store)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("boom")

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_every_response_carries_the_headers(client: TestClient, broken: TestClient) -> None:
    responses = [
        client.get("/healthz"),
        client.get("/openapi.json"),
        client.get(f"{API}/nodes"),
        client.get(f"{API}/nope"),  # 404
        client.get("/nope"),  # 404 outside /api
        client.put(f"{API}/nodes"),  # 405
        client.post(f"{API}/tenants", json={"name": "BAD"}),  # 422
        client.post(f"{API}/tenants", content=b"{", headers={"Content-Type": "application/json"}),
        client.get(f"{API}/nodes", headers={"Authorization": "Bearer nope"}),  # 401
        client.post(f"{API}/tenants", json={"name": "t", "description": "x" * (2 << 20)}),  # 413
        broken.get("/boom"),  # 500
    ]
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 200, 404, 404, 405, 422, 422, 401, 413, 500], statuses
    for r in responses:
        secured(r)


def test_hsts_only_over_tls(client: TestClient, store: Store) -> None:
    secured(client.get("/healthz"))
    with TestClient(create_app(store), base_url="https://testserver") as tls:
        secured(tls.get("/healthz"), tls=True)
        secured(tls.get("/nope"), tls=True)


def test_docs_are_off_by_default_and_the_openapi_document_stays(client: TestClient) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = client.get(path)
        assert r.status_code == 404, path
        secured(r)
    spec = client.get("/openapi.json")
    assert spec.status_code == 200 and spec.json()["paths"]
    assert "cdn" not in spec.text.lower()


def test_docs_when_asked_for_get_their_own_policy(client: TestClient, store: Store) -> None:
    """PROOFPLANE_API_DOCS=1 (development): Swagger UI from jsDelivr, its page alone allowed to
    load it; every other response keeps the strict policy."""
    with TestClient(create_app(store, Settings(api_docs=True))) as c:
        page = c.get("/docs")
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert "https://cdn.jsdelivr.net" in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assert c.get("/redoc").status_code == 404
        secured(c.get("/openapi.json"))
        secured(c.get("/healthz"))


def test_api_docs_setting() -> None:
    assert from_env({}).api_docs is False
    assert from_env({"PROOFPLANE_API_DOCS": "1"}).api_docs is True
    assert from_env({"PROOFPLANE_API_DOCS": "0"}).api_docs is False
    with pytest.raises(ValidationFailed):
        from_env({"PROOFPLANE_API_DOCS": "maybe"})
