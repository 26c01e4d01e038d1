"""The client certificate of a TLS connection, handed to the application.

uvicorn (0.54) does not fill the ASGI TLS extension, so a route cannot see which certificate
the client presented. ``ClientCertProtocol`` is uvicorn's h11 protocol plus that: when the TLS
handshake of a connection carried a client certificate (``--tls-client-ca``: the chain was
checked by the TLS layer), every request on the connection gets
``scope["extensions"]["tls"]["client_cert_chain"] = [PEM]`` (the extension's own layout).
``api.deps.current_actor`` reads it: a node agent's channel certificate is its identity.

When the server asks for client certificates (a client CA: mutual TLS, required or optional),
every request also gets ``scope["extensions"]["tls"][CLIENT_CA] = True``, whether or not this
client showed one: in that mode a node that holds a certificate must use it (its bearer agent
credential is then for enrolling and asking for a certificate only)."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

CLIENT_CA = "proofplane_client_ca"  # the server verifies client certificates (mutual TLS)


class ClientCertProtocol(H11Protocol):
    """uvicorn's h11 protocol with the client certificate in each request's scope."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return
        der = ssl_object.getpeercert(binary_form=True)
        client_ca = ssl_object.context.verify_mode != ssl.CERT_NONE
        if not der and not client_ca:
            return
        tls = {"client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
               CLIENT_CA: client_ca}  # fmt: skip
        inner = self.app

        async def app(scope: Any, receive: Any, send: Any) -> None:
            extensions = dict(scope.get("extensions") or {})
            extensions["tls"] = {**extensions.get("tls", {}), **tls}
            scope["extensions"] = extensions
            await inner(scope, receive, send)

        self.app = app
