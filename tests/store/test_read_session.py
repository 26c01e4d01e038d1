"""Read sessions (``store.db.read_session``, issue 20): on PostgreSQL a read runs in autocommit,
without the BEGIN and COMMIT round trips a transaction would add (under READ COMMITTED each
statement takes its own snapshot either way); a streaming read (``yield_per``, a server-side
cursor) still gets its transaction. SQLite's reads are unchanged."""

from __future__ import annotations

from psycopg.pq import TransactionStatus
from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.service.context import Store
from proofplane.store.tables import EventRow


def _record(store: Store, n: int) -> None:
    with store.write(SYSTEM) as tx:
        for i in range(n):
            tx.record("test.read", "item", f"i{i}")


def test_a_read_runs_without_a_transaction_on_postgresql_and_a_stream_in_one(
    store: Store,
) -> None:
    _record(store, 5)
    postgres = store.engine.dialect.name == "postgresql"
    with store.read() as s:
        assert s.scalar(select(EventRow.seq).order_by(EventRow.seq.desc()).limit(1)) == 5
        dbapi = s.connection().connection.dbapi_connection
        if postgres:  # the statement ran and committed alone: no transaction is open
            assert dbapi.info.transaction_status == TransactionStatus.IDLE
            assert dbapi.autocommit is True
        else:
            assert s.get_bind() is store.engine
    with store.read(streaming=True) as s:
        query = select(EventRow.target_id).order_by(EventRow.seq).execution_options(yield_per=2)
        assert list(s.scalars(query)) == [f"i{i}" for i in range(5)]  # three server batches
        if postgres:
            dbapi = s.connection().connection.dbapi_connection
            assert dbapi.info.transaction_status == TransactionStatus.INTRANS
    # the pool's connection is back in its default mode for the writes that check it out next
    _record(store, 1)
    with store.read() as s:
        assert s.scalar(select(EventRow.seq).order_by(EventRow.seq.desc()).limit(1)) == 6
