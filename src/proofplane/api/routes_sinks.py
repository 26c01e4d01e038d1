"""SIEM export sinks under /api/v1/sinks: configure, inspect (secrets redacted), test, flush."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response, status
from pydantic import BaseModel, Field

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import BodyIn, ErrorResponse, Name, Page
from proofplane.service import sinks as sinks_svc
from proofplane.service.context import Store

_ERRORS = {
    404: {"model": ErrorResponse, "description": "no such sink"},
    409: {"model": ErrorResponse, "description": "the sink already exists"},
    422: {"model": ErrorResponse, "description": "invalid sink type or configuration"},
    502: {"model": ErrorResponse, "description": "the sink's receiver did not acknowledge"},
}

router = APIRouter(prefix="/api/v1", responses=_ERRORS, tags=["sinks"])  # type: ignore[arg-type]
StoreDep = Annotated[Store, Depends(get_store)]


class SinkIn(BodyIn):
    name: Name
    type: str = Field(max_length=32, description="syslog | ocsf-file | ocsf-http | splunk-hec")
    config: dict[str, Any] = Field(
        description="per type: syslog {url: tls://host:port, ca_file, cert_file, key_file, "
        "server_name?, hostname?, facility?}; ocsf-file {path}; ocsf-http {url, bearer_token?, "
        "ca_file?}; splunk-hec {url, token, index?, source?, sourcetype?, host?, ca_file?}; "
        "all: batch_size?, timeout_s?"
    )
    enabled: bool = True
    start_at: Literal["beginning", "end"] = Field(
        "beginning", description="deliver the whole history, or only events from now on"
    )


class SinkOut(BaseModel):
    name: str
    type: str
    enabled: bool
    config: dict[str, Any] = Field(description="secrets (tokens, key paths) redacted")
    cursor: int = Field(description="the last event seq the receiver acknowledged")
    head: int = Field(description="the newest event seq")
    lag: int
    consecutive_failures: int
    last_error: str | None
    last_attempt_at: datetime | None
    last_success_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, s: sinks_svc.SinkView) -> SinkOut:
        return cls(
            name=s.name,
            type=s.type,
            enabled=s.enabled,
            config=s.config,
            cursor=s.cursor,
            head=s.head,
            lag=s.lag,
            consecutive_failures=s.consecutive_failures,
            last_error=s.last_error,
            last_attempt_at=s.last_attempt_at,
            last_success_at=s.last_success_at,
            created_at=s.created_at,
            updated_at=s.updated_at,
        )


class FlushResult(BaseModel):
    name: str
    delivered: int
    cursor: int
    error: str | None


class FlushOut(BaseModel):
    results: list[FlushResult]


@router.post("/sinks", status_code=status.HTTP_201_CREATED)
def create_sink(
    body: SinkIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.SINKS_WRITE))],
    response: Response,
) -> SinkOut:
    sink = sinks_svc.create_sink(
        store,
        actor,
        body.name,
        body.type,
        body.config,
        enabled=body.enabled,
        start_at=body.start_at,
    )
    response.headers["Location"] = f"/api/v1/sinks/{sink.name}"
    return SinkOut.of(sink)


@router.get("/sinks")
def list_sinks(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.SINKS_READ))],
    limit: Annotated[int, Query(ge=1, le=500, description="page size")] = 100,
    cursor: Annotated[str | None, Query(description="the `next` of the previous page")] = None,
) -> Page[SinkOut]:
    page = sinks_svc.list_sinks(store, actor, limit=limit, cursor=cursor)
    return Page(items=[SinkOut.of(s) for s in page.items], next=page.next)


@router.post("/sinks/flush")
def flush_sinks(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.SINKS_WRITE))],
    name: Annotated[list[str] | None, Query(description="only these sinks")] = None,
) -> FlushOut:
    """One export pass now (every enabled sink, or the named ones)."""
    results = sinks_svc.export_once(store, actor, names=name or None)
    return FlushOut(
        results=[
            FlushResult(name=r.name, delivered=r.delivered, cursor=r.cursor, error=r.error)
            for r in results
        ]
    )


@router.get("/sinks/{name}")
def get_sink(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.SINKS_READ))]
) -> SinkOut:
    return SinkOut.of(sinks_svc.get_sink(store, actor, name))


@router.delete("/sinks/{name}")
def delete_sink(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.SINKS_WRITE))]
) -> SinkOut:
    return SinkOut.of(sinks_svc.delete_sink(store, actor, name))


@router.post("/sinks/{name}/test")
def test_sink(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.SINKS_WRITE))]
) -> SinkOut:
    """Send one synthetic ``sink.test`` message (seq 0) now; 502 if it is not acknowledged."""
    return SinkOut.of(sinks_svc.test_sink(store, actor, name))
