"""The web console: server-rendered pages at ``/`` on the API server, for people.

Every page is a view of one ``service.console`` read, scoped by the signed-in actor exactly as
the API is (``access.authorize`` in the service); nothing here decides who may see what. The
pages are plain HTML (Jinja2) with a little JavaScript of our own under ``/static`` (no CDN,
no build step: an air-gapped site serves it as it is), which keeps to the API's
Content-Security-Policy (no inline script or style). Signing in, TOTP enrollment and signing
out call the JSON API (``/api/v1/auth/…``) from the page; the session is the API's HttpOnly
cookie with its CSRF token. The audit page verifies the log in the reader's browser
(``static/verify.js``): it trusts the server for nothing but bytes.

The pages are Starlette routes, not API operations: they are not in the OpenAPI document and
answer HTML (a signed-out visitor is sent to ``/login``).
"""

from __future__ import annotations

import base64
import hmac
import io
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import qrcode
import qrcode.image.svg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.staticfiles import StaticFiles

from proofplane.access import Actor, Forbidden, Permission, Unauthenticated
from proofplane.access.credentials import CSRF_HEADER, SESSION_COOKIE, csrf_token
from proofplane.config import Settings
from proofplane.errors import NotFound, ProofplaneError, ValidationFailed
from proofplane.model import NodeState, WorkloadStatus, parse_tag_pairs
from proofplane.service import audit as audit_svc
from proofplane.service import console as svc
from proofplane.service import events as events_svc
from proofplane.service import tenants as tenants_svc
from proofplane.service import workloads as workloads_svc
from proofplane.service.access import authenticate
from proofplane.service.context import Store
from proofplane.service.evidence import FRAMEWORKS

HERE = Path(__file__).resolve().parent
E = TypeVar("E", bound=StrEnum)
PAGE_SIZE = 50

# The navigation: (label, path, permission needed to see the entry). Entries whose pages are
# not built yet point at their JSON API; a page slots in by changing its path.
NAV: tuple[tuple[str, str, Permission], ...] = (
    ("Cluster", "/", Permission.NODES_READ),
    ("Workloads", "/workloads", Permission.WORKLOADS_READ),
    ("Tenants", "/tenants", Permission.TENANTS_READ),
    ("Audit", "/audit", Permission.AUDIT_READ),
    ("Evidence", "/evidence", Permission.AUDIT_READ),
    ("Changes", "/api/v1/changes", Permission.CHANGES_READ),
    ("Alerts", "/api/v1/alerts", Permission.METRICS_READ),
    ("Usage", "/api/v1/usage", Permission.METRICS_READ),
    ("Segments", "/api/v1/network/segments", Permission.NODES_READ),
)

_env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.globals["tenant_colour"] = svc.tenant_colour
_env.globals["MEMORY_SLOTS"] = 8


def _store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


def _settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def viewer(request: Request, *, enrolling: bool = False) -> Actor | None:
    """The signed-in actor of this browser (its session cookie), or None."""
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        return None
    try:
        actor = authenticate(_store(request), cookie, datetime.now(UTC))
    except ProofplaneError:
        return None
    if actor.enrollment_only and not enrolling:
        return None
    return actor


def render(request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    actor: Actor | None = values.get("actor")
    nav = [(label, path) for label, path, perm in NAV if actor is not None and actor.holds(perm)]
    html = _env.get_template(template).render(
        request=request, nav=nav, path=request.url.path, **values
    )
    return HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})


def _status_of(exc: ProofplaneError) -> int:
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, Forbidden):
        return 403
    if isinstance(exc, Unauthenticated):
        return 401
    if isinstance(exc, ValidationFailed):
        return 422
    return 400


def page(
    fn: Callable[[Request, Actor], Response],
) -> Callable[[Request], Any]:
    """A console page: signed in (else to /login, coming back here), errors as a page with
    the error's status and code (never a 500 for bad input)."""

    def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        cookie = request.cookies.get(SESSION_COOKIE)
        enrolling = viewer(request, enrolling=True) if cookie else None
        if enrolling is not None and enrolling.enrollment_only:
            return RedirectResponse("/enroll", status_code=303)
        if enrolling is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/login?next={quote(target)}", status_code=303)
        try:
            response = fn(request, enrolling)
        except ProofplaneError as exc:
            response = render(request, "error.html", _status_of(exc), actor=enrolling, error=exc)
        response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response

    return endpoint


def _arg(request: Request, name: str, limit: int = 255) -> str | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    if len(value) > limit:
        raise ValidationFailed(f"{name}: at most {limit} characters", code="invalid_filter")
    return value


