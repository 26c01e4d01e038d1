"""Overload is refused, not queued (issue 20, §4).

Each priority level (the agents' attestation routes, reads, writes) has its own requests in
flight per worker process, one client at most its share of them; past that a request waits a
few milliseconds at most and is answered 429 ``too_many_requests`` with ``Retry-After``, in the
API's error shape. The health probes are exempt, and a slot is freed however the request ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio.to_thread
import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

from dbtest import ADMIN_TOKEN
from proofplane.api.app import create_app
from proofplane.api.middleware_overload import THREAD_HEADROOM, Overload, client_key, limiter_for
from proofplane.api.overload import (
    ATTESTATION,
    CLIENT_SHARE,
    LEVEL_FULL,
    QUEUE_WAIT,
    READ,
    WRITE,
    Budget,
    Limiter,
    Refused,
    Ticket,
    classify,
)
from proofplane.config import MAX_INFLIGHT, MAX_QUEUE, MAX_QUEUE_WAIT_MS, Settings, from_env
from proofplane.errors import ValidationFailed
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store

MAX_WAIT_S = 0.05
# A refusal comes after at most the queue wait; the margin is for a loaded 2-core test box.
REFUSAL_BOUND_S = MAX_WAIT_S + 0.15


# -- the classifier ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "level"),
    [
        ("POST", "/api/v1/nodes/n1/attestation/evidence", ATTESTATION),
        ("POST", "/api/v1/nodes/n1/attestation/nonce", ATTESTATION),
        ("POST", "/api/v1/nodes/n1/attestation/enroll", ATTESTATION),
        ("POST", "/api/v1/nodes/n1/attestation/activate", ATTESTATION),
        ("POST", "/api/v1/nodes/n1/agent-certificate", ATTESTATION),
        ("GET", "/api/v1/pki/ca", ATTESTATION),
        ("GET", "/api/v1/pki/crl", ATTESTATION),
        ("GET", "/api/v1/nodes/n1/attestation", READ),  # the console's view of it
        ("GET", "/api/v1/nodes/n1/evidence", READ),
        ("GET", "/api/v1/nodes", READ),
        ("HEAD", "/api/v1/nodes", READ),
        ("GET", "/", READ),
        ("get", "/api/v1/workloads", READ),
        ("POST", "/api/v1/workloads", WRITE),
        ("PUT", "/api/v1/attestation/policy", WRITE),
        ("PATCH", "/api/v1/nodes/n1", WRITE),
        ("DELETE", "/api/v1/tokens/x", WRITE),
        ("POST", "/api/v1/nodes/n1/attestation/evidence/extra", WRITE),
        ("POST", "/api/v1/nodes/a/b/attestation/evidence", WRITE),
        ("POST", "/api/v1/login", WRITE),
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
    ],
)
def test_classify(method: str, path: str, level: str | None) -> None:
    assert classify(method, path) == level


def test_client_key_is_the_token_hash_else_the_session_else_the_address() -> None:
    def scope(*headers: tuple[bytes, bytes], client: Any = ("10.0.0.7", 5000)) -> dict[str, Any]:
        return {"headers": list(headers), "client": client}

    bearer = client_key(scope((b"authorization", b"Bearer ppt_secret-token-123")))
    assert bearer.startswith("t:") and "secret" not in bearer and len(bearer) == 18
    assert bearer == client_key(scope((b"authorization", b"bearer ppt_secret-token-123")))
    assert bearer != client_key(scope((b"authorization", b"Bearer ppt_other")))
    session = client_key(scope((b"cookie", b"a=b; proofplane_session=s3cret; c=d")))
    assert session.startswith("s:") and "s3cret" not in session
    assert client_key(scope()) == "a:10.0.0.7"
    assert client_key(scope((b"authorization", b"Basic abc"))) == "a:10.0.0.7"
    assert client_key(scope(client=None)) == "a:?"


# -- the limiter --------------------------------------------------------------------------------


def limiter(attestation: int = 4, read: int = 4, write: int = 2, share: float = 0.5) -> Limiter:
    return limiter_for({ATTESTATION: attestation, READ: read, WRITE: write}, share)


def nothing() -> None:
    pass


def test_budget_shares() -> None:
    assert Budget.of(32, 0.5) == Budget(32, 16, 16, 8)
    assert Budget.of(1, 0.5) == Budget(1, 1, 1, 1)
    assert Budget.of(5, 1.0) == Budget(5, 5, 2, 2)
    with pytest.raises(ValueError):
        Budget.of(0, 0.5)
    with pytest.raises(ValueError):
        Budget.of(4, 0)
    with pytest.raises(ValueError):
        Limiter({READ: Budget.of(1, 1)})
    # a queue and a wait of its own: the write level's (few slots, a longer queue and wait)
    assert Budget.of(4, 0.5, 16, 0.25) == Budget(4, 2, 16, 8, 0.25)
    assert Budget.of(4, 0.5).max_wait_s == 0.05
    for queue, wait in ((0, 0.05), (4, -0.001), (4, 61.0)):
        with pytest.raises(ValueError):
            Budget.of(4, 0.5, queue, wait)


def test_a_request_whose_wait_would_run_out_is_refused_at_once() -> None:
    """The expected wait is the place in the queue times a request's hold time (a moving
    average of what the requests measured) over the level's slots."""
    lim = limiter_for({ATTESTATION: 4, READ: 2, WRITE: 2}, 1.0, {ATTESTATION: 2, READ: 8,
                      WRITE: 2}, {ATTESTATION: 0.05, READ: 0.05, WRITE: 0.05})  # fmt: skip
    assert lim.snapshot()[READ]["hold_ms"] is None
    assert lim.acquire(READ, "a", nothing) is True
    lim.release(READ, "a", 0.04)  # 40 ms a request: two slots free up every 40 ms
    assert lim.snapshot()[READ]["hold_ms"] == 40.0
    assert lim.acquire(READ, "a", nothing) is True and lim.acquire(READ, "b", nothing) is True
    first = lim.acquire(READ, "c", nothing)  # 1 x 40 / 2 = 20 ms: it waits
    second = lim.acquire(READ, "d", nothing)  # 2 x 40 / 2 = 40 ms: it waits
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    assert lim.acquire(READ, "e", nothing) == Refused(READ, QUEUE_WAIT, 2)  # 60 ms: no
    snap = lim.snapshot()[READ]
    assert snap["queued"] == 2 and snap["refused"][QUEUE_WAIT] == 1
    # the average follows what requests take now (weight 0.2 for the newest)
    lim.release(READ, "a", 0.0)
    assert lim.snapshot()[READ]["hold_ms"] == 32.0
    assert first.granted
    lim.release(READ, "b", 0.0)
    lim.release(READ, "c", 0.0)
    assert lim.snapshot()[READ]["hold_ms"] == 20.48 and second.granted
    assert lim.acquire(READ, "a", nothing) is True  # d holds the other slot
    assert isinstance(lim.acquire(READ, "e", nothing), Ticket)  # 1 x 20.48 / 2 ms
    # a release without a measured time (a request given up) leaves the average alone
    lim.release(READ, "d")
    assert lim.snapshot()[READ]["hold_ms"] == 20.48
    # the other levels know nothing of it
    assert lim.snapshot()[WRITE]["hold_ms"] is None


