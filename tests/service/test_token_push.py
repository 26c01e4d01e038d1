"""Revocations pushed between processes on PostgreSQL (issue 20): a token check cached for
minutes is dropped milliseconds after another process revokes the token, and a lost push
connection empties the cache and falls back to the short TTL until it is back."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from dbtest import ADMIN_TOKEN, pg_admin, pg_url
from proofplane.access import Unauthenticated
from proofplane.service import access as svc
from proofplane.service.access import token_push
from proofplane.service.access.token_cache import cache_for
from proofplane.service.context import Store

REVOKE = (  # another process: revokes a token by id, as an admin, and exits
    "import sys\n"
    "from datetime import UTC, datetime\n"
    "from proofplane.service import access as svc\n"
    "from proofplane.service.context import Store\n"
    "s = Store(sys.argv[1])\n"
    "admin = svc.authenticate(s, sys.argv[2], datetime.now(UTC))\n"
    "svc.revoke_token(s, admin, sys.argv[3])\n"
    "s.dispose()\n"
)


@pytest.fixture
def pg_store(pg_template: str) -> Iterator[Store]:
    name = f"pp_push_{uuid.uuid4().hex[:8]}"
    with pg_admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    store = Store(pg_url(name))
    try:
        svc.bootstrap_admin(store, ADMIN_TOKEN)
        yield store
    finally:
        store.dispose()
        with pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _listening(store: Store) -> token_push.Listener:
    svc.authenticate(store, ADMIN_TOKEN, datetime.now(UTC))  # the first check starts it
    listener = token_push.listener_for(store)
    assert listener is not None
    assert listener.wait_listening(10)
    return listener


def _issue(store: Store) -> svc.IssuedToken:
    admin = svc.authenticate(store, ADMIN_TOKEN, datetime.now(UTC))
    return svc.issue_token(store, admin, roles=None, tenants=None, expires_in=3600, name="ci")


def _refused_within(store: Store, token: str, seconds: float) -> float:
    """Seconds until ``token`` is refused as revoked (fails after ``seconds``)."""
    start = time.monotonic()
    while True:
        try:
            svc.authenticate(store, token, datetime.now(UTC))
        except Unauthenticated as exc:
            assert exc.code == "invalid_token"
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, "the revocation did not reach this process"
        time.sleep(0.005)


def test_a_check_covered_by_the_push_outlives_the_short_ttl(pg_store: Store) -> None:
    _listening(pg_store)
    cache = cache_for(pg_store)
    cache.ttl = 0.05
    issued = _issue(pg_store)
    actor = svc.authenticate(pg_store, issued.token, datetime.now(UTC))
    time.sleep(0.2)  # past the short TTL, within the pushed one
    reads = cache.misses
    assert svc.authenticate(pg_store, issued.token, datetime.now(UTC)) == actor
    assert cache.misses == reads


def test_another_process_revocation_is_pushed_at_once(pg_store: Store) -> None:
    listener = _listening(pg_store)
    cache = cache_for(pg_store)
    cache.ttl = 0.05  # only the push can keep the entry past this
    issued = _issue(pg_store)
    svc.authenticate(pg_store, issued.token, datetime.now(UTC))
    notices = listener.notices
    subprocess.run(
        [sys.executable, "-c", REVOKE, pg_store.url, ADMIN_TOKEN, issued.id],
        check=True,
        timeout=120,
    )
    assert _refused_within(pg_store, issued.token, 2.0) < 2.0
    assert listener.notices > notices  # by the notice, not by the entry's age


def test_a_rolled_back_change_pushes_nothing(pg_store: Store) -> None:
    listener = _listening(pg_store)
    issued = _issue(pg_store)
    actor = svc.authenticate(pg_store, issued.token, datetime.now(UTC))
    time.sleep(0.3)  # notices of the issue itself, if any, have arrived
    notices = listener.notices
    from sqlalchemy import select

    from proofplane.store.tables import TokenRow

    with pytest.raises(RuntimeError), pg_store.write(actor) as tx:
        row = tx.session.scalar(select(TokenRow).where(TokenRow.id == issued.id))
        assert row is not None
        row.revoked_at = tx.now
        tx.session.flush()  # the NOTIFY is sent within the transaction...
        raise RuntimeError("and the transaction rolls back")
    time.sleep(0.5)
    assert listener.notices == notices  # ...and PostgreSQL drops it with the rollback
    assert svc.authenticate(pg_store, issued.token, datetime.now(UTC)) == actor


def test_a_lost_connection_empties_the_cache_and_the_listener_comes_back(
    pg_store: Store,
) -> None:
    listener = _listening(pg_store)
    cache = cache_for(pg_store)
    issued = _issue(pg_store)
    svc.authenticate(pg_store, issued.token, datetime.now(UTC))
    assert len(cache) >= 1
    connects = listener.connects
    database = pg_store.engine.url.database
    with pg_admin() as conn:
        killed = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = %s",
            (token_push.APPLICATION_NAME, database),
        ).fetchall()
    assert killed == [(True,)]
    deadline = time.monotonic() + 10
    while listener.connects == connects:  # it noticed, emptied the cache, connected again
        assert time.monotonic() < deadline, "the listener did not come back"
        time.sleep(0.02)
    assert listener.wait_listening(10)
    assert cache.push is listener.push
    # The entry read before the break was dropped with the cache; a new check reads again.
    misses = cache.misses
    svc.authenticate(pg_store, issued.token, datetime.now(UTC))
    assert cache.misses == misses + 1


def test_an_entry_read_before_the_listen_is_not_covered() -> None:
    push = token_push.Push()
    assert not push.covers(1.0, 2.0)  # not listening
    push.since = push.alive_at = 5.0
    assert not push.covers(4.9, 6.0)  # read before the LISTEN took effect
    assert push.covers(5.0, 6.0)
    assert not push.covers(5.0, 5.0 + token_push.ALIVE_S + 1)  # no health check answered since


def test_notices_parse_and_foreign_payloads_are_ignored() -> None:
    assert token_push.parse('{"t": ["ab"], "u": [3]}') == ({"ab"}, {3})
    for bad in ("", "x", "{}", '{"t": 1, "u": []}', '{"t": [], "u": ["x"]}', "[]"):
        assert token_push.parse(bad) is None


def test_sqlite_has_no_listener(store: Store) -> None:
    svc.bootstrap_admin(store, ADMIN_TOKEN)
    svc.authenticate(store, ADMIN_TOKEN, datetime.now(UTC))
    if store.engine.dialect.name == "sqlite":
        assert token_push.listener_for(store) is None
        assert cache_for(store).push is None
    else:
        assert token_push.listener_for(store) is not None