def _choice(request: Request, name: str, kind: type[E]) -> E | None:
    """Query parameter ``name`` as a member of the enum ``kind`` (422 ``invalid_filter``)."""
    value = _arg(request, name, 32)
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ValidationFailed(
            f"unknown {name} {value!r}",
            code="invalid_filter",
            details={"known": [m.value for m in kind]},
        ) from None


def _filters(request: Request, *names: str) -> dict[str, str]:
    """The page's filter values as given, for its form."""
    return {k: request.query_params.get(k, "") for k in names}


def _now_grace(request: Request) -> tuple[datetime, timedelta]:
    return datetime.now(UTC), timedelta(seconds=_settings(request).attest_grace_s)


def _query(request: Request, **changes: str | None) -> str:
    """This page's query string with ``changes`` applied (None removes a key)."""
    params = {k: v for k, v in request.query_params.items() if v}
    for k, v in changes.items():
        if v is None:
            params.pop(k, None)
        else:
            params[k] = v
    return "?" + urlencode(params) if params else "?"


# --- pages ---------------------------------------------------------------------------------


def cluster(request: Request, actor: Actor) -> Response:
    state = _choice(request, "state", NodeState)
    cert_text = _arg(request, "certification")
    certs = parse_tag_pairs([cert_text], field="certification") if cert_text else None
    now, grace = _now_grace(request)
    view = svc.cluster_view(
        _store(request),
        actor,
        now=now,
        grace=grace,
        region=_arg(request, "region", 63),
        state=state,
        certification=certs,
        attestation=_arg(request, "attestation", 16),
        limit=PAGE_SIZE,
        cursor=_arg(request, "cursor", 512),
    )
    return render(
        request,
        "cluster.html",
        actor=actor,
        view=view,
        states=[s.value for s in NodeState],
        attestation_states=svc.ATTESTATION_STATES,
        filters=_filters(request, "region", "state", "certification", "attestation"),
        next_link=_query(request, cursor=view.next) if view.next else None,
    )


def node(request: Request, actor: Actor) -> Response:
    now, grace = _now_grace(request)
    view = svc.node_view(_store(request), actor, request.path_params["name"], now=now, grace=grace)
    return render(request, "node.html", actor=actor, view=view)


def attestation_record(request: Request, actor: Actor) -> Response:
    name = request.path_params["name"]
    try:
        evidence_id = int(request.path_params["id"])
    except ValueError:
        raise NotFound("no such attestation record", code="not_found") from None
    if not 0 < evidence_id < 2**62:
        raise NotFound("no such attestation record", code="not_found")
    record = svc.evidence_record(_store(request), actor, name, evidence_id)
    return Response(
        json.dumps(record, indent=1, sort_keys=True) + "\n",
        media_type="application/json",
        headers={
            "Content-Disposition": f'attachment; filename="{name}-attestation-{evidence_id}.json"'
        },
    )


def workloads(request: Request, actor: Actor) -> Response:
    status = _choice(request, "status", WorkloadStatus)
    result = workloads_svc.list_workloads(
        _store(request),
        actor,
        tenant=_arg(request, "tenant", 63),
        status=status,
        node=_arg(request, "node", 63),
        limit=PAGE_SIZE,
        cursor=_arg(request, "cursor", 512),
    )
    return render(
        request,
        "workloads.html",
        actor=actor,
        items=result.items,
        statuses=[s.value for s in WorkloadStatus],
        filters=_filters(request, "tenant", "status", "node"),
        next_link=_query(request, cursor=result.next) if result.next else None,
    )


def workload(request: Request, actor: Actor) -> Response:
    live = request.query_params.get("live") == "1"
    wl, explain = svc.workload_view(
        _store(request), actor, request.path_params["name"], request.path_params["tenant"],
        live=live,
    )  # fmt: skip
    return render(request, "workload.html", actor=actor, wl=wl, explain=explain)


def tenants(request: Request, actor: Actor) -> Response:
    result = tenants_svc.list_tenants(
        _store(request), actor, limit=PAGE_SIZE, cursor=_arg(request, "cursor", 512)
    )
    return render(
        request,
        "tenants.html",
        actor=actor,
        items=result.items,
        next_link=_query(request, cursor=result.next) if result.next else None,
    )


def tenant(request: Request, actor: Actor) -> Response:
    view = svc.tenant_view(_store(request), actor, request.path_params["name"])
    return render(request, "tenant.html", actor=actor, view=view)


