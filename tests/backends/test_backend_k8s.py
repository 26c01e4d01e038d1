"""The Kubernetes backend: rendered objects validate against the official client models, and
the admission webhook decides real AdmissionReview v1 documents."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ci import unavailable
from proofplane.backends.base import JobRejected, JobSpec
from proofplane.backends.k8s import (
    NodeFacts,
    RenderOptions,
    admission_review,
    certification_label,
    gpu_resources,
    node_labels,
    render_job,
    render_pod,
    validate,
)
from proofplane.errors import ValidationFailed
from proofplane.model import IsolationLevel, PlacedDevice, Placement

try:
    import kubernetes  # noqa: F401  (the validator needs the official client models)
except ImportError:
    unavailable("the kubernetes client is missing (the dev extra installs it)")

MIG = (
    PlacedDevice(0, "GPU-0", mig_profile="3g.40gb", mig_start=0),
    PlacedDevice(0, "GPU-0", mig_profile="3g.40gb", mig_start=4),
    PlacedDevice(1, "GPU-1", mig_profile="1g.10gb", mig_start=0),
)
JOB = JobSpec(
    "scan",
    "clinic",
    ("python", "scan.py", "--batch", "8"),
    Placement("fra-h100-01", MIG),
    tags={"hipaa": "true", "gdpr-zone": "frankfurt"},
    isolation=IsolationLevel.DEDICATED_NODE,
)


def test_pod_renders_placement_labels_and_mixed_strategy_resources() -> None:
    pod = render_pod(JOB)
    pod_model = validate(pod)
    assert type(pod_model).__name__ == "V1Pod"
    spec = pod_model.spec
    assert pod_model.metadata.namespace == "tenant-clinic"
    assert pod_model.metadata.labels == {
        "proofplane.io/tenant": "clinic",
        "proofplane.io/workload": "scan",
        "compliance.proofplane.io/gdpr-zone": "frankfurt",
        "compliance.proofplane.io/hipaa": "true",
    }
    assert spec.node_selector == {
        "kubernetes.io/hostname": "fra-h100-01",
        "node-restriction.kubernetes.io/proofplane-gdpr-zone": "frankfurt",
        "node-restriction.kubernetes.io/proofplane-hipaa": "true",
    }
    assert spec.node_name is None
    (container,) = spec.containers
    assert container.command == ["python", "scan.py", "--batch", "8"]
    assert container.resources.limits == {
        "nvidia.com/mig-1g.10gb": "1",
        "nvidia.com/mig-3g.40gb": "2",
    }
    assert {(t.key, t.value) for t in spec.tolerations} == {
        ("nvidia.com/gpu", None),
        ("proofplane.io/tenant", "clinic"),
    }
    assert spec.restart_policy == "Never" and spec.automount_service_account_token is False


def test_job_and_node_name_pinning_validate() -> None:
    job = render_job(JOB, RenderOptions(pin="nodeName", namespace_prefix="pp-", image="img:1"))
    model = validate(job)
    assert type(model).__name__ == "V1Job" and model.spec.backoff_limit == 0
    pod_spec = model.spec.template.spec
    assert pod_spec.node_name == "fra-h100-01"
    assert "kubernetes.io/hostname" not in pod_spec.node_selector
    assert model.metadata.namespace == "pp-clinic"
    whole = (PlacedDevice(2, "GPU-2"), PlacedDevice(3, "GPU-3"))
    assert gpu_resources(whole) == {"nvidia.com/gpu": "2"}
    with pytest.raises(JobRejected, match="shared-GPU"):
        gpu_resources((PlacedDevice(0, "GPU-0", share_milli=250),))
    with pytest.raises(JobRejected, match="cannot be a Kubernetes label"):
        certification_label("example.com/tier")
    assert node_labels({"hipaa": "true"}) == {
        "node-restriction.kubernetes.io/proofplane-hipaa": "true"
    }


def test_validation_catches_what_the_api_server_would_refuse() -> None:
    pod = render_pod(JOB)
    missing_name = copy.deepcopy(pod)
    del missing_name["spec"]["containers"][0]["name"]
    with pytest.raises(ValidationFailed, match="V1Container"):
        validate(missing_name)
    wrong_type = copy.deepcopy(pod)
    wrong_type["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = ["1"]
    with pytest.raises(ValidationFailed, match="not a valid V1Pod"):
        validate(wrong_type)
    typo = copy.deepcopy(pod)
    typo["spec"]["nodeSelecter"] = typo["spec"].pop("nodeSelector")
    with pytest.raises(ValidationFailed, match="spec.nodeSelecter"):
        validate(typo)
    with pytest.raises(ValidationFailed, match="cannot validate"):
        validate({"apiVersion": "v1", "kind": "Service"})


# --- the admission webhook -------------------------------------------------------------------

NODES = {
    "fra-h100-01": NodeFacts(True, {"hipaa": "true", "gdpr-zone": "frankfurt"}),
    "fra-h100-02": NodeFacts(True, {"gdpr-zone": "frankfurt"}),
    "fra-h100-03": NodeFacts(False, {"hipaa": "true"}, state="quarantined"),
}


def review(obj: dict[str, Any], *, kind: str = "Pod", operation: str = "CREATE") -> dict[str, Any]:
    """An AdmissionReview as the kube-apiserver sends it (admission.k8s.io/v1)."""
    resource = "pods" if kind == "Pod" else "jobs"
    group = "" if kind == "Pod" else "batch"
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": group, "version": "v1", "kind": kind},
            "resource": {"group": group, "version": "v1", "resource": resource},
            "requestKind": {"group": group, "version": "v1", "kind": kind},
            "requestResource": {"group": group, "version": "v1", "resource": resource},
            "name": obj["metadata"]["name"],
            "namespace": obj["metadata"]["namespace"],
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def decide(obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
    answer = admission_review(review(obj, **kw), NODES.get)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    return answer["response"]  # type: ignore[no-any-return]


def on(node: str, pod: dict[str, Any] | None = None) -> dict[str, Any]:
    pod = copy.deepcopy(pod or render_pod(JOB))
    pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] = node
    return pod


def test_webhook_allows_a_compliant_pod_and_job() -> None:
    assert decide(render_pod(JOB)) == {"uid": review(render_pod(JOB))["request"]["uid"],
                                       "allowed": True}  # fmt: skip
    assert decide(render_job(JOB), kind="Job")["allowed"] is True


def test_webhook_denies_a_pod_on_a_node_without_the_certification() -> None:
    response = decide(on("fra-h100-02"))
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert "not certified for hipaa=true" in response["status"]["message"]
    # Node labels are not evidence: a node that labels itself "hipaa" does not pass.
    pod = on("fra-h100-02")
    pod["spec"]["nodeSelector"]["node-restriction.kubernetes.io/proofplane-hipaa"] = "true"
    assert decide(pod)["allowed"] is False


def test_webhook_denies_unknown_and_quarantined_nodes_and_unpinned_pods() -> None:
    assert "not known" in decide(on("ghost"))["status"]["message"]
    assert "quarantined" in decide(on("fra-h100-03"))["status"]["message"]
    by_name = render_pod(JOB, RenderOptions(pin="nodeName"))
    by_name["spec"]["nodeName"] = "fra-h100-02"
    assert decide(by_name)["allowed"] is False
    floating = render_pod(JOB)
    del floating["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    assert decide(floating)["allowed"] is True  # only certified nodes can match its selector
    del floating["spec"]["nodeSelector"]["node-restriction.kubernetes.io/proofplane-hipaa"]
    response = decide(floating)
    assert response["allowed"] is False and "proofplane-hipaa" in response["status"]["message"]
    job = render_job(JOB)
    job["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"] = "fra-h100-02"
    assert decide(job, kind="Job")["allowed"] is False


def test_webhook_ignores_what_is_not_its_concern_and_refuses_garbage() -> None:
    plain = render_pod(JSON_FREE)
    assert decide(on("ghost", plain))["allowed"] is True  # no compliance labels
    assert decide(on("fra-h100-02"), operation="DELETE")["allowed"] is True
    with pytest.raises(ValidationFailed):
        admission_review({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"},
                         NODES.get)  # fmt: skip
    with pytest.raises(ValidationFailed):
        admission_review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
                         NODES.get)  # fmt: skip


JSON_FREE = JobSpec("plain", "lab", ("true",), Placement("n", (PlacedDevice(0, "GPU-0"),)))
