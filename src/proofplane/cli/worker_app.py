"""The application each worker process of ``serve --workers N`` builds (issue 20 §3).

uvicorn starts N processes and each imports this factory: the parent has already migrated
the database, checked the KMS and installed the bootstrap admin, and hands the database URL
down in ``PROOFPLANE_SERVE_URL``; everything else comes from the same ``PROOFPLANE_*``
variables the parent read. Every process serves requests; the background loops run in the one
that holds the database's leader lease (``workers.leader``), and each process's scheduler cache
catches up from the event stream when another process writes.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from proofplane.api.app import create_app
from proofplane.pki import tls as pki_tls
from proofplane.service.context import Store

SERVE_URL_ENV = "PROOFPLANE_SERVE_URL"


def app_from_env() -> FastAPI:
    """One worker process's application (uvicorn ``factory=True``)."""
    from proofplane.cli.server import load_execution, load_settings, load_sink_policy

    url = os.environ[SERVE_URL_ENV]
    store = Store(url)  # migrated by the parent
    store.sink_policy = load_sink_policy()
    return create_app(store, load_settings(), load_execution(url))


class TlsContextFactory:
    """uvicorn's ``ssl_context_factory`` that survives the trip to a spawned worker process
    (a module-level class pickles; a lambda does not)."""

    def __init__(self, tls: pki_tls.ServerTls) -> None:
        self.tls = tls

    def __call__(self, _config: Any, _default: Any) -> Any:
        return self.tls.context()
