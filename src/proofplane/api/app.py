"""The FastAPI application: health probes, the /api/v1 routes, one error shape."""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import text

from proofplane import __version__
from proofplane.api import errors, routes_access, routes_oidc
from proofplane.api.deps import public
from proofplane.api.routes import router
from proofplane.config import Settings
from proofplane.service.context import Store
from proofplane.store import migrate


def create_app(store: Store, settings: Settings | None = None) -> FastAPI:
    app = FastAPI(
        title="proofplane",
        version=__version__,
        description="Control plane for attested, compliance-aware GPU clusters.",
    )
    app.state.store = store
    app.state.settings = settings or Settings()
    errors.install(app)
    app.include_router(router)
    app.include_router(routes_access.router)
    app.include_router(routes_oidc.router)

    @app.get("/healthz", tags=["health"], dependencies=[Depends(public)])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], response_model=None, dependencies=[Depends(public)])
    def readyz() -> dict[str, str] | JSONResponse:
        """Readiness: the database answers and its schema is at the code's migration head."""
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
        return {"status": "ready", "database": store.engine.dialect.name, "revision": current}

    return app
