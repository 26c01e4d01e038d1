"""The Kubernetes backend: render the Pod / Job for a placed workload, and a validating
admission webhook that refuses pods whose compliance labels their target node cannot satisfy.

Labels, and why they look like this:

* Node certification labels live under ``node-restriction.kubernetes.io/``: the NodeRestriction
  admission plugin forbids kubelets to set labels with that prefix on their own Node, so a
  compromised node cannot certify itself (KEP-279). proofplane (through a controller with
  node-patch rights) writes ``node-restriction.kubernetes.io/proofplane-<key>=<value>``.
* A pod's compliance requirements are labels ``compliance.proofplane.io/<key>=<value>``; the
  webhook checks them against the certifications *proofplane* holds for the target node, not
  against the node's labels.
* ``proofplane.io/tenant``, ``proofplane.io/workload``: who the pod belongs to.

GPUs follow the NVIDIA device plugin's *mixed* MIG strategy: whole GPUs are ``nvidia.com/gpu``,
MIG instances ``nvidia.com/mig-<profile>`` (``nvidia.com/mig-3g.40gb``).

Everything here is pure except ``validate`` (which needs the ``kubernetes`` client models, an
optional dependency) and ``KubernetesBackend`` (the client calls).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from proofplane.backends.base import (
    BackendUnavailable,
    Change,
    ChangeKind,
    DrainFailed,
    JobRejected,
    JobSpec,
)
from proofplane.errors import ValidationFailed
from proofplane.model import IsolationLevel, PlacedDevice, missing_tags

CERT_PREFIX = "node-restriction.kubernetes.io/proofplane-"
COMPLIANCE_PREFIX = "compliance.proofplane.io/"
TENANT_LABEL = "proofplane.io/tenant"
WORKLOAD_LABEL = "proofplane.io/workload"
HOSTNAME_LABEL = "kubernetes.io/hostname"
TENANT_TAINT = "proofplane.io/tenant"
DEFAULT_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


# --- labels and resources ---------------------------------------------------------------------


def _label_name(key: str, prefix: str) -> str:
    name = f"{prefix.rsplit('/', 1)[1]}{key}"
    if "/" in key or not _LABEL_NAME.fullmatch(name):
        raise JobRejected(
            f"the tag key {key!r} cannot be a Kubernetes label name under {prefix!r} "
            "(no '/', at most 63 characters with the prefix)",
            details={"key": key},
        )
    return f"{prefix.rsplit('/', 1)[0]}/{name}"


def certification_label(key: str) -> str:
    """``hipaa`` → ``node-restriction.kubernetes.io/proofplane-hipaa``."""
    return _label_name(key, CERT_PREFIX)


def compliance_label(key: str) -> str:
    """``hipaa`` → ``compliance.proofplane.io/hipaa``."""
    return _label_name(key, COMPLIANCE_PREFIX)


def node_labels(certifications: Mapping[str, str]) -> dict[str, str]:
    """The labels proofplane's controller sets on a Node for its certifications. Pure."""
    return {certification_label(k): v for k, v in sorted(certifications.items())}


def gpu_resources(devices: tuple[PlacedDevice, ...]) -> dict[str, str]:
    """Extended resources for one node's devices (mixed strategy). Pure."""
    if any(d.share_milli is not None for d in devices):
        raise JobRejected(
            "shared-GPU (share_milli) workloads need time-slicing or MPS configured in the "
            "device plugin, which this backend does not assume; ask for a MIG profile or a GPU"
        )
    out: dict[str, int] = {}
    for d in devices:
        name = f"nvidia.com/mig-{d.mig_profile}" if d.mig_profile else "nvidia.com/gpu"
        out[name] = out.get(name, 0) + 1
    return {k: str(v) for k, v in sorted(out.items())}


@dataclass(frozen=True, slots=True)
class RenderOptions:
    namespace_prefix: str = "tenant-"  # a tenant's namespace is <prefix><tenant>
    image: str = DEFAULT_IMAGE  # workloads carry a command, not an image (yet)
    pin: str = "selector"  # "selector": nodeSelector on hostname; "nodeName": bypass scheduler
    service_account: str | None = None


def namespace_of(tenant: str, options: RenderOptions | None = None) -> str:
    return f"{(options or RenderOptions()).namespace_prefix}{tenant}"


def object_name(job: JobSpec) -> str:
    return f"pp-{job.workload}"[:63].rstrip("-")


