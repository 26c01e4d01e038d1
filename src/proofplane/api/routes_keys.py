"""The KMS key inventory under /api/v1/keys (issue 13): list and show keys with their versions,
what each protects and how often it was used; create, rotate, rewrap (in batches), disable and
enable. Key material never appears here: only public keys of ``sign`` versions."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status
from pydantic import BaseModel, Field

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_settings, get_store, requires
from proofplane.api.schemas import BodyIn, ErrorResponse
from proofplane.service import changes as changes_svc
from proofplane.service import key_inventory as inventory
from proofplane.service.context import Store

_ERRORS = {
    404: {"model": ErrorResponse, "description": "no such key (key_not_found)"},
    409: {
        "model": ErrorResponse,
        "description": "the key exists, or is disabled; destroying a "
        "version: key_version_in_use (rewrap first), key_version_destroyed, "
        "change_request_required (change control on: a key.destroy change, two approvals)",
    },
    422: {"model": ErrorResponse, "description": "a bad key name, or the wrong purpose"},
    503: {"model": ErrorResponse, "description": "the KMS cannot be used now"},
}

router = APIRouter(prefix="/api/v1/keys", responses=_ERRORS, tags=["keys"])  # type: ignore[arg-type]
StoreDep = Annotated[Store, Depends(get_store)]
KeyName = Annotated[str, Field(max_length=63, description="lowercase letters, digits, '-'")]


class KeyIn(BodyIn):
    name: KeyName
    purpose: Literal["encrypt", "sign"] = Field(
        description="encrypt: AES-256-GCM envelope encryption; sign: Ed25519"
    )


class VersionOut(BaseModel):
    version: int
    created_at: datetime
    retired_at: datetime | None
    destroyed_at: datetime | None
    public_key: str | None = Field(description="hex Ed25519 public key of a sign version")
    checkpoints: int | None = Field(
        None, description="audit-checkpoint: checkpoints signed while this version was current"
    )


class KeyOut(BaseModel):
    name: str
    purpose: str
    algorithm: str
    backend: str
    current_version: int
    created_at: datetime
    updated_at: datetime
    disabled_at: datetime | None
    versions: list[VersionOut]
    protects: dict[str, int] = Field(
        description="encrypt keys: stored ciphertexts per place, and their total; "
        "audit-checkpoint: the checkpoints it signed"
    )
    stale: int = Field(description="ciphertexts under an older version (what rewrap re-seals)")
    operations: dict[str, int] = Field(
        description="encrypt/decrypt/sign operations by this server process since it started"
    )

    @classmethod
    def of(cls, info: inventory.KeyInfo) -> KeyOut:
        return cls(**info.to_json())


class KeysOut(BaseModel):
    items: list[KeyOut]


class RewrapOut(BaseModel):
    key: str
    version: int = Field(description="the version the secrets are now sealed under")
    rewrapped: int = Field(description="in this batch")
    remaining: int
    done: bool
    failed: list[dict[str, Any]] = Field(description="ciphertexts that did not open (kept)")


@router.get("")
def list_keys(store: StoreDep, actor: Annotated[Actor, Depends(requires(P.KEYS_READ))]) -> KeysOut:
    return KeysOut(items=[KeyOut.of(k) for k in inventory.list_keys(store, actor)])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_key(
    body: KeyIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.KEYS_WRITE))],
    response: Response,
) -> KeyOut:
    info = inventory.create_key(store, actor, body.name, body.purpose)
    response.headers["Location"] = f"/api/v1/keys/{info.key.name}"
    return KeyOut.of(info)


@router.get("/{name}")
def get_key(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.KEYS_READ))]
) -> KeyOut:
    return KeyOut.of(inventory.get_key(store, actor, name))


@router.post("/{name}/rotate")
def rotate_key(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.KEYS_WRITE))]
) -> KeyOut:
    """A new version becomes current; what older versions sealed still opens, what they
    signed still verifies (for audit-checkpoint: a new verifier key is published)."""
    return KeyOut.of(inventory.rotate_key(store, actor, name))


@router.post("/{name}/rewrap")
def rewrap_key(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.KEYS_WRITE))],
    limit: Annotated[int, Query(ge=1, le=inventory.MAX_BATCH, description="batch size")] = 100,
) -> RewrapOut:
    """Re-seal up to ``limit`` stored secrets of the key under its current version (one
    transaction). Call again until ``done``."""
    return RewrapOut(**inventory.rewrap_batch(store, actor, name, limit).to_json())


@router.post("/{name}/disable")
def disable_key(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.KEYS_WRITE))]
) -> KeyOut:
    """Nothing is sealed, opened or signed with the key until it is enabled again."""
    return KeyOut.of(inventory.disable_key(store, actor, name, True))


@router.post("/{name}/enable")
def enable_key(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.KEYS_WRITE))]
) -> KeyOut:
    return KeyOut.of(inventory.disable_key(store, actor, name, False))


@router.post("/{name}/versions/{version}/destroy")
def destroy_version(
    name: str,
    version: Annotated[int, Path(ge=1, le=1_000_000)],
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.KEYS_WRITE))],
    request: Request,
) -> KeyOut:
    """Destroy a superseded version for good: what it sealed never opens again. Refused
    while stored secrets are sealed under it (409 ``key_version_in_use``: rewrap first). With
    change control on this is a ``key.destroy`` change under dual control (two approvals): 409
    ``change_request_required`` names the request that would do it, nothing is written."""
    inventory.check_destroy(store, actor, name, version)
    changes_svc.gate(
        get_settings(request).change_control, "key.destroy", {"key": name, "version": version}
    )
    return KeyOut.of(inventory.destroy_version(store, actor, name, version))
