"""The agents of `proofplane up`'s swtpm nodes (:mod:`proofplane.demo.swtpm`): each runs the
node agent's own round (:func:`proofplane.cli.agent.attest_once`) on its node's swtpm and speaks
HTTP to the API, in process (the app on the same store, through an ASGI transport), so the
demo admits them while it loads, before the server listens. Their evidence is real TPM evidence
and is not marked simulated.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from proofplane.access import SYSTEM
from proofplane.agent.tpm import swtpm
from proofplane.agent.tpm.tpm2tools import Tpm
from proofplane.api.app import create_app
from proofplane.cli.agent import AK_HANDLE, EK_HANDLE, attest_once
from proofplane.cli.client import ApiClient
from proofplane.demo.attester import RealAgent
from proofplane.demo.swtpm import SwtpmAgent, SwtpmFleet
from proofplane.model import Node
from proofplane.service import attestation as svc
from proofplane.service.access import issue_agent_credential
from proofplane.service.context import Store

assert swtpm.AK_HANDLES["ecc"] == AK_HANDLE and swtpm.EK_HANDLE == EK_HANDLE


class AppTransport(httpx.BaseTransport):
    """Synchronous HTTP to an ASGI app in this process (``httpx.ASGITransport`` is async
    only): each request runs in an event loop of its own, from any thread."""

    def __init__(self, app: Any) -> None:
        self._asgi = httpx.ASGITransport(app=app)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def send() -> httpx.Response:
            req = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            resp = await self._asgi.handle_async_request(req)
            content = await resp.aread()
            return httpx.Response(resp.status_code, headers=resp.headers, content=content)

        return anyio.run(send)


class HttpAgent:
    """One swtpm node's agent: the agent's round, on its TPM, its log and its inventory."""

    def __init__(self, node: SwtpmAgent, api: ApiClient) -> None:
        self.node = node
        self.name = node.name
        self.api = api

    def round(self) -> svc.AttestOutcome:
        scratch = self.node.tpm.workdir / "agent"
        scratch.mkdir(exist_ok=True)
        agent_tpm = Tpm(self.node.tpm.tcti, scratch)
        out = attest_once(self.api, self.name, agent_tpm, eventlog=self.node.eventlog,
                          inventory=self.node.inventory)  # fmt: skip
        return svc.AttestOutcome(out["node"], out["evidence_id"], out["verdict"], out["state"],
                                 out["state_reason"])  # fmt: skip


class HttpAgents:
    """The fleet's nodes attested by their agents over HTTP (``RealAgents`` for
    :func:`proofplane.demo.attester.load_attested_demo`); ``stop`` also stops the fleet."""

    def __init__(self, fleet: SwtpmFleet) -> None:
        self.fleet = fleet
        self.agents: list[HttpAgent] = []

    @property
    def node_class(self) -> str:
        return self.fleet.node_class

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.fleet.nodes

    def policy(self, nodes: list[Node]) -> dict[str, Any]:
        return self.fleet.policy(nodes)

    def connect(self, store: Store) -> list[RealAgent]:
        """Give each node's agent its credential and a client of the API on ``store``."""
        transport = AppTransport(create_app(store))
        for node in self.fleet.agents:
            token = issue_agent_credential(store, SYSTEM, node.name, ttl_days=1).token
            api = ApiClient("http://proofplane.demo", token=token, transport=transport)
            self.agents.append(HttpAgent(node, api))
        return list(self.agents)

    def stop(self) -> None:
        """Close the agents' clients, then stop every swtpm and remove their state."""
        try:
            for a in self.agents:
                a.api.close()
        finally:
            self.fleet.stop()
