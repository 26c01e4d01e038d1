"""Shared fixtures: every store and API test runs against SQLite and the real PostgreSQL.

PostgreSQL: the server on 127.0.0.1:5432 (trust auth; override with PROOFPLANE_TEST_PG_URL).
Each run creates a migrated template database, and each test gets a throwaway copy of it
(CREATE DATABASE … TEMPLATE), dropped afterwards. Without PostgreSQL the tests that need it
are skipped locally and fail in CI (CI=true): a missing dependency never passes silently.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

# starlette 1.x nudges TestClient users towards httpx2; httpx is our client library.
warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
from fastapi.testclient import TestClient

from ci import unavailable
from dbtest import ADMIN_TOKEN, PG_ADMIN, demo_text, pg_admin, pg_url
from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

# The CLI renders Rich tables to the width of the terminal; test output is no terminal, and
# pytest-xdist workers get none of the parent's size either: pin a wide one so the assertions
# on table cells do not depend on how the suite is run.
os.environ["COLUMNS"] = "200"

RUN_ID = uuid.uuid4().hex[:8]


_pg_url = pg_url
_admin = pg_admin


@pytest.fixture(scope="session", autouse=True)
def _audit_key_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The audit signing key goes to a temporary file, never the user's data directory."""
    previous = os.environ.get("PROOFPLANE_AUDIT_KEY_FILE")
    path = tmp_path_factory.mktemp("audit-key") / "audit-signing.key"
    os.environ["PROOFPLANE_AUDIT_KEY_FILE"] = str(path)
    yield
    if previous is None:
        os.environ.pop("PROOFPLANE_AUDIT_KEY_FILE", None)
    else:
        os.environ["PROOFPLANE_AUDIT_KEY_FILE"] = previous


@pytest.fixture(scope="session", autouse=True)
def _master_key_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The embedded KMS's master key is a temporary file, never the user's data directory."""
    previous = {n: os.environ.get(n) for n in ("PROOFPLANE_MASTER_KEY_FILE", "PROOFPLANE_KMS")}
    os.environ["PROOFPLANE_MASTER_KEY_FILE"] = str(tmp_path_factory.mktemp("kms") / "master.key")
    os.environ.pop("PROOFPLANE_KMS", None)
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def _sink_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """File sinks write into a temporary directory, never the user's data directory; the
    tests keep their sinks' certificates in their own temporary directories, so the TLS
    directory is the whole tree here (tests/siem/test_sink_hardening.py checks the confinement
    with a real one)."""
    settings = {
        "PROOFPLANE_SINK_DIR": str(tmp_path_factory.mktemp("sinks")),
        "PROOFPLANE_SINK_TLS_DIR": "/",
    }
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """Name of a migrated template database for this test run."""
    try:
        conn = _admin()
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL unreachable at {PG_ADMIN}: {exc}")
    name = f"pp_tmpl_{RUN_ID}"
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    store = Store(_pg_url(name))
    migrate.upgrade(store.engine)
    store.dispose()
    yield name
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated, empty database of each kind."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'proofplane.db'}"
        store = Store(url)
        migrate.upgrade(store.engine)
        store.dispose()
        yield url
        return
    template = request.getfixturevalue("pg_template")
    name = f"pp_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    yield _pg_url(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


@pytest.fixture
def admin_token() -> str:
    return ADMIN_TOKEN


@pytest.fixture
def client(store: Store) -> Iterator[TestClient]:
    """An API client holding the bootstrap admin token (PROOFPLANE_ADMIN_TOKEN's mechanism)."""
    bootstrap_admin(store, ADMIN_TOKEN)
    with TestClient(
        create_app(store),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as c:
        yield c


@pytest.fixture
def demo(store: Store) -> Store:
    """The store with the shipped demo cluster loaded."""
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    return store