def render_pod(job: JobSpec, options: RenderOptions | None = None) -> dict[str, Any]:
    """The Pod for a single-node placed workload. Pure.

    The pod is pinned to proofplane's node (``kubernetes.io/hostname`` selector, or
    ``nodeName``) and *also* selects every certification its tags need, so the scheduler
    and the kubelet-proof labels enforce the same rule proofplane did."""
    options = options or RenderOptions()
    if len(job.placement.parts) != 1:
        raise JobRejected("a gang (multi-node) workload needs a Job per node; not supported")
    if not job.command:
        raise JobRejected(f"workload {job.key} has no command to run")
    node = job.placement.node
    labels = {
        TENANT_LABEL: job.tenant,
        WORKLOAD_LABEL: job.workload,
        **{compliance_label(k): v for k, v in sorted(job.tags.items())},
    }
    selector = {certification_label(k): v for k, v in sorted(job.tags.items())}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "workload",
                "image": options.image,
                "command": list(job.command),
                "resources": {"limits": gpu_resources(job.placement.devices)},
                "env": [
                    {"name": "PROOFPLANE_WORKLOAD", "value": job.workload},
                    {"name": "PROOFPLANE_TENANT", "value": job.tenant},
                ],
            }
        ],
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
        "automountServiceAccountToken": False,
    }
    if options.pin == "nodeName":
        spec["nodeName"] = node
    else:
        selector[HOSTNAME_LABEL] = node
    if selector:
        spec["nodeSelector"] = selector
    if job.isolation is IsolationLevel.DEDICATED_NODE:
        spec["tolerations"].append(
            {"key": TENANT_TAINT, "operator": "Equal", "value": job.tenant, "effect": "NoSchedule"}
        )
    if options.service_account:
        spec["serviceAccountName"] = options.service_account
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": object_name(job),
            "namespace": namespace_of(job.tenant, options),
            "labels": labels,
            "annotations": {"proofplane.io/placement": _placement_note(job)},
        },
        "spec": spec,
    }


def render_job(job: JobSpec, options: RenderOptions | None = None) -> dict[str, Any]:
    """A batch/v1 Job around ``render_pod``'s pod: never retried behind proofplane's back
    (backoffLimit 0); proofplane decides about retries. Pure."""
    pod = render_pod(job, options)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": pod["metadata"],
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]},
        },
    }


def _placement_note(job: JobSpec) -> str:
    devices = [
        {"gpu": d.gpu_index, "uuid": d.gpu_uuid, "mig": d.mig_profile, "start": d.mig_start}
        for d in job.placement.devices
    ]
    return json.dumps({"node": job.placement.node, "devices": devices}, sort_keys=True)


# --- validation against the official client models ------------------------------------------

_MODEL_FOR = {("v1", "Pod"): "V1Pod", ("batch/v1", "Job"): "V1Job"}


def validate(obj: Mapping[str, Any]) -> Any:
    """Deserialize ``obj`` into the ``kubernetes`` client's model (V1Pod / V1Job) and return
    it. Raises ValidationFailed when a required field is missing, a type is wrong, or a field
    is unknown to the model (the client would silently drop it; the API server would reject
    it under strict field validation)."""
    try:
        from kubernetes.client import ApiClient
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ValidationFailed(
            "validating Kubernetes objects needs the 'kubernetes' package "
            "(pip install 'proofplane[kubernetes]')",
            code="kubernetes_client_missing",
        ) from exc
    model = _MODEL_FOR.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
    if model is None:
        raise ValidationFailed(
            f"cannot validate {obj.get('apiVersion')}/{obj.get('kind')}", code="invalid_object"
        )
    client = ApiClient()
    try:
        parsed = client.deserialize(json.dumps(obj), model, "application/json")
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise ValidationFailed(
            f"not a valid {model}: {exc}", code="invalid_object", details=str(exc)
        ) from exc
    back = client.sanitize_for_serialization(parsed)
    dropped = _dropped_paths(obj, back)
    if dropped:
        raise ValidationFailed(
            f"fields unknown to {model}: {', '.join(dropped)}",
            code="invalid_object",
            details={"unknown_fields": dropped},
        )
    return parsed