def test_a_client_at_its_share_queues_behind_itself_whatever_the_hold_time() -> None:
    """The expected wait refuses only when every slot of the level is taken: a client that
    holds its share of a level with free slots waits for its own requests (as a burst from
    one client into an idle server does), and one very slow request counts at most as the
    level's slots times its wait (here 4 x 50 ms)."""
    lim = limiter(read=4, share=0.5)
    assert lim.acquire(READ, "a", nothing) is True
    lim.release(READ, "a", 30.0)  # a worker's first request, say
    assert lim.snapshot()[READ]["hold_ms"] == 200.0
    assert lim.acquire(READ, "a", nothing) is True and lim.acquire(READ, "a", nothing) is True
    assert isinstance(lim.acquire(READ, "a", nothing), Ticket)
    assert lim.snapshot()[READ]["refused"][QUEUE_WAIT] == 0


def test_levels_are_separate_budgets() -> None:
    lim = limiter(share=1.0)
    assert all(lim.acquire(READ, f"c{i}", nothing) is True for i in range(4))
    queued = lim.acquire(READ, "c9", nothing)
    assert isinstance(queued, Ticket)
    assert lim.acquire(READ, "c10", nothing) is not True
    assert lim.acquire(ATTESTATION, "c0", nothing) is True
    assert lim.acquire(WRITE, "c0", nothing) is True
    snap = lim.snapshot()
    assert snap[READ]["in_flight"] == 4 and snap[READ]["queued"] == 2
    assert snap[ATTESTATION]["in_flight"] == snap[WRITE]["in_flight"] == 1


def test_a_client_gets_its_share_and_no_more() -> None:
    lim = limiter(read=4, share=0.5)
    assert lim.acquire(READ, "flood", nothing) is True
    assert lim.acquire(READ, "flood", nothing) is True
    waiting = lim.acquire(READ, "flood", nothing)  # a place in the queue (1 per client)
    assert isinstance(waiting, Ticket)
    refused = lim.acquire(READ, "flood", nothing)
    assert refused == Refused(READ, CLIENT_SHARE, 2)
    assert lim.acquire(READ, "other", nothing) is True  # the level still admits others
    assert lim.give_up(waiting) == Refused(READ, CLIENT_SHARE, 2)
    snap = lim.snapshot()[READ]
    assert snap["in_flight"] == 3 and snap["clients"] == 2 and snap["queued"] == 0
    assert snap["refused"] == {CLIENT_SHARE: 2, LEVEL_FULL: 0, QUEUE_WAIT: 0}


def test_a_freed_slot_goes_to_the_first_waiter_under_its_share() -> None:
    lim = limiter(read=4, share=0.5)  # 2 per client; 2 places in the queue, 1 per client
    woken: list[str] = []
    for client in ("a", "a", "b", "b"):
        assert lim.acquire(READ, client, nothing) is True
    a3 = lim.acquire(READ, "a", lambda: woken.append("a3"))  # a holds its share already
    c1 = lim.acquire(READ, "c", lambda: woken.append("c1"))
    assert isinstance(a3, Ticket) and isinstance(c1, Ticket)
    lim.release(READ, "b")  # a is at its share: c's waiter gets the slot, past a's
    assert woken == ["c1"] and c1.granted and not a3.granted
    assert lim.give_up(c1) is None  # its time ran out as it was handed over: it holds it
    lim.release(READ, "a")
    assert woken == ["c1", "a3"] and a3.granted
    snap = lim.snapshot()[READ]
    assert snap["in_flight"] == 4 and snap["admitted"] == 6 and snap["admitted_after_wait"] == 2
    assert snap["peak_in_flight"] == 4 and snap["clients"] == 3
    for client in ("a", "a", "b", "c"):
        lim.release(READ, client)
    assert lim.snapshot()[READ]["in_flight"] == 0 and lim.snapshot()[READ]["clients"] == 0


def test_the_queue_is_bounded() -> None:
    lim = limiter(write=2, share=1.0)  # one place in the queue
    assert lim.acquire(WRITE, "a", nothing) is True
    assert lim.acquire(WRITE, "b", nothing) is True
    assert isinstance(lim.acquire(WRITE, "c", nothing), Ticket)
    assert lim.acquire(WRITE, "d", nothing) == Refused(WRITE, LEVEL_FULL, 2)


# -- the middleware, with a slow endpoint -------------------------------------------------------


