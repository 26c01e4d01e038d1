"""The FastAPI application: health probes, the /api/v1 routes, one error shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import text

from proofplane import __version__
from proofplane.api import (
    errors,
    route_index,
    routes_access,
    routes_attest,
    routes_audit,
    routes_backends,
    routes_changes,
    routes_evidence,
    routes_incidents,
    routes_keys,
    routes_metrics,
    routes_network,
    routes_oidc,
    routes_runbooks,
    routes_sinks,
    routes_telemetry,
    routes_usage,
)
from proofplane.api.deps import public
from proofplane.api.middleware_errors import ServerErrors
from proofplane.api.middleware_headers import DOCS_CONTENT_SECURITY_POLICY, SecurityHeaders
from proofplane.api.middleware_limits import BodyLimit, route_limits
from proofplane.api.middleware_metrics import HttpMetrics
from proofplane.api.middleware_overload import Overload, limiter_for
from proofplane.api.request_body import checked_json_body
from proofplane.api.routes import router
from proofplane.config import ExecutionSettings, Settings
from proofplane.errors import ProofplaneError
from proofplane.service import access as access_svc
from proofplane.service import alerts as alerts_svc
from proofplane.service import audit as audit_svc
from proofplane.service import changes as changes_svc
from proofplane.service import execution as execution_svc
from proofplane.service import heap, instruments
from proofplane.service import keys as keys_svc
from proofplane.service.access import last_used
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.web import console
from proofplane.workers import (
    SyncWorker,
    checkpoint_worker,
    export_worker,
    stale_worker,
    sync_worker,
)
from proofplane.workers.alerts import alert_worker
from proofplane.workers.change_reviews import review_worker
from proofplane.workers.leader import leadership_for
from proofplane.workers.telemetry import telemetry_worker


@contextmanager
def _execution(
    app: FastAPI, store: Store, execution: ExecutionSettings | None
) -> Iterator[SyncWorker | None]:
    """While the server runs: the store's engine (the one it has, else built from
    ``execution``) and the reconciliation worker every ``execution.sync_interval_s``. Without
    ``execution`` the store is left as it is."""
    if execution is None:
        yield None
        return
    given = store.backend
    backend = given or execution_svc.build_backend(execution)
    store.backend = app.state.backend = backend
    try:
        with sync_worker(store, backend, execution.sync_interval_s) as syncer:
            yield syncer
    finally:
        store.backend = given


def create_app(
    store: Store,
    settings: Settings | None = None,
    execution: ExecutionSettings | None = None,
    *,
    settle_heap: bool = False,
) -> FastAPI:
    """The API on ``store``. ``execution`` (``config.execution_from_env()``; ``serve`` and ``up``
    pass it): while the server runs, placed workloads are dispatched to that engine (built at
    start unless the store already has one) and reconciled every ``sync_interval_s``. Without
    it and without ``store.backend``, placements are decisions only. ``settle_heap`` (``serve``
    and its workers): once started, the process's garbage collector is set for a serving
    process (``service.heap``); a test's process keeps Python's defaults."""
    settings = settings or Settings()
    # The KMS (PROOFPLANE_KMS): a bad setting (a master key file others can read, an HSM
    # library that is missing…) fails here, at start, with its message (a KmsError).
    # (No store: an application built only for its route table.)
    kms = keys_svc.kms_for(store) if store is not None else None
    # The alert rules file (PROOFPLANE_ALERT_RULES): a mistake fails here, at start, too.
    if settings.alerts is not None and settings.alerts.interval_s:
        alerts_svc.load_rules(settings.alerts.rules_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The SIEM exporter runs while the server serves (PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS).
        with (
            export_worker(store, settings.siem_export_interval_s) as worker,
            checkpoint_worker(
                store, app.state.audit_keys, settings.audit_checkpoint_interval_s
            ) as checkpointer,
            _execution(app, store, execution) as syncer,
            stale_worker(
                store,
                settings.attest_stale_check_interval_s,
                timedelta(seconds=settings.attest_grace_s),
            ) as stale,
            review_worker(store, settings.change_review_check_interval_s) as reviews,
            telemetry_worker(
                store, settings.telemetry_interval_s, settings.telemetry_raw_hours
            ) as telemetry,
            alert_worker(
                store,
                settings.alerts,
                cluster=settings.cluster_id,
                attest_grace_s=settings.attest_grace_s,
            ) as alerter,
        ):
            app.state.telemetry_worker = telemetry
            app.state.alert_worker = alerter
            app.state.attest_stale_checker = stale
            app.state.change_reviews = reviews
            app.state.siem_exporter = worker
            app.state.audit_checkpointer = checkpointer
            app.state.execution_sync = syncer
            instruments.watch_gc()
            if settle_heap:  # a serving worker: its collector set for a long-lived heap
                heap.settle()
            probe = asyncio.create_task(instruments.probe_loop_lag())
            try:
                yield
            finally:
                probe.cancel()
                # the tokens' "last used" times this process noted and has not written
                if store is not None:
                    last_used.flush_for(store)

    app = FastAPI(
        title="proofplane",
        version=__version__,
        description="Control plane for attested, compliance-aware GPU clusters.",
        lifespan=lifespan,
        # Every JSON body: at most 64 levels deep, and text (issue 19, §2).
        dependencies=[Depends(checked_json_body)],
        # /docs loads Swagger UI from a CDN: only where PROOFPLANE_API_DOCS asks for it.
        docs_url="/docs" if settings.api_docs else None,
        redoc_url=None,
    )
    app.state.store = store
    app.state.settings = settings
    if store is not None:  # the mode the change register and incident bundles record
        changes_svc.set_control_mode(store, settings.change_control)
    app.state.kms = kms
    app.state.audit_keys = audit_svc.AuditKeys(
        origin=audit_svc.origin_for(settings.cluster_id),
        key_file=Path(settings.audit_key_file) if settings.audit_key_file else None,
    )
    errors.install(app)
    app.add_middleware(ServerErrors)  # a missed exception: a 500 with a request id, one log line
    app.include_router(router)
    app.include_router(routes_access.router)
    app.include_router(routes_oidc.router)
    app.include_router(routes_sinks.router)
    app.include_router(routes_audit.router)
    app.include_router(routes_keys.router)
    app.include_router(routes_backends.router)
    app.include_router(routes_attest.router)
    app.include_router(routes_incidents.router)
    app.include_router(routes_runbooks.router)
    app.include_router(routes_network.router)
    app.include_router(routes_changes.router)
    app.include_router(routes_metrics.router)
    app.include_router(routes_telemetry.router)
    app.include_router(routes_usage.router)
    app.include_router(routes_evidence.router)
    console.install(app)  # the web console's pages at / and its /static files (issue 16)
    # Request bodies: settings.max_body_bytes, a node's evidence its own (issue 19, §3);
    # security headers on every answer, the 413 included (§6).
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        routes=route_limits(
            routes_attest.router.routes, {routes_attest.evidence: settings.max_evidence_bytes}
        ),
    )
    # Outside Starlette's own outermost layer too, so that its 500 answers carry them.
    docs_csp = {"/docs": DOCS_CONTENT_SECURITY_POLICY} if settings.api_docs else {}
    # Overload (issue 20, §4): requests in flight per level and per client, outside everything
    # but the security headers, so a refusal costs nothing and still carries them; its counters
    # are app.state.overload.snapshot() (this worker process's), also on /readyz.
    overload = app.state.overload = limiter_for(
        settings.max_inflight,
        settings.max_inflight_client_share,
        settings.max_queue,
        {level: ms / 1000 for level, ms in settings.max_queue_wait_ms.items()},
    )
    known = (
        None
        if store is None
        else lambda token: access_svc.token_is_known(store, token, datetime.now(UTC))
    )
    build_stack = app.build_middleware_stack
    # HTTP latency by route template (issue 15, §3), refusals included: inside the headers,
    # outside the limiter
    app.build_middleware_stack = lambda: SecurityHeaders(  # type: ignore[method-assign]
        HttpMetrics(Overload(build_stack(), overload, known)),
        docs_csp,
    )

    @app.get("/healthz", tags=["health"], dependencies=[Depends(public)])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], response_model=None, dependencies=[Depends(public)])
    def readyz() -> dict[str, Any] | JSONResponse:
        """Readiness: the database answers, its schema is at the code's migration head, and
        the KMS can be used (checkpoints are signed, secrets opened through it)."""
        try:
            with store.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            current = migrate.current_revision(store.engine)
        except Exception as exc:
            return errors.error_response(503, "database_unavailable", str(exc).splitlines()[0])
        head = migrate.head_revision()
        if current != head:
            return errors.error_response(
                503,
                "migrations_pending",
                f"database schema is at {current}, code expects {head}: run proofplane db upgrade",
                {"current": current, "head": head},
            )
        backend = keys_svc.kms_for(store).backend
        try:
            backend.check()
        except Exception as exc:
            message = exc.message if isinstance(exc, ProofplaneError) else str(exc)
            return errors.error_response(
                503, "kms_unavailable", f"the KMS ({backend.kind}) cannot be used: {message}"
            )
        return {
            "status": "ready",
            "database": store.engine.dialect.name,
            "revision": current,
            "kms": backend.kind,
            "change_control": settings.change_control,
            # whether this process runs the deployment's background loops (workers/leader.py)
            "background": "leader" if leadership_for(store).leading else "follower",
            "overload": overload.snapshot(),  # this worker process's requests in flight
        }

    # Each request matched only against the routes its path prefix allows (api/route_index.py):
    # the same route chosen, without walking all ~150 patterns (issue 12's profile).
    route_index.install(app.router)
    return app