def audit(request: Request, actor: Actor) -> Response:
    store = _store(request)
    keys: audit_svc.AuditKeys = request.app.state.audit_keys
    try:
        checkpoint = audit_svc.latest_checkpoint(store, actor)
    except NotFound:
        checkpoint = None
    try:
        key = audit_svc.get_verifier_key(store, keys, actor)
    except NotFound:
        key = None
    result = events_svc.list_events(
        store,
        actor,
        action=_arg(request, "action", 63),
        target_type=_arg(request, "target_type", 32),
        target_id=_arg(request, "target_id"),
        newest_first=True,
        limit=PAGE_SIZE,
        cursor=_arg(request, "cursor", 512),
    )
    return render(
        request,
        "audit.html",
        actor=actor,
        checkpoint=checkpoint,
        verifier_key=key,
        items=result.items,
        filters=_filters(request, "action", "target_type", "target_id"),
        next_link=_query(request, cursor=result.next) if result.next else None,
    )


def evidence(request: Request, actor: Actor) -> Response:
    if not actor.holds(Permission.AUDIT_READ):
        raise Forbidden(f"{actor.name} may not audit:read", code="forbidden")
    now = datetime.now(UTC).replace(microsecond=0, tzinfo=None)
    return render(
        request,
        "evidence.html",
        actor=actor,
        frameworks=FRAMEWORKS,
        default_from=(now - timedelta(days=30)).isoformat(timespec="seconds"),
        default_to=now.isoformat(timespec="seconds"),
    )


def login(request: Request) -> Response:
    target = request.query_params.get("next") or "/"
    # a path on this site only: "//host" and "/\\host" (browsers read "\\" as "/") leave it
    if not target.startswith("/") or target[1:2] in ("/", "\\"):
        target = "/"
    return render(
        request,
        "login.html",
        actor=None,
        next=target,
        sso=_settings(request).oidc is not None,
        sso_link="/api/v1/auth/oidc/login?" + urlencode({"return_to": target}),
    )


def enroll(request: Request) -> Response:
    actor = viewer(request, enrolling=True)
    if actor is None:
        return RedirectResponse("/login", status_code=303)
    return render(request, "enroll.html", actor=None, who=actor.name)


async def qr(request: Request) -> Response:
    """The QR code of an ``otpauth://`` URI the page got from ``POST /api/v1/auth/mfa/enroll``
    (drawn here: the page has no QR encoder), as a data: URI. A signed-in (or enrolling)
    session with its CSRF token only; the URI is not kept."""
    cookie = request.cookies.get(SESSION_COOKIE, "")
    if viewer(request, enrolling=True) is None:
        return JSONResponse(
            {"error": {"code": "unauthenticated", "message": "sign in first"}}, status_code=401
        )
    sent = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(sent.encode(), csrf_token(cookie).encode()):
        return JSONResponse(
            {"error": {"code": "csrf_failed", "message": f"missing or wrong {CSRF_HEADER}"}},
            status_code=403,
        )
    body = await request.body()
    try:
        uri = json.loads(body)["uri"]
        if not isinstance(uri, str) or not uri.startswith("otpauth://") or len(uri) > 1024:
            raise ValueError
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: deep JSON
        return JSONResponse(
            {"error": {"code": "validation_failed", "message": 'send {"uri": "otpauth://…"}'}},
            status_code=422,
        )
    return JSONResponse({"qr": qr_data_uri(uri)}, headers={"Cache-Control": "no-store"})


def qr_data_uri(text: str) -> str:
    """``text`` as a QR code, an SVG in a data: URI."""
    image = qrcode.make(text, image_factory=qrcode.image.svg.SvgPathImage, box_size=8, border=2)
    out = io.BytesIO()
    image.save(out)
    return "data:image/svg+xml;base64," + base64.b64encode(out.getvalue()).decode()


def routes() -> list[Route]:
    return [
        Route("/", page(cluster), methods=["GET"]),
        Route("/nodes/{name}", page(node), methods=["GET"]),
        Route("/nodes/{name}/attestation/{id}", page(attestation_record), methods=["GET"]),
        Route("/workloads", page(workloads), methods=["GET"]),
        Route("/workloads/{tenant}/{name}", page(workload), methods=["GET"]),
        Route("/tenants", page(tenants), methods=["GET"]),
        Route("/tenants/{name}", page(tenant), methods=["GET"]),
        Route("/audit", page(audit), methods=["GET"]),
        Route("/evidence", page(evidence), methods=["GET"]),
        Route("/login", login, methods=["GET"]),
        Route("/enroll", enroll, methods=["GET"]),
        Route("/console/qr", qr, methods=["POST"]),
    ]


#: every path the console serves (its pages, the QR helper, its static files)
PATHS = frozenset({r.path for r in routes()} | {"/static"})
PUBLIC = frozenset({"/login", "/enroll", "/static"})  # no session needed (enroll: its own)


def install(app: Any) -> None:
    """Serve the console on ``app``: its pages and ``/static``."""
    for route in routes():
        app.router.routes.append(route)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
