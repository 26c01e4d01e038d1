"""Persistence: SQLAlchemy tables, engines for SQLite and PostgreSQL, Alembic migrations."""
