"""Runbooks and a decommissioned node's sanitisation report under /api/v1 (issue 12).

``GET /runbooks`` lists the current version of every runbook (shipped, or published through a
``runbook.publish`` change); ``GET /runbooks/{id}`` shows one with its steps (``?version=N``
for an older one). Anyone who reads nodes may read them. ``POST /nodes/{name}/sanitisation``
takes the sanitisation report of a decommissioned node's agent (or of an operator relaying it).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, status
from pydantic import Field, StrictBool

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import agent_or, get_store, requires
from proofplane.api.schemas import BodyIn, ErrorResponse
from proofplane.govern.runbooks import MAX_VERSION
from proofplane.service import decommission
from proofplane.service import runbooks as svc
from proofplane.service.context import Store

router = APIRouter(
    prefix="/api/v1",
    tags=["governance"],
    responses={
        404: {"model": ErrorResponse},
        409: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    },  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
# Every role that reads the audit log also reads nodes: NODES_READ is the route's one rule; the
# service also accepts AUDIT_READ alone (a role holding only that).
Reader = Annotated[Actor, Depends(requires(P.NODES_READ))]
Agent = Annotated[Actor, Depends(agent_or(P.NODES_WRITE))]
RunbookId = Annotated[str, Path(max_length=63)]
NodeName = Annotated[str, Path(max_length=63)]


@router.get("/runbooks")
def list_runbooks(store: StoreDep, actor: Reader) -> dict[str, Any]:
    """The current version of every runbook: id, title, version, triggers, where it came from
    (``shipped`` or ``published`` with its event) and the versions it has."""
    return {"items": svc.list_runbooks(store, actor)}


@router.get("/runbooks/{runbook_id}")
def get_runbook(
    runbook_id: RunbookId,
    store: StoreDep,
    actor: Reader,
    version: Annotated[int | None, Query(ge=1, le=MAX_VERSION)] = None,
) -> dict[str, Any]:
    """One runbook with its steps (Markdown) and full text: the current version, or
    ``version``. 404 ``runbook_not_found`` for an unknown id or version."""
    return svc.get_runbook(store, actor, runbook_id, version)


class SanitisationIn(BodyIn):
    mig_instances_destroyed: StrictBool
    gpu_memory_cleared: StrictBool
    method: str = Field(min_length=1, max_length=200, description="how, e.g. 'nvidia-smi "
                        "mig -dci/-dgi; nvidia-smi -r'")  # fmt: skip


@router.post("/nodes/{name}/sanitisation", status_code=status.HTTP_201_CREATED)
def sanitisation(
    name: NodeName, body: SanitisationIn, store: StoreDep, actor: Agent
) -> dict[str, Any]:
    """Record the sanitisation of a decommissioned node (``node.sanitise``): its own agent, or
    an identity holding ``nodes:write``. 409 ``node_not_decommissioned`` before the
    decommission, ``already_sanitised`` after a complete report."""
    return decommission.report_sanitisation(store, actor, name, body.model_dump())