class SlowApp:
    """An ASGI app whose ``/slow`` requests wait for :meth:`finish`; ``/boom`` raises."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = 0

    def finish(self) -> None:
        self.gate.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path.endswith("/boom"):
            raise RuntimeError("boom")
        if "slow" in scope.get("query_string", b"").decode() or path.endswith("/slow"):
            self.started += 1
            await self.gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def run(
    body: Callable[[httpx.AsyncClient, SlowApp, Limiter], Awaitable[None]],
    lim: Limiter | None = None,
) -> None:
    lim = lim or limiter()
    app = SlowApp()
    transport = httpx.ASGITransport(app=Overload(app, lim))

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await body(c, app, lim)

    asyncio.run(main())


def as_client(n: int | str) -> dict[str, str]:
    return {"Authorization": f"Bearer ppt_client-{n}"}


async def hang(
    c: httpx.AsyncClient,
    app: SlowApp,
    n: int,
    method: str,
    path: str,
    kw: Callable[[int], dict[str, Any]],
) -> list[asyncio.Task[httpx.Response]]:
    """Start ``n`` requests (the i-th with ``kw(i)``) that stay in flight until
    ``app.finish()``."""
    started = app.started
    tasks = [asyncio.create_task(c.request(method, path, **kw(i))) for i in range(n)]
    while app.started < started + n:
        await asyncio.sleep(0.001)
    return tasks


def refused(r: httpx.Response, level: str, reason: str) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"code", "message", "details"} and err["code"] == "too_many_requests"
    assert err["details"]["level"] == level and err["details"]["reason"] == reason
    assert err["details"]["retry_after_s"] == 1


def test_over_the_limit_is_refused_fast_and_other_levels_still_admit() -> None:
    async def body(c: httpx.AsyncClient, app: SlowApp, lim: Limiter) -> None:
        reads = await hang(c, app, 4, "GET", "/api/v1/nodes/slow", kw=lambda i: {
            "headers": as_client(i)})  # fmt: skip
        t = time.perf_counter()
        r = await c.get("/api/v1/nodes", headers=as_client("late"))
        took = time.perf_counter() - t
        refused(r, READ, LEVEL_FULL)
        assert took <= REFUSAL_BOUND_S, took
        assert "4 read requests" in r.json()["error"]["message"]
        # the flood of reads takes nothing from the agents or the writers
        ok = await c.post("/api/v1/nodes/n1/attestation/evidence", headers=as_client(0))
        assert ok.status_code == 200
        assert (await c.post("/api/v1/workloads", headers=as_client(0))).status_code == 200
        assert (await c.get("/healthz")).status_code == 200  # nor from the probes
        assert (await c.get("/readyz")).status_code == 200
        snap = lim.snapshot()
        assert snap[READ]["in_flight"] == 4 and snap[READ]["refused"][LEVEL_FULL] == 1
        assert snap[ATTESTATION]["admitted"] == snap[WRITE]["admitted"] == 1
        app.finish()
        assert [r.status_code for r in await asyncio.gather(*reads)] == [200] * 4
        assert lim.snapshot()[READ]["in_flight"] == 0

    run(body, limiter(share=1.0))


def test_a_flooding_client_cannot_take_the_whole_level() -> None:
    async def body(c: httpx.AsyncClient, app: SlowApp, lim: Limiter) -> None:
        mine = await hang(c, app, 2, "GET", "/api/v1/nodes/slow", kw=lambda i: {
            "headers": as_client("flood")})  # fmt: skip
        t = time.perf_counter()
        more = await asyncio.gather(
            *(c.get("/api/v1/nodes", headers=as_client("flood")) for _ in range(5))
        )
        assert time.perf_counter() - t <= REFUSAL_BOUND_S
        for r in more:
            refused(r, READ, CLIENT_SHARE)
        # other clients (by token, by session, by address) still get in
        assert (await c.get("/api/v1/nodes", headers=as_client("b"))).status_code == 200
        cookie = {"Cookie": "proofplane_session=abc"}
        assert (await c.get("/api/v1/nodes", headers=cookie)).status_code == 200
        assert (await c.get("/api/v1/nodes")).status_code == 200
        app.finish()
        await asyncio.gather(*mine)

    run(body, limiter(read=4, share=0.5))


def test_a_waiter_gets_a_slot_freed_within_the_wait() -> None:
    async def body(c: httpx.AsyncClient, app: SlowApp, lim: Limiter) -> None:
        hung = await hang(c, app, 2, "POST", "/api/v1/workloads/slow", kw=lambda i: {
            "headers": as_client(i)})  # fmt: skip
        waiting = asyncio.create_task(c.post("/api/v1/workloads", headers=as_client("w")))
        while lim.snapshot()[WRITE]["queued"] == 0:
            await asyncio.sleep(0.001)
        app.finish()
        assert (await waiting).status_code == 200
        await asyncio.gather(*hung)
        snap = lim.snapshot()[WRITE]
        assert snap["admitted_after_wait"] == 1 and snap["in_flight"] == 0
        assert snap["refused"] == {CLIENT_SHARE: 0, LEVEL_FULL: 0, QUEUE_WAIT: 0}

    run(body, limiter(write=2, share=1.0))


def test_the_middleware_times_each_request_and_refuses_a_wait_that_would_run_out() -> None:
    """Requests that held their slots 300 ms each (counted as 200 ms: a slow request counts at
    most as four slots times the 50 ms wait): with every slot taken, the first in the queue
    would wait 50 ms, which it may; the second 100 ms, longer than the level queues a request:
    429 at once, with the reason, not after the wait."""

    async def body(c: httpx.AsyncClient, app: SlowApp, lim: Limiter) -> None:
        slow = await hang(c, app, 4, "GET", "/api/v1/nodes/slow", kw=lambda i: {
            "headers": as_client(i)})  # fmt: skip
        await asyncio.sleep(0.3)
        app.finish()
        await asyncio.gather(*slow)
        assert lim.snapshot()[READ]["hold_ms"] == 200.0
        app.gate = asyncio.Event()
        hung = await hang(c, app, 4, "GET", "/api/v1/nodes/slow", kw=lambda i: {
            "headers": as_client(i)})  # fmt: skip
        first = asyncio.create_task(c.get("/api/v1/nodes", headers=as_client("first")))
        while lim.snapshot()[READ]["queued"] == 0:
            await asyncio.sleep(0.001)
        t = time.perf_counter()
        r = await c.get("/api/v1/nodes", headers=as_client("late"))
        assert time.perf_counter() - t < REFUSAL_BOUND_S
        refused(r, READ, QUEUE_WAIT)
        assert "would be longer" in r.json()["error"]["message"]
        assert lim.snapshot()[READ]["refused"][QUEUE_WAIT] == 1
        app.finish()
        await asyncio.gather(*hung)
        assert (await first).status_code in (200, 429)  # served, or its 50 ms ran out first

    run(body, limiter(read=4, share=1.0))


def test_slots_are_freed_after_an_exception_and_a_client_going_away() -> None:
    async def body(c: httpx.AsyncClient, app: SlowApp, lim: Limiter) -> None:
        with pytest.raises(RuntimeError):
            await c.get("/api/v1/boom")
        assert lim.snapshot()[READ]["in_flight"] == 0
        hung = await hang(c, app, 2, "GET", "/api/v1/nodes/slow", kw=lambda i: {
            "headers": as_client(i)})  # fmt: skip
        waiting = asyncio.create_task(c.get("/api/v1/nodes", headers=as_client("w")))
        while lim.snapshot()[READ]["queued"] == 0:
            await asyncio.sleep(0.001)
        assert lim.snapshot()[READ]["in_flight"] == 2
        for task in (*hung, waiting):  # the clients go away: the requests are cancelled
            task.cancel()
        await asyncio.gather(*hung, waiting, return_exceptions=True)
        snap = lim.snapshot()[READ]
        assert snap["in_flight"] == 0 and snap["queued"] == 0 and snap["clients"] == 0
        assert (await c.get("/api/v1/nodes")).status_code == 200

    run(body, limiter(read=2, share=1.0))


def test_the_thread_pool_is_larger_than_the_slots() -> None:
    lim = limiter_for(MAX_INFLIGHT, 0.5)

    async def main() -> float:
        app = Overload(SlowApp(), lim)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.get("/api/v1/nodes")).status_code == 200
        return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert asyncio.run(main()) >= sum(MAX_INFLIGHT.values()) + THREAD_HEADROOM


# -- in the API -----------------------------------------------------------------------------------


def test_the_api_refuses_in_its_error_shape_with_its_security_headers(store: Store) -> None:
    settings = Settings(
        max_inflight={ATTESTATION: 2, READ: 2, WRITE: 1},
        max_queue={ATTESTATION: 1, READ: 1, WRITE: 1},
    )
    app = create_app(store, settings)
    lim: Limiter = app.state.overload
    assert lim.budget(READ) == Budget(2, 1, 1, 1)
    for client in ("x", "y"):  # two requests of others in flight
        assert lim.acquire(READ, client, nothing) is True

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            t = time.perf_counter()
            r = await c.get("/api/v1/nodes", headers=as_client("z"))
            assert time.perf_counter() - t <= REFUSAL_BOUND_S
            refused(r, READ, LEVEL_FULL)
            assert r.headers["x-content-type-options"] == "nosniff"
            ready = await c.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["overload"][READ]["refused"][LEVEL_FULL] == 1
            assert ready.json()["overload"][READ]["in_flight"] == 2

    asyncio.run(main())


# -- settings -------------------------------------------------------------------------------------


def test_settings_from_the_environment() -> None:
    s = from_env({})
    assert s.max_inflight == MAX_INFLIGHT == {ATTESTATION: 8, READ: 6, WRITE: 16}
    assert s.max_queue == MAX_QUEUE == {ATTESTATION: 8, READ: 3, WRITE: 8}
    assert s.max_queue_wait_ms == MAX_QUEUE_WAIT_MS == {ATTESTATION: 50, READ: 50, WRITE: 500}
    assert s.max_inflight_client_share == 0.5
    s = from_env(
        {
            "PROOFPLANE_MAX_INFLIGHT_ATTESTATION": "64",
            "PROOFPLANE_MAX_INFLIGHT_READ": "8",
            "PROOFPLANE_MAX_INFLIGHT_WRITE": "4",
            "PROOFPLANE_MAX_INFLIGHT_CLIENT_SHARE": "0.25",
            "PROOFPLANE_MAX_QUEUE_READ": "1",
            "PROOFPLANE_MAX_QUEUE_WRITE": "1024",
            "PROOFPLANE_MAX_QUEUE_WAIT_MS": "0",  # every level...
            "PROOFPLANE_MAX_QUEUE_WAIT_MS_WRITE": "1000",  # ...but this one
        }
    )
    assert s.max_inflight == {ATTESTATION: 64, READ: 8, WRITE: 4}
    assert s.max_queue == {ATTESTATION: 8, READ: 1, WRITE: 1024}
    assert s.max_queue_wait_ms == {ATTESTATION: 0, READ: 0, WRITE: 1000}
    assert s.max_inflight_client_share == 0.25
    s = from_env({"PROOFPLANE_MAX_QUEUE_WAIT_MS_READ": "10"})
    assert s.max_queue_wait_ms == {ATTESTATION: 50, READ: 10, WRITE: 500}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PROOFPLANE_MAX_INFLIGHT_READ", "0"),
        ("PROOFPLANE_MAX_INFLIGHT_READ", "many"),
        ("PROOFPLANE_MAX_INFLIGHT_WRITE", "-1"),
        ("PROOFPLANE_MAX_INFLIGHT_ATTESTATION", "5000"),
        ("PROOFPLANE_MAX_INFLIGHT_CLIENT_SHARE", "0"),
        ("PROOFPLANE_MAX_INFLIGHT_CLIENT_SHARE", "1.5"),
        ("PROOFPLANE_MAX_QUEUE_WAIT_MS", "5000"),
        ("PROOFPLANE_MAX_QUEUE_WAIT_MS", "nan"),
        ("PROOFPLANE_MAX_QUEUE_WAIT_MS_WRITE", "-1"),
        ("PROOFPLANE_MAX_QUEUE_WAIT_MS_ATTESTATION", "1001"),
        ("PROOFPLANE_MAX_QUEUE_READ", "0"),
        ("PROOFPLANE_MAX_QUEUE_WRITE", "2000"),
    ],
)
def test_bad_settings_are_refused_by_name(name: str, value: str) -> None:
    with pytest.raises(ValidationFailed) as err:
        from_env({name: value})
    assert err.value.code == "invalid_setting" and name in err.value.message


def test_a_real_server_under_a_flood_answers_200_or_429_and_frees_every_slot(
    store: Store,
) -> None:
    """uvicorn, the synchronous endpoints in its thread pool: 40 reads at once from one client
    against 4 read slots (2 for one client) get 200s and fast 429s, never a 5xx; the probes
    answer meanwhile; afterwards nothing is in flight."""
    from concurrent.futures import ThreadPoolExecutor

    from live_server import serve
    from proofplane.service.access import bootstrap_admin

    token = "ppt_test-admin-token-0123456789abcdef"
    bootstrap_admin(store, token)
    settings = Settings(cookie_secure=False, max_inflight={ATTESTATION: 4, READ: 4, WRITE: 2})
    with serve(store, settings) as url, httpx.Client(base_url=url, timeout=30) as c:
        auth = {"Authorization": f"Bearer {token}"}
        # the server names a client by its token once it has accepted it (until then by its
        # address): two sequential requests first, so the flood is one client throughout
        warm_up = 2
        for _ in range(warm_up):
            assert c.get("/api/v1/auth/me", headers=auth).status_code == 200

        def read(_i: int) -> tuple[int, float, httpx.Response]:
            t = time.perf_counter()
            r = c.get("/api/v1/nodes", headers=auth)
            return r.status_code, time.perf_counter() - t, r

        with ThreadPoolExecutor(40) as pool:
            flood = pool.map(read, range(40))
            assert c.get("/healthz").status_code == 200
            answers = list(flood)
        statuses = sorted({s for s, _, _ in answers})
        assert set(statuses) <= {200, 429}, statuses
        assert 200 in statuses
        for status, _took, r in answers:
            if status == 429:
                refused(r, READ, r.json()["error"]["details"]["reason"])
                assert r.headers["x-frame-options"] == "DENY"
        snap = c.get("/readyz").json()["overload"][READ]
        assert snap["in_flight"] == 0 and snap["queued"] == 0
        assert snap["admitted"] + sum(snap["refused"].values()) == 40 + warm_up
        assert snap["peak_in_flight"] <= 2  # one client: its share of the level


def test_a_token_the_server_does_not_know_counts_as_the_address() -> None:
    """The limiter runs before authentication: a caller inventing a new token per request
    must not become a new client each time (and take the whole level)."""

    def scope(token: bytes) -> dict[str, Any]:
        return {"headers": [(b"authorization", b"Bearer " + token)], "client": ("10.0.0.9", 1)}

    accepted = {"ppt_real-token"}
    keys = {client_key(scope(f"ppt_made-up-{i}".encode()), accepted.__contains__) for i in range(5)}
    assert keys == {"a:10.0.0.9"}
    real = client_key(scope(b"ppt_real-token"), accepted.__contains__)
    assert real.startswith("t:") and real == client_key(scope(b"ppt_real-token"))


def test_the_app_names_clients_by_tokens_it_has_accepted(store: Store) -> None:
    from proofplane.service.access import token_is_known

    bootstrap_admin(store, ADMIN_TOKEN)
    now = datetime.now(UTC)
    assert not token_is_known(store, ADMIN_TOKEN, now)  # not checked yet
    with TestClient(create_app(store), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        # the first check notes "last used", which drops the entry; the second is kept
        assert c.get("/api/v1/auth/me").status_code == 200
        assert c.get("/api/v1/auth/me").status_code == 200
    assert token_is_known(store, ADMIN_TOKEN, now)
    assert not token_is_known(store, "ppt_made-up", now)