def _dropped_paths(original: Any, back: Any, path: str = "") -> list[str]:
    if isinstance(original, Mapping):
        if not isinstance(back, Mapping):
            return [path or "."]
        out: list[str] = []
        for k, v in original.items():
            sub = f"{path}.{k}" if path else str(k)
            if k not in back:
                if v not in (None, [], {}):
                    out.append(sub)
            else:
                out.extend(_dropped_paths(v, back[k], sub))
        return out
    if isinstance(original, list):
        if not isinstance(back, list) or len(back) != len(original):
            return [path]
        return [
            p for i, v in enumerate(original) for p in _dropped_paths(v, back[i], f"{path}[{i}]")
        ]
    return []


# --- the validating admission webhook ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the webhook needs to know of a node: proofplane's view, never the node's labels."""

    admitted: bool
    certifications: Mapping[str, str]
    state: str = "admitted"


NodeLookup = Callable[[str], NodeFacts | None]


def _response(uid: str, allowed: bool, message: str = "", code: int = 403) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": code, "reason": "Forbidden", "message": message}
    elif message:
        response["warnings"] = [message]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


class MalformedReview(ValidationFailed):
    """A part of an AdmissionReview has the wrong JSON type. ``admission_review`` answers it
    with a denial that says so; it never leaves that function."""

    code = "malformed_admission_review"


