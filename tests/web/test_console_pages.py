"""The console's pages without a browser: who may see what (the API's rule), bad input as a
clear 4xx page, the sign-in redirect, the QR helper's checks, and the security headers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from console_world import (
    BANK,
    BANK_DEV,
    HOSPITAL,
    HOSPITAL_DEV,
    OFFICER,
    SETTINGS,
    World,
    build_world,
    enroll_totp,
    session_cookies,
)
from proofplane.api.app import create_app


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("pages"))


@pytest.fixture(scope="module")
def officer(world: World) -> Iterator[TestClient]:
    cookies = session_cookies(world.store, OFFICER, enroll_totp(world.store, OFFICER))
    with TestClient(create_app(world.store, SETTINGS), cookies=cookies) as c:
        yield c


def _client(world: World, username: str | None) -> TestClient:
    cookies = session_cookies(world.store, username) if username else None
    return TestClient(create_app(world.store, SETTINGS), cookies=cookies)


PAGES = ["/", "/nodes/fra-h100-01", "/workloads", "/workloads/nordbank/fraud-scoring",
         "/tenants", "/tenants/nordbank", "/audit", "/evidence"]  # fmt: skip


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders_for_the_officer(officer: TestClient, path: str) -> None:
    r = officer.get(path)
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]  # no inline script
    assert "<script>" not in r.text and " style=" not in r.text  # nothing the CSP would block
    assert r.headers["server-timing"].startswith("app;dur=")


@pytest.mark.parametrize("path", PAGES)
def test_signed_out_goes_to_sign_in_and_comes_back(world: World, path: str) -> None:
    r = _client(world, None).get(path, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"].startswith("/login?next=")


def test_login_page_keeps_next_on_this_site(world: World) -> None:
    c = _client(world, None)
    assert 'data-next="/audit"' in c.get("/login?next=/audit").text
    assert 'data-next="/"' in c.get("/login?next=//evil.example/").text
    assert 'data-next="/"' in c.get("/login?next=https://evil.example/").text
    assert 'data-next="/"' in c.get("/login?next=/%5Cevil.example/").text  # "/\\" is "//"
    assert "single sign-on" not in c.get("/login").text  # no OIDC configured


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/?state=melting", 422, "invalid_filter"),
        ("/?attestation=maybe", 422, "invalid_filter"),
        ("/?certification=nonsense", 422, "invalid_tag"),
        ("/?cursor=garbage", 422, None),
        ("/?region=" + "x" * 300, 422, "invalid_filter"),
        ("/workloads?status=sleeping", 422, "invalid_filter"),
        ("/nodes/no-such-node", 404, "not_found"),
        ("/nodes/fra-h100-01/attestation/999999", 404, "not_found"),
        ("/nodes/fra-h100-01/attestation/abc", 404, "not_found"),
        ("/nodes/fra-h100-01/attestation/99999999999999999999999", 404, "not_found"),
        ("/nodes/fra-h100-02/attestation/1", 404, "not_found"),  # another node's record
        ("/tenants/no-such-tenant", 404, "not_found"),
        ("/workloads/nordbank/no-such-workload", 404, "not_found"),
    ],
)
def test_bad_input_is_a_clear_error_page(officer: TestClient, path, status, code) -> None:
    r = officer.get(path)
    assert r.status_code == status, r.text[:300]
    if code is not None:
        assert f'<code class="error-code">{code}</code>' in r.text


def test_a_developer_sees_only_their_tenant(world: World) -> None:
    bank = _client(world, BANK_DEV)
    hospital = _client(world, HOSPITAL_DEV)
    assert "fraud-scoring" in bank.get("/workloads").text
    assert "radiology-triage" not in bank.get("/workloads").text
    assert "radiology-triage" in hospital.get("/workloads").text
    assert HOSPITAL not in bank.get("/tenants").text
    assert bank.get(f"/tenants/{HOSPITAL}").status_code == 404  # as if it did not exist
    assert bank.get(f"/workloads/{HOSPITAL}/radiology-triage").status_code == 404
    node = bank.get("/nodes/fra-h100-01").text
    assert "another tenant" in node and HOSPITAL not in node and "radiology-triage" not in node
    assert "radiology-triage" in hospital.get("/nodes/fra-h100-01").text
    assert bank.get("/audit").status_code == 403
    assert bank.get("/evidence").status_code == 403
    assert bank.get("/nodes/fra-h100-01/attestation/1").status_code == 403
    assert 'href="/audit"' not in bank.get("/").text
    own = bank.get(f"/tenants/{BANK}").text
    assert "Quota and usage" in own and "Users" not in own  # developers do not read users


def test_the_officer_sees_users_and_the_attestation_record(officer: TestClient) -> None:
    page = officer.get(f"/tenants/{HOSPITAL}").text
    assert HOSPITAL_DEV in page and BANK_DEV not in page
    node = officer.get("/nodes/fra-h100-01").text
    assert "rack fra1-r01 / block fra1-b1 / nvlink_domain fra1-nv1" in node  # issue 17 §4
    link = node.split('href="/nodes/fra-h100-01/attestation/', 1)[1].split('"', 1)[0]
    r = officer.get(f"/nodes/fra-h100-01/attestation/{link}")
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    assert r.json()["simulated"] is True


def test_qr_helper_needs_a_session_its_csrf_token_and_an_otpauth_uri(
    world: World, officer: TestClient
) -> None:
    uri = {"uri": "otpauth://totp/proofplane:x?secret=JBSWY3DPEHPK3PXP&issuer=proofplane"}
    assert _client(world, None).post("/console/qr", json=uri).status_code == 401
    assert officer.post("/console/qr", json=uri).status_code == 403  # no x-csrf-token
    csrf = {"x-csrf-token": officer.cookies["proofplane_csrf"]}
    r = officer.post("/console/qr", json=uri, headers=csrf)
    assert r.status_code == 200 and r.json()["qr"].startswith("data:image/svg+xml;base64,")
    for bad in ({"uri": "https://example.com"}, {"nope": 1}, {"uri": "otpauth://" + "a" * 2000}):
        assert officer.post("/console/qr", json=bad, headers=csrf).status_code == 422
    assert officer.post("/console/qr", content=b"{", headers=csrf).status_code == 422
    deep = b"[" * 100_000  # json.loads recurses: RecursionError, not a 500
    assert officer.post("/console/qr", content=deep, headers=csrf).status_code == 422


def test_static_files_are_served_from_the_package(officer: TestClient) -> None:
    for name in ("console.js", "verify.js", "console.css", "favicon.svg"):
        assert officer.get(f"/static/{name}").status_code == 200
    assert officer.get("/static/nope.js").status_code == 404


def test_sso_is_offered_when_oidc_is_configured(world: World) -> None:
    """The link starts the existing OIDC flow, coming back to where the user was going."""
    from dataclasses import replace

    from proofplane.config import OidcSettings

    oidc = OidcSettings("https://idp.example", "proofplane", None, "http://127.0.0.1/cb")
    app = create_app(world.store, replace(SETTINGS, oidc=oidc))
    page = TestClient(app).get("/login?next=/audit").text
    assert 'href="/api/v1/auth/oidc/login?return_to=%2Faudit"' in page
    assert "Sign in with single sign-on" in page


def test_gpu_utilisation_is_shown_to_those_who_see_every_tenant(
    world: World, officer: TestClient
) -> None:
    from proofplane.store.tables import telemetry_device_latest

    with world.store.engine.begin() as conn:
        conn.execute(
            telemetry_device_latest.insert(),
            [
                {"key": f"util-{g}", "node": "fra-h100-01", "gpu_uuid": f"GPU-x-{g}",
                 "gi_id": None, "profile": None, "dev_gpu_util": value,
                 "ts": 0, "workload": None, "tenant": None, "simulated": True}
                for g, value in enumerate((30.0, 50.0))
            ],
        )  # fmt: skip
    page = officer.get("/").text
    assert "mean GPU utilisation" in page and "40 %" in page
    assert "mean GPU utilisation" not in _client(world, BANK_DEV).get("/").text


def test_no_console_route_answers_without_a_session(world: World) -> None:
    """Every console path (web.console.PATHS, which the route matrix lets outside FastAPI's
    routing) sends a signed-out visitor to sign in, or refuses it, except sign-in itself."""
    from proofplane.web import console

    anonymous = _client(world, None)
    for path in sorted(console.PATHS - console.PUBLIC):
        concrete = (
            path.replace("{name}", "fra-h100-01").replace("{tenant}", BANK)
            .replace("{id}", "1")
        )  # fmt: skip
        r = (
            anonymous.post(concrete, json={"uri": "otpauth://x"})
            if path == "/console/qr"
            else anonymous.get(concrete, follow_redirects=False)
        )
        assert r.status_code in (303, 401), (path, r.status_code)
        if r.status_code == 303:
            assert r.headers["location"].startswith("/login")
    assert anonymous.get("/enroll", follow_redirects=False).headers["location"] == "/login"
