"""Alembic environment: migrations always run on the engine proofplane hands over."""

from __future__ import annotations

from alembic import context

from proofplane.store.tables import Base

engine = context.config.attributes["engine"]
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
