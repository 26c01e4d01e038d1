"""The in-process token cache (issue 20): a cached token check reads nothing from the
database; a revocation, a disabled user or a role change made in this process takes effect at
once, one made by another process within the TTL; expiry is checked on every request."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event, select

from proofplane.access import SYSTEM, Role, Unauthenticated
from proofplane.config import token_cache_ttl_s
from proofplane.errors import ValidationFailed
from proofplane.model import Tenant
from proofplane.service import access as svc
from proofplane.service import tenants as tenants_svc
from proofplane.service.access import last_used
from proofplane.service.access.token_cache import TokenCache, cache_for
from proofplane.service.context import Store
from proofplane.store.tables import TokenRow

PASSWORD = "correct horse battery staple"


@contextmanager
def counted(store: Store) -> Iterator[list[str]]:
    """The SQL statements ``store`` runs inside the block."""
    seen: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", count)


def _user_token(store: Store, name: str = "dev1") -> str:
    """A password session of a developer of tenant ``lab`` (a role that needs no MFA)."""
    if not tenants_svc.list_tenants(store, SYSTEM).items:
        tenants_svc.create_tenant(store, SYSTEM, Tenant("lab"))
    svc.create_user(store, SYSTEM, name, PASSWORD, ["developer"], ["lab"])
    return svc.login(store, name, PASSWORD, None, session_ttl=timedelta(hours=1)).token


def test_a_cached_token_reads_nothing(store: Store) -> None:
    token = _user_token(store)
    now = datetime.now(UTC)
    first = svc.authenticate(store, token, now)  # reads; its "last used" waits for the batch
    with counted(store) as sql:
        for _ in range(50):
            assert svc.authenticate(store, token, now) == first
    assert sql == []
    assert cache_for(store).hits >= 50


def _last_used(store: Store) -> datetime | None:
    with store.read() as session:
        return session.scalar(select(TokenRow.last_used_at).where(TokenRow.kind == "session"))


def test_last_used_is_noted_at_most_every_five_minutes_and_written_in_a_batch(
    store: Store,
) -> None:
    token = _user_token(store)
    batch = last_used.for_store(store)
    now = datetime.now(UTC)
    with counted(store) as sql:
        for k in range(20):
            svc.authenticate(store, token, now + timedelta(seconds=k))
    assert not [s for s in sql if s.lstrip().upper().startswith("UPDATE")]  # noted, not written
    assert batch.waiting() == 1
    with counted(store) as sql:
        assert batch.flush() == 1
    assert len([s for s in sql if s.lstrip().upper().startswith("UPDATE")]) == 1
    assert _last_used(store) == now
    # Stored: the cached entry carries the time, so nothing is due for five minutes.
    svc.authenticate(store, token, now + timedelta(minutes=4))
    assert batch.waiting() == 0
    svc.authenticate(store, token, now + timedelta(minutes=6))  # due again
    assert batch.waiting() == 1
    batch.flush()
    assert _last_used(store) == now + timedelta(minutes=6)


def test_many_tokens_last_used_land_in_one_transaction(store: Store) -> None:
    tokens = [_user_token(store, f"dev{i}") for i in range(12)]
    batch = last_used.for_store(store)
    now = datetime.now(UTC)
    for token in tokens:
        svc.authenticate(store, token, now)
    writes = batch.writes
    assert batch.flush() == len(tokens)
    assert batch.writes == writes + 1
    with store.read() as session:
        times = session.scalars(select(TokenRow.last_used_at).where(TokenRow.kind == "session"))
        assert list(times) == [now] * len(tokens)


def test_the_timer_writes_what_waits_and_dispose_writes_the_rest(db_url: str) -> None:
    store = Store(db_url)
    token = _user_token(store)
    batch = last_used.for_store(store)
    batch.delay = 0.05
    now = datetime.now(UTC)
    svc.authenticate(store, token, now)
    deadline = time.monotonic() + 10
    while _last_used(store) is None:
        assert time.monotonic() < deadline, "the timer did not write the batch"
        time.sleep(0.02)
    assert _last_used(store) == now
    batch.delay = 3600.0  # from here only dispose writes
    svc.authenticate(store, token, now + timedelta(minutes=6))
    assert batch.waiting() == 1
    store.dispose()
    store = Store(db_url)
    assert _last_used(store) == now + timedelta(minutes=6)
    store.dispose()


def test_revoke_in_this_process_takes_effect_at_once(store: Store) -> None:
    svc.bootstrap_admin(store, "ppt_cache-admin-token-0123456789abcdef")
    admin = svc.authenticate(store, "ppt_cache-admin-token-0123456789abcdef", datetime.now(UTC))
    issued = svc.issue_token(store, admin, roles=None, tenants=None, expires_in=86400, name="ci")
    now = datetime.now(UTC)
    svc.authenticate(store, issued.token, now)
    svc.revoke_token(store, admin, issued.id)
    with pytest.raises(Unauthenticated) as err:
        svc.authenticate(store, issued.token, now)
    assert err.value.code == "invalid_token"


def test_logout_disable_and_role_change_take_effect_at_once(store: Store) -> None:
    token = _user_token(store, "ops2")
    now = datetime.now(UTC)
    actor = svc.authenticate(store, token, now)
    svc.logout(store, actor)
    with pytest.raises(Unauthenticated):
        svc.authenticate(store, token, now)

    token = svc.login(store, "ops2", PASSWORD, None, session_ttl=timedelta(hours=1)).token
    assert svc.authenticate(store, token, now).roles == frozenset({Role.DEVELOPER})
    svc.update_user(store, SYSTEM, "ops2", roles=["auditor"])  # a role taken away
    with pytest.raises(Unauthenticated):
        svc.authenticate(store, token, now)

    token = svc.login(store, "ops2", PASSWORD, None, session_ttl=timedelta(hours=1)).token
    svc.authenticate(store, token, now)
    svc.update_user(store, SYSTEM, "ops2", disabled=True)
    with pytest.raises(Unauthenticated) as err:
        svc.authenticate(store, token, now)
    assert err.value.code == "invalid_token"


def test_a_disabled_user_is_refused_and_not_cached(store: Store) -> None:
    token = _user_token(store, "ops3")
    svc.update_user(store, SYSTEM, "ops3", disabled=True)
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            svc.authenticate(store, token, datetime.now(UTC))
    assert len(cache_for(store)) == 0


def test_an_expired_token_is_refused_even_when_cached(store: Store) -> None:
    token = _user_token(store, "ops4")
    now = datetime.now(UTC)
    svc.authenticate(store, token, now)
    svc.authenticate(store, token, now)
    with counted(store) as sql, pytest.raises(Unauthenticated) as err:
        svc.authenticate(store, token, now + timedelta(hours=2))
    assert err.value.code == "token_expired"
    assert sql == []  # the cached entry's expiry said so


def test_another_process_revocation_is_seen_within_the_ttl(store: Store) -> None:
    """Another process (a worker, a replica) revokes: this one sees it within the TTL (on
    PostgreSQL sooner: the revocation is pushed)."""
    cache = cache_for(store)
    cache.ttl = 60.0  # while the other process starts
    token = _user_token(store, "dev5")
    now = datetime.now(UTC)
    actor = svc.authenticate(store, token, now)  # cached from here
    script = (
        "import sys\n"
        "from proofplane.service import access as svc\n"
        "from proofplane.service.context import Store\n"
        "from proofplane.access import Actor\n"
        "s = Store(sys.argv[1])\n"
        "svc.logout(s, Actor(sys.argv[2], token_id=sys.argv[3]))\n"
        "s.dispose()\n"
    )
    assert actor.token_id is not None
    subprocess.run(
        [sys.executable, "-c", script, store.url, actor.name, actor.token_id],
        check=True,
        timeout=120,
    )
    with store.read() as session:  # revoked in the database
        assert session.get(TokenRow, actor.token_id).revoked_at is not None  # type: ignore[union-attr]
    if store.engine.dialect.name == "sqlite":  # nothing pushed: still within its TTL here
        assert svc.authenticate(store, token, now) == actor
    # (PostgreSQL pushes the revocation at once: test_token_push.py.)
    if store.engine.dialect.name == "sqlite":
        # The entry now has one second left to live: the revocation must be seen by then.
        (entry,) = cache._entries.values()
        cache.ttl = time.monotonic() - entry.loaded + 1.0
        deadline = entry.loaded + cache.ttl + 0.5
    else:
        deadline = time.monotonic() + 1.0
    while True:
        try:
            svc.authenticate(store, token, datetime.now(UTC))
        except Unauthenticated as exc:
            assert exc.code == "invalid_token"
            break
        assert time.monotonic() < deadline, "the revocation was not seen within the TTL"
        time.sleep(0.05)


def test_a_change_committed_after_a_read_is_not_cached() -> None:
    cache = TokenCache(ttl=60)
    generation = cache.generation
    cache.invalidate({"h"}, set())  # a change committed while the check was reading
    from proofplane.service.access.token_cache import Entry

    cache.put("h", Entry(SYSTEM, datetime.now(UTC), None, None, time.monotonic()), generation)
    assert cache.get("h") is None


def test_the_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    from proofplane.service.access.token_cache import Entry

    cache = TokenCache(ttl=60, max_entries=3)
    entry = Entry(SYSTEM, datetime.now(UTC), None, None, time.monotonic())
    for key in "abc":
        cache.put(key, entry, cache.generation)
    assert cache.get("a") is entry  # a is now the most recent
    cache.put("d", entry, cache.generation)
    assert len(cache) == 3
    assert cache.get("b") is None
    assert cache.get("a") is entry


def test_ttl_zero_caches_nothing(store: Store) -> None:
    cache_for(store).ttl = 0
    token = _user_token(store, "ops6")
    now = datetime.now(UTC)
    svc.authenticate(store, token, now)
    with counted(store) as sql:
        svc.authenticate(store, token, now)
    assert sql


def test_ttl_setting() -> None:
    assert token_cache_ttl_s({}) == 2.0
    assert token_cache_ttl_s({"PROOFPLANE_TOKEN_CACHE_SECONDS": "0"}) == 0
    for bad in ("-1", "61", "nan", "x"):
        with pytest.raises(ValidationFailed):
            token_cache_ttl_s({"PROOFPLANE_TOKEN_CACHE_SECONDS": bad})


def test_the_server_writes_what_waits_when_it_stops(store: Store) -> None:
    from fastapi.testclient import TestClient

    from proofplane.api.app import create_app

    token = _user_token(store, "ops7")
    batch = last_used.for_store(store)
    batch.delay = 3600.0  # only the shutdown can write it
    with TestClient(create_app(store), headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.get("/api/v1/auth/me").status_code == 200
        assert batch.waiting() == 1
        assert _last_used(store) is None
    assert batch.waiting() == 0
    assert _last_used(store) is not None
    with TestClient(create_app(store)) as c:  # the store serves again: notes still count
        assert c.get("/healthz").status_code == 200
    svc.authenticate(store, token, datetime.now(UTC) + timedelta(minutes=6))
    assert batch.waiting() == 1


def test_a_store_used_after_dispose_gets_a_new_batch_cache_and_listener(store: Store) -> None:
    """``serve --workers N`` disposes the parent's store and uses it again at shutdown."""
    from proofplane.service.access import token_push

    token = _user_token(store, "ops8")
    now = datetime.now(UTC)
    svc.authenticate(store, token, now)
    batch, cache = last_used.for_store(store), cache_for(store)
    assert batch.waiting() == 1
    store.dispose()  # writes what waits; the engine opens new connections when used again
    assert _last_used(store) == now
    assert last_used.for_store(store) is not batch
    assert cache_for(store) is not cache
    svc.authenticate(store, token, now + timedelta(minutes=6))  # noted in the new batch
    assert last_used.for_store(store).flush() == 1
    assert _last_used(store) == now + timedelta(minutes=6)
    listener = token_push.listener_for(store)
    if store.engine.dialect.name == "postgresql":
        assert listener is not None and listener.wait_listening(10)
        assert cache_for(store).push is listener.push
    else:
        assert listener is None
