"""The web console in a real browser (Debian's Chromium through Playwright): a security officer
enrolls TOTP with the QR code and signs in with it, sees the cluster and a node's MIG picture,
verifies a log entry in the browser (and sees a tampered proof or entry fail, and the log stay
consistent across checkpoints); a developer of one tenant sees nothing of another's; axe-core
finds no serious accessibility violation.

Screenshots of every page go to ``$PROOFPLANE_TEST_OUTPUT/console`` (default: the pytest
base temporary directory's ``console-screenshots``), for a reviewer to look at."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import live_server
from browser import axe_violations, chromium
from console_world import (
    BANK_DEV,
    HOSPITAL,
    OFFICER,
    PASSWORD,
    SETTINGS,
    World,
    build_world,
    enroll_totp,
    next_code,
    session_cookies,
)
from proofplane.access import SYSTEM, totp
from proofplane.audit import note
from proofplane.service import access as access_svc
from proofplane.service import audit as audit_svc


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("console"))


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = os.environ.get("PROOFPLANE_TEST_OUTPUT")
    out = Path(base) / "console" if base else tmp_path_factory.getbasetemp() / "console-screenshots"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def server(world: World) -> Iterator[str]:
    with live_server.serve(world.store, SETTINGS) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def officer(world: World) -> dict[str, str]:
    """One signed-in session of the officer for the module (a TOTP code is good once)."""
    return session_cookies(world.store, OFFICER, enroll_totp(world.store, OFFICER))


def _page(browser: Any, url: str, cookies: dict[str, str] | None = None, **options: Any) -> Any:
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, **options)
    if cookies:
        ctx.add_cookies([{"name": k, "value": v, "url": url} for k, v in cookies.items()])
    page = ctx.new_page()
    page.set_default_timeout(15_000)
    return page


def _verdict(page: Any, text: str) -> None:
    """Wait for the verify panel's verdict to read exactly ``text`` (the page's CSP forbids
    the string evaluation ``wait_for_function`` uses)."""
    page.locator("#verify-result .verdict", has_text=re.compile(f"^{text}$")).wait_for()


def test_sign_in_enrolling_totp_with_the_qr_code(world, server, browser, shots) -> None:
    access_svc.create_user(world.store, SYSTEM, "olga-officer", PASSWORD, ["security-officer"], [])
    page = _page(browser, server)
    page.goto(server + "/nodes/fra-h100-01")
    assert page.url.startswith(server + "/login?next=")  # signed out: to the sign-in page
    page.screenshot(path=shots / "01-login.png")
    page.fill("#username", "olga-officer")
    page.fill("#password", "not the password at all")
    page.click("button[type=submit]")
    page.locator("#login-error", has_text="Sign-in failed").wait_for()
    page.fill("#password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(server + "/enroll")  # MFA is required of the role: enroll first
    page.click("#enroll-start")
    qr = page.locator("#qr")
    qr.wait_for(state="visible")
    assert qr.get_attribute("src").startswith("data:image/svg+xml;base64,")
    assert page.evaluate("document.getElementById('qr').naturalWidth") > 0  # the image draws
    secret = page.locator("#secret").inner_text()
    page.screenshot(path=shots / "02-enroll-qr.png")
    page.fill("#code", totp.code_at_step(secret, totp.step_at(time.time())))
    page.click("#enroll-confirm button")
    page.locator("#enroll-done").wait_for(state="visible")
    assert len(page.locator("#recovery li").all()) == 10
    page.click("text=Sign in again")
    page.fill("#username", "olga-officer")
    page.fill("#password", PASSWORD)
    page.fill("#totp", next_code(secret))
    page.click("button[type=submit]")
    page.wait_for_url(server + "/")
    assert page.locator("h1").inner_text() == "Cluster"
    assert "olga-officer" in page.locator(".who").inner_text()
    page.click("#signout")
    page.wait_for_url(re.compile(r".*/login"))
    page.goto(server + "/")
    assert "/login" in page.url  # the session is gone


def test_cluster_and_a_nodes_mig_picture(world, server, browser, shots, officer) -> None:
    page = _page(browser, server, officer)
    page.goto(server + "/")
    assert page.locator("h1").inner_text() == "Cluster"
    rows = page.locator("table.nodes tbody tr")
    assert rows.count() == 24  # the demo's nodes, one page
    text = page.locator("main").inner_text()
    assert "eu-frankfurt" in text and "hipaa=true" in text
    page.screenshot(path=shots / "03-cluster.png", full_page=True)
    # the drifting node failed attestation: the filter finds it, with its reason
    page.select_option("#f-att", "failed")
    page.click("form.filters button")
    failed = page.locator("table.nodes tbody tr")
    assert failed.count() >= 1 and "failed" in failed.first.inner_text()

    page.goto(server + "/nodes/fra-h100-01")
    gpus = page.locator("svg.mig")
    assert gpus.count() == 8
    held = page.locator('svg.mig g.slot[data-tenant="st-marys-hospital"][data-profile="3g.40gb"]')
    assert held.count() >= 1  # radiology-triage's 3g.40gb slice, in the hospital's colour
    assert "radiology-triage" in held.first.text_content()
    legend = page.locator(".legend").inner_text()
    assert HOSPITAL in legend and "free" in legend
    assert page.locator("text=download for attest replay").count() >= 1
    page.screenshot(path=shots / "04-node-mig.png", full_page=True)
    with page.expect_download() as download:
        page.locator("text=download for attest replay").first.click()
    record = json.loads(Path(download.value.path()).read_text())
    assert record["simulated"] is True  # the demo's simulated attester says so

    page.goto(server + "/workloads/st-marys-hospital/oncology-h200")
    assert "Why waiting" in page.locator("h2").first.inner_text()
    page.screenshot(path=shots / "05-workload-why-waiting.png", full_page=True)
    page.goto(server + "/tenants/st-marys-hospital")
    assert "Quota and usage" in page.locator("main").inner_text()
    page.screenshot(path=shots / "06-tenant.png", full_page=True)


def test_verify_an_entry_in_the_browser(world, server, browser, shots, officer) -> None:
    page = _page(browser, server, officer)
    page.goto(server + "/audit?action=node.register")  # entries the checkpoint covers
    page.click("#pin-server-key")
    assert "+" in page.locator("#pinned-key").inner_text()
    page.locator(".verify-entry").first.click()
    verdict = page.locator("#verify-result")
    verdict.locator(".verdict").wait_for()
    assert verdict.locator(".verdict").inner_text() == "verified"
    assert "node.register" in verdict.inner_text()
    page.screenshot(path=shots / "07-audit-verified.png", full_page=True)

    def tamper_proof(route: Any) -> None:
        data = route.fetch().json()
        first = data["proof"][0]
        data["proof"][0] = ("0" if first[0] != "0" else "1") + first[1:]
        route.fulfill(json=data)

    page.route("**/api/v1/audit/proof/inclusion*", tamper_proof)
    page.locator(".verify-entry").first.click()
    _verdict(page, "NOT verified")
    assert "inclusion proof does not lead to the signed checkpoint's root" in verdict.inner_text()
    page.screenshot(path=shots / "08-audit-tampered-proof.png", full_page=True)
    page.unroute("**/api/v1/audit/proof/inclusion*")

    def tamper_entry(route: Any) -> None:
        data = route.fetch().json()
        data["entries"][0]["entry"] = data["entries"][1 if len(data["entries"]) > 1 else 0][
            "entry"
        ].replace("A", "B", 1)
        route.fulfill(json=data)

    page.route("**/api/v1/audit/entries*", tamper_entry)
    page.locator(".verify-entry").first.click()
    page.locator("#verify-result", has_text="leaf hash").wait_for()
    assert verdict.locator(".verdict").inner_text() == "NOT verified"
    page.unroute("**/api/v1/audit/entries*")

    # a malformed key is not pinned; a checkpoint not signed by the pinned key is refused
    page.fill("#pin-input", "proofplane/default+00000000+AQ" + "A" * 42)
    page.click("#pin-form button")
    page.locator("#verify-result", has_text="id does not match").wait_for()
    other = note.generate_signer("proofplane/default", bytes(range(32))).verifier.text()
    page.fill("#pin-input", other)
    page.click("#pin-form button")
    page.locator("#pinned-key", has_text=other).wait_for()
    page.click("#verify-checkpoint")
    page.locator("#verify-result", has_text="no signature by the pinned key").wait_for()
    assert verdict.locator(".verdict").inner_text() == "NOT verified"
    page.click("#pin-server-key")

    # the log grows and a new checkpoint is signed: it is consistent with the one seen
    page.click("#verify-checkpoint")
    _verdict(page, "verified")
    audit_svc.sign_checkpoint(world.store, SYSTEM, world.keys, datetime.now(UTC))
    page.click("#check-consistency")
    page.locator("#verify-result", has_text="extends").wait_for()
    assert verdict.locator(".verdict").inner_text() == "verified"
    page.screenshot(path=shots / "09-audit-consistent.png", full_page=True)


def test_a_developer_sees_nothing_of_another_tenant(world, server, browser, shots) -> None:
    page = _page(browser, server, session_cookies(world.store, BANK_DEV))
    page.goto(server + "/workloads")
    listed = page.locator("main table").inner_text()
    assert "fraud-scoring" in listed  # the bank's own
    assert HOSPITAL not in listed and "radiology-triage" not in listed
    page.goto(server + "/nodes/fra-h100-01")
    picture = page.locator("section[aria-labelledby=mig-h]").inner_text()
    assert "another tenant" in picture
    assert HOSPITAL not in page.content() and "radiology-triage" not in page.content()
    assert "audit:read" in page.locator("main").inner_text()  # no attestation history
    page.screenshot(path=shots / "10-developer-node.png", full_page=True)
    page.goto(server + "/tenants")
    assert HOSPITAL not in page.locator("main").inner_text()
    response = page.goto(server + "/tenants/" + HOSPITAL)
    assert response.status == 404
    response = page.goto(server + "/workloads/st-marys-hospital/radiology-triage")
    assert response.status == 404
    response = page.goto(server + "/audit")
    assert response.status == 403
    assert "Audit" not in page.locator("nav").inner_text()  # not offered either


def test_no_serious_accessibility_violations(world, server, browser, officer) -> None:
    page = _page(browser, server, officer, bypass_csp=True)
    found = {}
    for path in ("/", "/nodes/fra-h100-01", "/workloads", "/workloads/nordbank/fraud-scoring",
                 "/tenants", "/tenants/st-marys-hospital", "/audit"):  # fmt: skip
        page.goto(server + path)
        violations = axe_violations(page)
        if violations:
            found[path] = violations
    login = _page(browser, server, bypass_csp=True)
    login.goto(server + "/login")
    if axe_violations(login):
        found["/login"] = axe_violations(login)
    assert found == {}


def test_an_evidence_package_from_the_console(world, server, browser, shots, officer) -> None:
    page = _page(browser, server, officer)
    page.goto(server + "/evidence")
    page.select_option("#framework", "nist-800-53")
    page.click("#evidence-form button")
    link = page.locator("#evidence-download")
    page.locator("#evidence-status .good, #evidence-status .bad").wait_for(timeout=60_000)
    assert link.count() == 1, page.locator("#evidence-status").inner_text()
    assert "controls" in page.locator("#evidence-status").inner_text()
    page.screenshot(path=shots / "11-evidence.png", full_page=True)
    with page.expect_download() as download:
        link.click()
    assert download.value.suggested_filename.endswith(".tar.gz")
    assert Path(download.value.path()).stat().st_size > 10_000
    page.fill("#to", "2999-01-01T00:00:00")
    page.click("#evidence-form button")
    page.locator("#evidence-status", has_text="period_in_future").wait_for()
