"""Run Alembic migrations programmatically (``serve``/``up`` do it on start; ``db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from proofplane.store.db import erase_freed_pages

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(_config(engine), revision)
    # A migration may have replaced secrets in place (0012 seals plaintext): on SQLite the
    # write-ahead log would keep the old pages until a truncating checkpoint.
    erase_freed_pages(engine)


def downgrade(engine: Engine, revision: str) -> None:
    """Step the schema back to ``revision`` (tests of a migration's data carry-over)."""
    command.downgrade(_config(engine), revision)


def head_revision() -> str:
    script = ScriptDirectory.from_config(_config_without_engine())
    head = script.get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def is_current(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()


def _config_without_engine() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg
