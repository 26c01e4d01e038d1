"""The auditor's evidence package over HTTP (issue 16): ``POST /api/v1/evidence/packages``
starts a job (the package takes seconds to minutes: the log is verified, the report typeset),
``GET …/{id}`` says how it is doing, ``GET …/{id}/download`` hands over the package as a
gzipped tar (what ``proofplane evidence package`` unpacks).

The request is checked before the job starts (framework, period, tenant): bad input is a 4xx
at once, never a failed job. Jobs live in this server process's memory for an hour after
they finish (a package is also on the record: its ``evidence.package`` audit entry); with
several API replicas, poll and download through the replica that answered the POST.
"""

from __future__ import annotations

import io
import secrets
import tarfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Request, status
from fastapi.responses import Response
from pydantic import BaseModel, Field

from proofplane.access import Actor, authorize
from proofplane.access import Permission as P
from proofplane.api.deps import get_settings, get_store, requires
from proofplane.api.routes import utc_time
from proofplane.api.schemas import BodyIn, ErrorResponse
from proofplane.errors import Conflict, NotFound, ProofplaneError
from proofplane.service import evidence as evidence_svc
from proofplane.service import tenants as tenants_svc

router = APIRouter(
    prefix="/api/v1/evidence",
    tags=["evidence"],
    responses={  # type: ignore[dict-item]
        404: {"model": ErrorResponse, "description": "no such job or tenant"},
        409: {"model": ErrorResponse, "description": "the package is not ready"},
        422: {"model": ErrorResponse, "description": "invalid input"},
    },
)
KEEP_FOR = 3600.0  # seconds a finished job's package stays downloadable
MAX_JOBS = 16  # jobs kept per process (the oldest finished one goes first)
JobId = Annotated[str, Path(pattern=r"^job-[0-9a-f]{16}$")]


class PackageIn(BodyIn):
    framework: str = Field(
        max_length=32, description="hipaa|pci-dss|iso27001|nist-800-53|soc2|gdpr"
    )
    from_: datetime = Field(alias="from", description="start of the period (inclusive)")
    to: datetime = Field(description="end of the period (exclusive); not in the future")
    tenant: str | None = Field(None, max_length=63)


class JobOut(BaseModel):
    id: str
    status: Literal["running", "done", "failed"]
    framework: str
    tenant: str | None
    created_at: datetime
    finished_at: datetime | None = None
    package: str | None = Field(None, description="the package id (its evidence.package entry)")
    controls: int | None = None
    exceptions: int | None = Field(None, description="controls with exceptions")
    error: dict[str, Any] | None = None


@dataclass
class Job:
    id: str
    owner: str
    framework: str
    tenant: str | None
    created_at: datetime
    status: str = "running"
    finished_at: datetime | None = None
    package: evidence_svc.Package | None = None
    error: dict[str, Any] | None = None
    done_at: float = field(default=0.0)

    def out(self) -> JobOut:
        p = self.package
        return JobOut(
            id=self.id,
            status=self.status,  # type: ignore[arg-type]
            framework=self.framework,
            tenant=self.tenant,
            created_at=self.created_at,
            finished_at=self.finished_at,
            package=p.id if p else None,
            controls=p.controls if p else None,
            exceptions=p.exceptions if p else None,
            error=self.error,
        )


class Jobs:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: dict[str, Job] = {}

    def add(self, job: Job) -> None:
        with self.lock:
            now = time.monotonic()
            for k, j in list(self.items.items()):
                if j.status != "running" and now - j.done_at > KEEP_FOR:
                    del self.items[k]
            finished = sorted(
                (j for j in self.items.values() if j.status != "running"), key=lambda j: j.done_at
            )
            while len(self.items) >= MAX_JOBS and finished:
                del self.items[finished.pop(0).id]
            self.items[job.id] = job

    def get(self, job_id: str, actor: Actor) -> Job:
        with self.lock:
            job = self.items.get(job_id)
        if job is None or job.owner != actor.name:  # another's job looks like none
            raise NotFound(f"no evidence job {job_id!r}", code="not_found")
        return job


def _jobs(request: Request) -> Jobs:
    state = request.app.state
    if not hasattr(state, "evidence_jobs"):
        state.evidence_jobs = Jobs()
    return state.evidence_jobs  # type: ignore[no-any-return]


@router.post("/packages", status_code=status.HTTP_202_ACCEPTED)
def start_package(
    body: PackageIn,
    request: Request,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
) -> JobOut:
    """Check the request, then build the package in the background."""
    store = get_store(request)
    settings = get_settings(request)
    keys = request.app.state.audit_keys
    now = datetime.now(UTC)
    start, end = utc_time(body.from_, "from"), utc_time(body.to, "to")
    assert start is not None and end is not None
    evidence_svc.controls_for(body.framework)
    evidence_svc.check_period(start, end, now)
    if body.tenant is not None:
        authorize(actor, P.TENANTS_READ, tenant=body.tenant)
        tenants_svc.get_tenant(store, actor, body.tenant)
    job = Job("job-" + secrets.token_hex(8), actor.name, body.framework, body.tenant, now)
    _jobs(request).add(job)

    def run() -> None:
        try:
            job.package = evidence_svc.build_package(
                store, actor, keys, framework=body.framework, start=start, end=end,
                tenant=body.tenant, now=now, session_ttl=settings.session_ttl,
            )  # fmt: skip
            job.status = "done"
        except ProofplaneError as exc:
            job.error = {"code": exc.code, "message": exc.message}
            job.status = "failed"
        except Exception as exc:  # a job's failure is its answer, not a crashed thread
            job.error = {"code": "internal_error", "message": str(exc).splitlines()[0]}
            job.status = "failed"
        job.finished_at = datetime.now(UTC)
        job.done_at = time.monotonic()

    threading.Thread(target=run, name=f"evidence-{job.id}", daemon=True).start()
    return job.out()


@router.get("/packages/{job_id}")
def get_package_job(
    job_id: JobId, request: Request, actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))]
) -> JobOut:
    return _jobs(request).get(job_id, actor).out()


@router.get(
    "/packages/{job_id}/download",
    response_class=Response,
    responses={200: {"content": {"application/gzip": {}}, "description": "the package"}},
)
def download_package(
    job_id: JobId, request: Request, actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))]
) -> Response:
    job = _jobs(request).get(job_id, actor)
    if job.package is None:
        raise Conflict(
            f"evidence job {job_id} is {job.status}", code="not_ready",
            details={"status": job.status, "error": job.error},
        )  # fmt: skip
    return Response(
        tar_gz(job.package),
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{job.package.id}.tar.gz"'},
    )


def tar_gz(package: evidence_svc.Package) -> bytes:
    """The package's files in a gzipped tar, under a directory named after the package."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for path, data in sorted(package.files.items()):
            info = tarfile.TarInfo(f"{package.id}/{path}")
            info.size = len(data)
            info.mtime = int(time.time())
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