def _part(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """``parent[key]`` as an object: absent or null is empty (Kubernetes omits empty fields),
    anything but an object is malformed."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MalformedReview(f"{where} must be an object")
    return value


def _text(parent: Mapping[str, Any], key: str, where: str) -> str | None:
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise MalformedReview(f"{where} must be a string")
    return value


def _pod_spec(obj: Mapping[str, Any], kind: str) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(pod spec, pod labels) of a Pod, or of the pod template of a Job; ``MalformedReview`` where a
    part on the way is not an object."""
    if kind == "Pod":
        spec = _part(obj, "spec", "object.spec")
        labels = _part(
            _part(obj, "metadata", "object.metadata"), "labels", "object.metadata.labels"
        )
        return spec, labels
    template = _part(_part(obj, "spec", "object.spec"), "template", "object.spec.template")
    spec = _part(template, "spec", "object.spec.template.spec")
    metadata = _part(template, "metadata", "object.spec.template.metadata")
    return spec, _part(metadata, "labels", "object.spec.template.metadata.labels")


def admission_review(review: Mapping[str, Any], nodes: NodeLookup) -> dict[str, Any]:
    """Decide an AdmissionReview (admission.k8s.io/v1) for a Pod or a Job. Pure, given
    ``nodes`` (proofplane's certifications per node).

    A pod carrying ``compliance.proofplane.io/*`` labels is allowed only if

    * it targets a node (``nodeName``, or a ``kubernetes.io/hostname`` node selector), that
      node is admitted in proofplane, and its proofplane certifications satisfy every
      compliance label; or
    * it targets no particular node but its node selector requires every matching
      certification label (so only certified nodes can ever run it).

    Pods without compliance labels are not proofplane's concern and are allowed. A review
    whose parts have the wrong JSON type (no kube-apiserver sends one) is denied with code 400
    and the reason: never an error, which a webhook with ``failurePolicy: Ignore`` would
    admit. Only a document that is no AdmissionReview, or has no ``request.uid`` to answer,
    raises ``ValidationFailed``."""
    if review.get("apiVersion") != "admission.k8s.io/v1" or review.get("kind") != "AdmissionReview":
        raise ValidationFailed(
            "expected an admission.k8s.io/v1 AdmissionReview", code="invalid_admission_review"
        )
    request = review.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise ValidationFailed(
            "AdmissionReview without request.uid", code="invalid_admission_review"
        )
    uid = request["uid"]
    try:
        return _decide(uid, request, nodes)
    except MalformedReview as exc:
        return _response(uid, False, f"proofplane: malformed AdmissionReview: {exc}", code=400)


def _decide(uid: str, request: Mapping[str, Any], nodes: NodeLookup) -> dict[str, Any]:
    kind = _part(request, "kind", "request.kind").get("kind")
    if request.get("operation") not in ("CREATE", "UPDATE") or kind not in ("Pod", "Job"):
        return _response(uid, True)
    if request.get("subResource"):
        return _response(uid, True)  # status updates and the like change no placement
    obj = request.get("object")
    if not isinstance(obj, Mapping):
        return _response(uid, False, "the request carries no object", code=400)
    spec, labels = _pod_spec(obj, kind)
    selector = _part(spec, "nodeSelector", "the pod's spec.nodeSelector")
    required: dict[str, str] = {}
    for key, value in labels.items():
        if isinstance(key, str) and key.startswith(COMPLIANCE_PREFIX):
            if not isinstance(value, str):
                raise MalformedReview(f"the value of label {key} must be a string")
            required[key[len(COMPLIANCE_PREFIX) :]] = value
    if not required:
        return _response(uid, True)
    node = _text(spec, "nodeName", "the pod's spec.nodeName") or _text(
        selector, HOSTNAME_LABEL, f"the pod's {HOSTNAME_LABEL} node selector"
    )
    if node is None:
        needed = {certification_label(k): v for k, v in required.items()}
        unmet = sorted(k for k, v in needed.items() if selector.get(k) != v)
        if unmet:
            return _response(
                uid,
                False,
                "proofplane: a pod with compliance labels must target a node (nodeName or "
                f"{HOSTNAME_LABEL}) or select the certification labels; missing selector "
                f"terms: {', '.join(unmet)}",
            )
        return _response(uid, True)
    facts = nodes(node)
    if facts is None:
        return _response(uid, False, f"proofplane: node {node!r} is not known to proofplane")
    if not facts.admitted:
        return _response(
            uid, False, f"proofplane: node {node!r} is {facts.state}, not admitted: no new work"
        )
    missing = missing_tags(required, facts.certifications)
    if missing:
        pairs = ", ".join(f"{k}={v}" for k, v in sorted(missing.items()))
        return _response(
            uid,
            False,
            f"proofplane: node {node!r} is not certified for {pairs} "
            "(certifications are issued by proofplane, not read from node labels)",
        )
    return _response(uid, True)


# --- the client-driven backend ----------------------------------------------------------------


class KubernetesBackend:
    """Creates Jobs through the Kubernetes API (kubeconfig or in-cluster credentials).

    Thin on purpose: render, validate, create / delete / list, map Job conditions. Not tested
    against an API server here (none can run in this environment); the rendering, validation
    and webhook above are."""

    name = "kubernetes"

    def __init__(self, options: RenderOptions | None = None, *, api: Any = None) -> None:
        self.options = options or RenderOptions()
        self._api = api

    def _batch(self) -> Any:
        if self._api is None:
            try:
                from kubernetes import client, config

                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
                self._api = client
            except Exception as exc:  # no package, no kubeconfig, no cluster
                raise BackendUnavailable(f"no Kubernetes API available: {exc}") from exc
        return self._api

    def submit(self, job: JobSpec) -> str:
        body = render_job(job, self.options)
        validate(body)
        client = self._batch()
        ns = body["metadata"]["namespace"]
        try:
            client.BatchV1Api().create_namespaced_job(ns, body)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if isinstance(status, int) and 400 <= status < 500:
                raise JobRejected(f"Kubernetes rejected {job.key}: {exc}") from exc
            raise BackendUnavailable(f"Kubernetes API: {exc}") from exc
        return f"{ns}/{body['metadata']['name']}"

    def cancel(self, job_id: str) -> None:
        ns, _, name = job_id.partition("/")
        try:
            self._batch().BatchV1Api().delete_namespaced_job(
                name, ns, propagation_policy="Foreground"
            )
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return
            raise BackendUnavailable(f"Kubernetes API: {exc}") from exc

    def sync(self, job_ids: Collection[str]) -> list[Change]:
        out = []
        api = self._batch().BatchV1Api()
        for job_id in job_ids:
            ns, _, name = job_id.partition("/")
            try:
                status = api.read_namespaced_job_status(name, ns).status
            except Exception as exc:
                if getattr(exc, "status", None) == 404:
                    out.append(Change(ChangeKind.FAILED, job_id, message="Job deleted"))
                    continue
                raise BackendUnavailable(f"Kubernetes API: {exc}") from exc
            if status.succeeded:
                out.append(Change(ChangeKind.SUCCEEDED, job_id, message="succeeded"))
            elif status.failed:
                out.append(Change(ChangeKind.FAILED, job_id, message="pod failed"))
            else:
                out.append(Change(ChangeKind.RUNNING, job_id, message="active"))
        return out

    def _cordon(self, node: str, unschedulable: bool) -> None:
        try:
            self._batch().CoreV1Api().patch_node(node, {"spec": {"unschedulable": unschedulable}})
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise DrainFailed(f"Kubernetes did not update node {node}: {exc}") from exc

    def drain(self, node: str, reason: str) -> None:
        self._cordon(node, True)

    def resume(self, node: str) -> None:
        self._cordon(node, False)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace_prefix": self.options.namespace_prefix,
            "image": self.options.image,
            "pin": self.options.pin,
        }
