"""Attestation under /api/v1 (issue 5): enrollment, nonces, evidence, verdicts, policies.

The agent routes (enroll, activate, nonce, evidence) accept a node's agent credential for its
own node, or an identity holding ``nodes:write``. Evidence is auditor-readable; policies are
set by admins (``attest:policy-write``). Binary fields travel as base64, nonces as hex.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import agent_or, get_settings, get_store, public, requires
from proofplane.api.schemas import ErrorResponse, json_response
from proofplane.errors import ValidationFailed
from proofplane.service import attestation as svc
from proofplane.service import changes, pki
from proofplane.service.context import Store

router = APIRouter(
    prefix="/api/v1",
    tags=["attestation"],
    responses={
        404: {"model": ErrorResponse},
        409: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    },  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
NodeName = Annotated[str, Path(max_length=63)]
Agent = Annotated[Actor, Depends(agent_or(P.NODES_WRITE))]
B64 = Field(max_length=1 << 16)
EK_CA_BUNDLE_ENV = "PROOFPLANE_EK_CA_BUNDLE"


def _b64(value: str | None, field: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationFailed(f"{field} is not valid base64", code="invalid_base64",
                               details={"field": field}) from None  # fmt: skip


def _ca_bundle() -> bytes | None:
    """The EK CA bundle (PEM) named by PROOFPLANE_EK_CA_BUNDLE; None: EK certificates are
    recorded by hash but not chain-checked."""
    path = os.environ.get(EK_CA_BUNDLE_ENV)
    return FsPath(path).read_bytes() if path else None


class EnrollIn(BaseModel):
    ek_public: str = B64  # TPM2B_PUBLIC of the EK (tpm2_readpublic -f tss), base64
    ak_public: str = B64  # TPM2B_PUBLIC of the AK, base64
    ek_certificate: str | None = Field(None, max_length=1 << 16)  # DER or PEM, base64


class ActivateIn(BaseModel):
    secret: str = Field(max_length=128)  # what tpm2_activatecredential recovered, base64


class EvidenceIn(BaseModel):
    nonce: str = Field(min_length=2, max_length=128, pattern="^([0-9a-fA-F]{2})+$")
    evidence: dict[str, Any]


class PolicyIn(BaseModel):
    policy: dict[str, Any]
    enforce: bool = True


@router.post("/nodes/{name}/attestation/enroll")
def enroll(name: NodeName, body: EnrollIn, store: StoreDep, actor: Agent) -> dict[str, Any]:
    """Start binding the node's AK to its EK: answers a MakeCredential challenge (the
    tpm2-tools credential file, base64) for ``tpm2_activatecredential``."""
    ek = _b64(body.ek_public, "ek_public")
    ak = _b64(body.ak_public, "ak_public")
    assert ek is not None and ak is not None
    cert = _b64(body.ek_certificate, "ek_certificate")
    ch = svc.enroll(store, actor, name, ek, ak, cert, ca_bundle=_ca_bundle())
    return {
        "node": ch.node,
        "credential": base64.b64encode(ch.credential).decode("ascii"),
        "ak_name": ch.ak_name,
        "expires_at": ch.expires_at.isoformat(),
    }


@router.post("/nodes/{name}/attestation/activate")
def activate(name: NodeName, body: ActivateIn, store: StoreDep, actor: Agent) -> dict[str, Any]:
    """Finish binding with the secret ActivateCredential recovered."""
    secret = _b64(body.secret, "secret")
    assert secret is not None
    return svc.activate(store, actor, name, secret)


# The two routes of every attestation round answer with json_response: what they return is
# built here from our own values, so FastAPI's re-validation of it is skipped (issue 20); the
# declared response_model keeps the OpenAPI document as it was.
@router.post(
    "/nodes/{name}/attestation/nonce",
    status_code=status.HTTP_201_CREATED,
    response_model=dict[str, Any],
)
def nonce(name: NodeName, store: StoreDep, actor: Agent) -> Response:
    """A single-use nonce for the next quote, and the PCRs the node's policy wants quoted."""
    n = svc.issue_nonce(store, actor, name)
    return json_response(
        {
            "node": n.node,
            "nonce": n.nonce.hex(),
            "issued_at": n.issued_at.isoformat(),
            "expires_at": n.expires_at.isoformat(),
            "pcr_bank": n.pcr_bank,
            "pcrs": list(n.pcrs),
        },
        status.HTTP_201_CREATED,
    )


