"""A real proofplane API server for CLI and agent tests: uvicorn on a free loopback port, in a
thread, ready when ``/healthz`` answers; stopped (and its store disposed) on exit.

With ``tls`` (``proofplane.pki.tls.ServerTls``) it serves HTTPS with the API's TLS policy, the
way ``proofplane serve --tls-cert …`` does, and is ready when uvicorn says it has started (a
probe could not always pass the handshake: client certificates may be required)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from proofplane.api.app import create_app
from proofplane.api.tls_scope import ClientCertProtocol
from proofplane.config import ExecutionSettings, Settings
from proofplane.pki.tls import ServerTls
from proofplane.service.context import Store


def free_port() -> int:
    """A loopback port nothing listens on (once the probe socket is closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(
    store: Store,
    settings: Settings | None = None,
    execution: ExecutionSettings | None = None,
    *,
    tls: ServerTls | None = None,
) -> Iterator[str]:
    """Serve ``store``'s API (``execution``: its engine settings, e.g. the sync interval;
    ``tls``: HTTPS on these files); yields the base URL. Fails the test if it does not come up."""
    port = free_port()
    ssl_options: dict[str, object] = {}
    if tls is not None:  # as serve does: its policy, and client certificates reach the app
        ssl_options = {"ssl_context_factory": lambda _c, _d: tls.context(),
                       "http": ClientCertProtocol}  # fmt: skip
    srv = uvicorn.Server(
        uvicorn.Config(
            create_app(store, settings or Settings(cookie_secure=False), execution),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            **ssl_options,  # type: ignore[arg-type]
        )
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"{'http' if tls is None else 'https'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        if tls is not None:
            if srv.started:
                break
        else:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
        if not thread.is_alive() or time.monotonic() > deadline:
            srv.should_exit = True
            pytest.fail("the test server did not start")
        time.sleep(0.05)
    try:
        yield url
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        store.dispose()
