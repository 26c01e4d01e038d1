"""Database helpers shared by conftest.py and the tests that need them outside a fixture.

A test module imports these from here, never ``from conftest import …``: with more than one
conftest.py on the path (tests/keys, tests/siem) the name ``conftest`` is whichever was
imported first, so such an import works alone and fails in a full run.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Engine

from proofplane.store import migrate

PG_ADMIN = os.environ.get("PROOFPLANE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
ADMIN_TOKEN = "ppt_test-admin-token-0123456789abcdef"


def pg_url(dbname: str) -> str:
    """The SQLAlchemy URL of database ``dbname`` on the test PostgreSQL server."""
    base = PG_ADMIN.rsplit("/", 1)[0]
    return f"{base}/{dbname}".replace("postgresql://", "postgresql+psycopg://", 1)


def pg_admin() -> psycopg.Connection:
    """An autocommit connection to the test server's maintenance database."""
    return psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)


def demo_text() -> str:
    """The shipped demo cluster file."""
    return (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text()


def migrate_to(engine: Engine, revision: str) -> None:
    """Downgrade (or upgrade) the schema of ``engine`` to ``revision``, then back to head: a
    migration's down and up paths, as its test walks them."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrate.MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    command.downgrade(cfg, revision)
    assert migrate.current_revision(engine) == revision
    command.upgrade(cfg, "head")
    assert migrate.is_current(engine)


def traced_statements(store: Any) -> list[str]:
    """Every SQL statement run on ``store``'s connections from here on, appended as it runs:
    on SQLite the DB-API connection's own trace (which also sees what the hot paths run on it
    directly; the pool is emptied so that its connections are traced from their start, and
    with it the per-pool caches), on PostgreSQL each cursor execution."""
    seen: list[str] = []
    if store.engine.dialect.name == "sqlite":

        @event.listens_for(store.engine, "connect")
        def trace(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.set_trace_callback(seen.append)

        store.engine.dispose()
    else:

        @event.listens_for(store.engine, "before_cursor_execute")
        def counted(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
            seen.append(statement)

    return seen
