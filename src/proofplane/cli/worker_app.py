"""The application each worker process of ``serve --workers N`` builds (issue 20 §3).

uvicorn starts N processes and each imports this factory: the parent has already migrated
the database, checked the KMS and installed the bootstrap admin, and hands the database URL
down in ``PROOFPLANE_SERVE_URL``; everything else comes from the same ``PROOFPLANE_*``
variables the parent read. Every process serves requests; the background loops run in the one
that holds the database's leader lease (``workers.leader``), and each process's scheduler cache
catches up from the event stream when another process writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proofplane.api.app import create_app
from proofplane.api.tls_scope import ClientCertProtocol
from proofplane.pki import tls as pki_tls
from proofplane.service.context import Store

SERVE_URL_ENV = "PROOFPLANE_SERVE_URL"


def app_from_env() -> FastAPI:
    """One worker process's application (uvicorn ``factory=True``)."""
    from proofplane.cli.server import load_execution, load_settings, load_sink_policy

    url = os.environ[SERVE_URL_ENV]
    store = Store(url)  # migrated by the parent
    store.sink_policy = load_sink_policy()
    return create_app(store, load_settings(), load_execution(url), settle_heap=True)


class TlsContextFactory:
    """uvicorn's ``ssl_context_factory`` that survives the trip to a spawned worker process
    (a module-level class pickles; a lambda does not)."""

    def __init__(self, tls: pki_tls.ServerTls) -> None:
        self.tls = tls

    def __call__(self, _config: Any, _default: Any) -> Any:
        return self.tls.context()


class _NoDelay:
    """Turn Nagle's algorithm off on each connection. asyncio does so itself only for a
    socket whose ``proto`` is TCP, and the listening socket uvicorn's supervisor hands its
    worker processes was made with ``proto`` 0: without this, every keep-alive response waits
    out the client's delayed ACK (a steady 40 ms per request, measured)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)  # type: ignore[misc]


class NoDelayHttpToolsProtocol(_NoDelay, HttpToolsProtocol):
    """uvicorn's httptools protocol (its C parser, what a single-process ``serve`` uses),
    Nagle off: plain HTTP worker processes. With h11 the workers spent more CPU a request
    than the one-process server (issue 12's profile of ``--workers 2``)."""


class NoDelayClientCertProtocol(_NoDelay, ClientCertProtocol):
    """The client-certificate protocol, Nagle off (TLS worker processes)."""
