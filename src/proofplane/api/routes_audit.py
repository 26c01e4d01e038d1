"""The tamper-evident audit log under /api/v1/audit: signed checkpoints, the verifier key,
canonical entries, inclusion and consistency proofs (hashes lowercase hex, entries base64)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import ErrorResponse
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store

_ERRORS = {
    400: {"model": ErrorResponse, "description": "a size or index outside the log"},
    404: {"model": ErrorResponse, "description": "no checkpoint signed yet"},
}

router = APIRouter(prefix="/api/v1/audit", responses=_ERRORS, tags=["audit"])  # type: ignore[arg-type]
StoreDep = Annotated[Store, Depends(get_store)]
Index = Annotated[int, Query(ge=0, le=2**62)]
Size = Annotated[int, Query(ge=1, le=2**62)]


def _keys(request: Request) -> audit_svc.AuditKeys:
    return request.app.state.audit_keys  # type: ignore[no-any-return]


KeysDep = Annotated[audit_svc.AuditKeys, Depends(_keys)]
_TEXT = {200: {"content": {"text/plain": {}}, "description": "a C2SP signed note"}}


class EntryOut(BaseModel):
    index: int
    entry: str = Field(description="base64 of the entry's RFC 8785 canonical JSON bytes")
    leaf_hash: str = Field(description="RFC 9162 leaf hash as stored in the log (hex)")


class EntriesOut(BaseModel):
    entries: list[EntryOut]


class InclusionOut(BaseModel):
    index: int
    tree_size: int
    leaf_hash: str
    proof: list[str]


class ConsistencyOut(BaseModel):
    old_size: int
    new_size: int
    proof: list[str]


@router.get("/checkpoint", response_class=PlainTextResponse, responses=_TEXT)  # type: ignore[arg-type]
def get_checkpoint(
    store: StoreDep, actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))]
) -> PlainTextResponse:
    """The newest signed checkpoint (C2SP tlog-checkpoint in a C2SP signed note)."""
    return PlainTextResponse(audit_svc.latest_checkpoint(store, actor))


@router.post("/checkpoint", response_class=PlainTextResponse, responses=_TEXT)  # type: ignore[arg-type]
def post_checkpoint(
    store: StoreDep,
    keys: KeysDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_CHECKPOINT))],
) -> PlainTextResponse:
    """Sign a checkpoint of the log as it is now."""
    signed = audit_svc.sign_checkpoint(store, actor, keys, datetime.now(UTC))
    assert signed is not None
    return PlainTextResponse(signed)


@router.get("/key", response_class=PlainTextResponse, responses=_TEXT)  # type: ignore[arg-type]
def get_key(
    store: StoreDep, keys: KeysDep, actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))]
) -> PlainTextResponse:
    """The verifier key new checkpoints are signed with (the current version of the KMS key
    ``audit-checkpoint``), ``<name>+<key id hex>+<base64(0x01 ‖ Ed25519 public key)>``."""
    return PlainTextResponse(audit_svc.get_verifier_key(store, keys, actor) + "\n")


class VerifierOut(BaseModel):
    verifier: str = Field(description="C2SP note verifier key: <name>+<key id hex>+<base64>")
    key_id: str
    kms_key: str | None = Field(description="the KMS key; null for the legacy key file")
    version: int | None
    valid_from: datetime | None
    valid_until: datetime | None = Field(description="null: it signs new checkpoints")
    current: bool
    legacy: bool = Field(description="the signing key file of deployments before the KMS")
    destroyed_at: datetime | None
    checkpoints: int = Field(description="stored checkpoints signed in its validity period")


class VerifiersOut(BaseModel):
    verifiers: list[VerifierOut]


@router.get("/verifiers", response_model=VerifiersOut)
def get_verifiers(
    store: StoreDep, keys: KeysDep, actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))]
) -> VerifiersOut:
    """Every verifier key the log's checkpoints were signed with, oldest first, with its
    validity period: one per version of ``audit-checkpoint``, and the legacy key file's."""
    items = audit_svc.list_verifiers(store, keys, actor)
    return VerifiersOut(verifiers=[VerifierOut(**v.to_json()) for v in items])


@router.get("/entries", response_model=EntriesOut)
def get_entries(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    start: Index,
    end: Index,
) -> EntriesOut:
    """Entries ``[start, end)`` (at most 1000) as canonical bytes with their leaf hashes."""
    items = audit_svc.list_entries(store, actor, start, end)
    return EntriesOut(
        entries=[
            EntryOut(
                index=e.index,
                entry=base64.b64encode(e.entry).decode(),
                leaf_hash=e.leaf_hash.hex(),
            )
            for e in items
        ]
    )


@router.get("/proof/inclusion", response_model=InclusionOut)
def get_inclusion(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    index: Index,
    tree_size: Size,
) -> InclusionOut:
    """The RFC 9162 inclusion proof of entry ``index`` in the tree of ``tree_size`` entries."""
    leaf, proof = audit_svc.inclusion_proof(store, actor, index, tree_size)
    return InclusionOut(
        index=index, tree_size=tree_size, leaf_hash=leaf.hex(), proof=[p.hex() for p in proof]
    )


@router.get("/proof/consistency", response_model=ConsistencyOut)
def get_consistency(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    old_size: Size,
    new_size: Size,
) -> ConsistencyOut:
    """The RFC 9162 consistency proof between two tree sizes."""
    proof = audit_svc.consistency_proof(store, actor, old_size, new_size)
    return ConsistencyOut(old_size=old_size, new_size=new_size, proof=[p.hex() for p in proof])
