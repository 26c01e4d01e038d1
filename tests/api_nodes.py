"""Test helper: nodes registered and admitted through the HTTP API."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

API = "/api/v1"


def register_admitted(
    client: TestClient, body: dict[str, Any], certs: dict[str, str] | None = None
) -> None:
    """``POST /nodes`` with ``body``, then admit the node and grant it ``certs``."""
    name = body["name"]
    r = client.post(f"{API}/nodes", json=body)
    assert r.status_code == 201, r.text
    r = client.post(f"{API}/nodes/{name}/state", json={"state": "admitted"})
    assert r.status_code == 200, r.text
    for key, value in (certs or {}).items():
        r = client.post(f"{API}/nodes/{name}/certifications", json={"key": key, "value": value})
        assert r.status_code == 200, r.text
