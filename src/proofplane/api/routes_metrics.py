"""``GET /metrics``: the Prometheus exposition of the control plane's health and its fleet
(issue 15, §3; what it holds: ``service.metrics``).

Access: the ``metrics:read`` permission, like every other route a role grants. It holds the
fleet of every tenant (names, what each holds), so it is global: ``admin``, ``operator``,
``auditor``, ``security-officer`` and the ``monitoring`` role, a Prometheus server's identity
that may do nothing else. A scrape configuration carries an API token of a ``monitoring`` user
(``authorization: {credentials_file: …}``); ``/metrics`` is never anonymous, not even on
loopback, as a reverse proxy in front of the server would make every client look local.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import ErrorResponse
from proofplane.service import metrics as svc
from proofplane.service.context import Store

router = APIRouter(
    tags=["observability"],
    responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}},  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
Scraper = Annotated[Actor, Depends(requires(P.METRICS_READ))]


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
def metrics(store: StoreDep, actor: Scraper) -> Response:
    """The control plane's own health (decision and HTTP latency, pending work by reason,
    attestation verdicts, the audit log and its checkpoints, SIEM sinks, KMS operations) and
    the fleet (GPUs and MIG slices held per tenant and compliance pool, free capacity per
    pool, utilisation per tenant under DCGM field names), in the Prometheus text format."""
    body, content_type = svc.render(store, actor)
    return Response(body, media_type=content_type)