@router.post("/nodes/{name}/attestation/evidence", response_model=dict[str, Any])
def evidence(name: NodeName, body: EvidenceIn, store: StoreDep, actor: Agent) -> Response:
    """Submit one round's evidence. The answer is the verdict (``ok``, ``reasons``) and the
    node's state after it; a rejection is a verdict too (200), stored with its evidence.
    Its body (event logs included) may be up to PROOFPLANE_MAX_EVIDENCE_BYTES (16 MiB), not
    the 1 MiB of other routes (``api.app``)."""
    ev = svc.parse_evidence(body.evidence)
    out = svc.submit_evidence(store, actor, name, bytes.fromhex(body.nonce), ev)
    return json_response(
        {
            "node": out.node,
            "evidence_id": out.evidence_id,
            "verdict": out.verdict,
            "state": out.state,
            "state_reason": out.state_reason,
        }
    )


@router.get("/nodes/{name}/attestation")
def attestation(
    name: NodeName, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.NODES_READ))]
) -> dict[str, Any]:
    """The node's TPM identity (EK hash, AK name) and its latest verdict."""
    return svc.attestation_status(store, actor, name)


@router.get("/nodes/{name}/evidence")
def node_evidence(
    name: NodeName,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    limit: Annotated[int, Query(ge=1, le=500)] = 20,
    records: bool = True,
) -> dict[str, Any]:
    """The node's attestation attempts, newest first, each with its evidence record
    (``proofplane attest replay`` re-verifies one offline)."""
    return {"items": svc.list_evidence(store, actor, name, limit=limit, records=records)}


@router.get("/attestation/policy")
def get_policies(
    store: StoreDep, actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))]
) -> dict[str, Any]:
    """Every node class's attestation policy, with its hash and whether it is enforced."""
    return {"items": svc.list_policies(store, actor)}


@router.put("/attestation/policy")
def put_policy(
    body: PolicyIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.ATTEST_POLICY_WRITE))],
    request: Request,
) -> dict[str, Any]:
    """Create or replace the policy of ``policy.node_class`` (default ``default``). With change
    control on: 409 ``change_request_required`` (an ``attestation.policy`` change)."""
    node_class = body.policy.get("node_class", "default") if isinstance(body.policy, dict) else ""
    payload = {"node_class": node_class, "policy": body.policy, "enforce": body.enforce}
    changes.gate(get_settings(request).change_control, "attestation.policy", payload)
    return svc.set_policy(store, actor, body.policy, enforce=body.enforce)


# --- agent channel certificates (issue 13, part 5) ----------------------------------------------


class CsrIn(BaseModel):
    csr: str = Field(max_length=16384)  # PEM, BEGIN CERTIFICATE REQUEST


@router.post("/nodes/{name}/agent-certificate", status_code=status.HTTP_201_CREATED)
def agent_certificate(
    name: NodeName, body: CsrIn, store: StoreDep, actor: Agent, request: Request
) -> dict[str, Any]:
    """Sign the node's agent CSR: only the node's own agent asks, and only while the node is
    admitted and its latest attestation passed (409 ``node_not_attested`` otherwise). The
    answer: the certificate (PEM, 24 h, ``spiffe://<cluster>/node/<name>``) and the CA."""
    settings = get_settings(request)
    return pki.issue_agent_certificate(store, actor, name, body.csr, cluster_id=settings.cluster_id)


@router.get("/pki/ca", response_class=PlainTextResponse, dependencies=[Depends(public)])
def agent_ca_certificate(store: StoreDep, request: Request) -> PlainTextResponse:
    """The agent CA certificate (PEM): what a server's ``--tls-client-ca`` trusts for agents."""
    pem = pki.ca_certificate(store, get_settings(request).cluster_id)
    return PlainTextResponse(pem, media_type="application/x-pem-file")


@router.get("/pki/crl", response_class=Response, dependencies=[Depends(public)])
def agent_crl(store: StoreDep, request: Request) -> Response:
    """The agent CA's certificate revocation list (DER): every revoked, unexpired serial."""
    der = pki.crl_der(store, get_settings(request).cluster_id)
    return Response(der, media_type="application/pkix-crl")


@router.get("/pki/certificates")
def agent_certificates(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_READ))],
    node: Annotated[str | None, Query(max_length=63)] = None,
) -> dict[str, Any]:
    """Every agent certificate issued (or one node's), with its revocation."""
    return {"items": pki.list_certificates(store, actor, node)}


@router.post("/pki/certificates/{serial}/revoke")
def revoke_agent_certificate(
    serial: Annotated[str, Path(max_length=40, pattern="^[0-9a-fA-F]+$")],
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
) -> dict[str, Any]:
    """Revoke one agent certificate now (it goes on the CRL)."""
    return pki.revoke_certificate(store, actor, serial)
