"""Execution backends under /api/v1: the configured engine, a workload's engine jobs and
logs, and the Kubernetes validating admission webhook.

``POST /api/v1/k8s/admission`` is called by the kube-apiserver, not by people. It requires a
proofplane token with ``nodes:read`` (its answers reveal node certifications, which is what
``nodes:read`` grants): put an API token of a dedicated service user (role ``auditor`` or any
role holding ``nodes:read``) in the AdmissionConfiguration's kubeconfig
(``users[].user.token``) so the apiserver sends it as ``Authorization: Bearer``, serve the API
over TLS with the webhook's ``caBundle`` pinned, and set ``failurePolicy: Fail`` so a
proofplane outage refuses compliance-labelled pods instead of admitting them unchecked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import ErrorResponse
from proofplane.backends.base import Backend
from proofplane.config import BACKEND_KINDS, execution_from_env
from proofplane.service import execution
from proofplane.service.context import Store

router = APIRouter(
    prefix="/api/v1",
    responses={404: {"model": ErrorResponse}, 409: {"model": ErrorResponse}},  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
TenantQuery = Annotated[str | None, Query(max_length=63)]


def get_backend(request: Request) -> Backend:
    """The server's engine: ``app.state.backend`` when the server set one, else the store's,
    else built once from ``PROOFPLANE_BACKEND`` (building touches nothing on disk)."""
    backend = getattr(request.app.state, "backend", None) or request.app.state.store.backend
    if backend is None:
        backend = execution.build_backend(execution_from_env())
        request.app.state.backend = backend
    return backend  # type: ignore[no-any-return]


BackendDep = Annotated[Backend, Depends(get_backend)]


@router.get("/backends", tags=["backends"])
def list_backends(
    backend: BackendDep, _actor: Annotated[Actor, Depends(requires(P.NODES_READ))]
) -> dict[str, Any]:
    """The execution engine this cluster uses, its options and health, and the other kinds."""
    items = []
    for kind in BACKEND_KINDS:
        if kind == backend.name:
            items.append({**backend.describe(), "configured": True})
        else:
            items.append({"name": kind, "configured": False})
    return {"items": items}


@router.get("/workloads/{name}/jobs", tags=["workloads"])
def workload_jobs(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_READ))],
    tenant: TenantQuery = None,
) -> dict[str, Any]:
    """The engine jobs of a workload (backend, engine job id, last reported state)."""
    return execution.workload_jobs(store, actor, name, tenant=tenant)


@router.get("/workloads/{name}/logs", tags=["workloads"])
def workload_logs(
    name: str,
    store: StoreDep,
    backend: BackendDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_READ))],
    tenant: TenantQuery = None,
    stream: Literal["stdout", "stderr"] = "stdout",
    tail: Annotated[int | None, Query(ge=1, le=16 * 1024 * 1024)] = None,
) -> dict[str, Any]:
    """The captured output of the workload's latest job (local executor)."""
    return execution.workload_logs(
        store, actor, backend, name, tenant=tenant, stream=stream, tail_bytes=tail
    )


@router.post("/k8s/admission", tags=["backends"])
def k8s_admission(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_READ))],
    review: Annotated[dict[str, Any], Body()],
) -> dict[str, Any]:
    """Validating admission webhook (AdmissionReview admission.k8s.io/v1): denies a pod whose
    compliance labels the certifications of its target node do not satisfy."""
    return execution.review_admission(store, actor, review)
