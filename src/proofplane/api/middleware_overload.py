"""Overload is refused, not queued (issue 20, §4): bounded requests in flight per worker process,
per priority level and per client, as an ASGI middleware.

Without it a flood of console reads, or ten thousand agents at once, queued in uvicorn's thread
pool and then in the database pool until every request, attestation included, took seconds and
the agents' rounds timed out. Now each level (attestation, reads, writes: :mod:`.overload`) has
its own slots, one client at most its share of them, and a request that finds none waits at
most its level's short wait (or not at all, when the wait it would have is longer) before it
is answered 429 ``too_many_requests`` with ``Retry-After``, in the API's error shape.
``/healthz`` and ``/readyz`` are exempt. The time each request held its slot is measured here
and feeds the level's estimate of the wait.

The thread pool that runs the synchronous endpoints (anyio's default limiter, 40 threads) is
raised to the slots of all levels plus :data:`THREAD_HEADROOM`, so an admitted request never
queues for a thread and the exempt probes always find one.

A client is its bearer token (a hash prefix: the token itself is never kept) once the server
has accepted that token, else its session cookie likewise, else its address. Behind a proxy
that hides addresses, the clients without a known token share one budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Mapping

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proofplane.api import deps
from proofplane.api.overload import (
    CLIENT_SHARE,
    LEVELS,
    MAX_WAIT_S,
    QUEUE_WAIT,
    Budget,
    Limiter,
    Refused,
    Ticket,
    classify,
)

#: Threads beyond the levels' slots: for the exempt probes and the server's own work.
THREAD_HEADROOM = 8
#: Seconds a refused client is asked to wait (it adds its own jitter).
RETRY_AFTER_S = 1
SESSION_COOKIE = deps.SESSION_COOKIE.encode()


def limiter_for(
    limits: Mapping[str, int],
    client_share: float,
    queues: Mapping[str, int] | None = None,
    waits_s: Mapping[str, float] | None = None,
) -> Limiter:
    """A limiter with ``limits[level]`` slots per level, ``client_share`` of each to a client,
    ``queues[level]`` places in its queue (default: half its slots) and ``waits_s[level]`` the
    longest wait there (default ``MAX_WAIT_S``)."""
    return Limiter(
        {
            level: Budget.of(
                limits[level],
                client_share,
                None if queues is None else queues[level],
                MAX_WAIT_S if waits_s is None else waits_s[level],
            )
            for level in LEVELS
        }
    )


def client_key(scope: Scope, known: Callable[[str], bool] | None = None) -> str:
    """Who is asking: ``t:`` and a hash prefix of the bearer token, ``s:`` of the session
    cookie, else ``a:`` and the peer address. With ``known`` (is this a token the server has
    accepted?), a token it does not know counts as its address: the check runs before
    authentication, and a caller sending a fresh made-up token with every request must not
    become a new client each time and take a whole level."""
    token = cookie = None
    for name, value in scope.get("headers") or ():
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            token = value[7:].strip()
        elif name == b"cookie" and SESSION_COOKIE in value:
            cookie = _session_cookie(value)
    for prefix, credential in (("t:", token), ("s:", cookie)):
        if credential and (known is None or known(credential.decode("latin-1"))):
            return prefix + hashlib.sha256(credential).hexdigest()[:16]
    peer = scope.get("client")
    return f"a:{peer[0]}" if peer else "a:?"


def _session_cookie(header: bytes) -> bytes | None:
    for part in header.split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == SESSION_COOKIE and value:
            return value
    return None


def refusal(refused: Refused) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The 429 answer in the API's error shape: status, headers, body."""
    if refused.reason == CLIENT_SHARE:
        message = (
            f"too many {refused.level} requests in flight from this client (at most "
            f"{refused.limit} at once); retry after {RETRY_AFTER_S} s"
        )
    elif refused.reason == QUEUE_WAIT:
        message = (
            f"the server's {refused.limit} {refused.level} slots are taken and the wait for "
            f"one would be longer than it queues requests; retry after {RETRY_AFTER_S} s"
        )
    else:
        message = (
            f"the server is at its limit of {refused.limit} {refused.level} requests in "
            f"flight; retry after {RETRY_AFTER_S} s"
        )
    details = {
        "level": refused.level,
        "reason": refused.reason,
        "limit": refused.limit,
        "retry_after_s": RETRY_AFTER_S,
    }
    body = json.dumps(
        {"error": {"code": "too_many_requests", "message": message, "details": details}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    return 429, headers, body


class Overload:
    """ASGI middleware: admit a request into its level's budget, or refuse it with 429."""

    def __init__(
        self,
        app: ASGIApp,
        limiter: Limiter,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.known = known
        self.threads = limiter.total + THREAD_HEADROOM

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        level = classify(scope.get("method", "GET"), scope.get("path", ""))
        if level is None:
            await self.app(scope, receive, send)
            return
        self._size_thread_pool()
        client = client_key(scope, self.known)
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:  # from the thread of whichever request freed the slot
            loop.call_soon_threadsafe(woken.set)

        got = self.limiter.acquire(level, client, wake)
        if isinstance(got, Ticket):
            got = await self._wait(got, woken)
        if isinstance(got, Refused):
            await _answer(send, got)
            return
        admitted = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:  # the answer is complete, failed or abandoned: the slot is free
            self.limiter.release(level, client, time.perf_counter() - admitted)

    async def _wait(self, ticket: Ticket, woken: asyncio.Event) -> bool | Refused:
        try:
            await asyncio.wait_for(woken.wait(), self.limiter.budget(ticket.level).max_wait_s)
        except TimeoutError:
            pass
        except BaseException:  # cancelled (the client went away): give the slot back
            if self.limiter.give_up(ticket) is None:
                self.limiter.release(ticket.level, ticket.client)
            raise
        refused = self.limiter.give_up(ticket)
        return True if refused is None else refused

    def _size_thread_pool(self) -> None:
        """This event loop's thread pool: at least the levels' slots and some headroom."""
        pool = anyio.to_thread.current_default_thread_limiter()
        if pool.total_tokens < self.threads:
            pool.total_tokens = self.threads


async def _answer(send: Send, refused: Refused) -> None:
    status, headers, body = refusal(refused)
    start: Message = {"type": "http.response.start", "status": status, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": body})
