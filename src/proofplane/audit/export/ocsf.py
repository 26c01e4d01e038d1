"""Events as OCSF JSON objects. Pure: an event in, a dict out.

Each of our actions maps to one OCSF class and activity (``classify``; the README's SIEM
section lists the table). The mapping follows the schema's rules, which the test suite checks
against the published 1.1.0 files (``proofplane.audit.export.ocsf_schema``):

* ``category_uid = class_uid // 1000``, ``type_uid = class_uid * 100 + activity_id``, and
  ``type_name`` is the schema's caption of that ``type_uid`` (``"Account Change: Other"``);
  for activity Other (99) ``activity_name`` names our action (``token.issue``);
* ``status_id`` 1 Success / 2 Failure on the activity classes; the Finding classes define
  ``status_id`` as the consumer's triage state (New, In Progress, …), so we leave it to them
  and put the outcome where the class defines it (Compliance Finding: ``compliance.status_id``
  Pass/Fail; Detection Finding: ``finding_info`` and the severity);
* attestation verdicts (``node.attest``) are Compliance Findings against NIST SP 800-53 SI-7
  and the node's attestation policy; the node's registration and state stay Device Inventory
  Info (5001);
* attributes a profile brings (``actor``, ``device`` on the Finding classes: ``host``) are
  sent only with the profile declared in ``metadata.profiles``.

``metadata.sequence`` is the event's sequence number and ``metadata.uid`` its Merkle leaf hash
(hex); the original event rides along under ``unmapped.proofplane`` so nothing is lost.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from proofplane.audit.export.times import epoch_millis
from proofplane.model import Event, Outcome

OCSF_VERSION = "1.1.0"
#: the schema versions this module can write (the setting ``PROOFPLANE_OCSF_VERSION``)
VERSIONS = (OCSF_VERSION,)

PRODUCT = "proofplane"
VENDOR = "proofplane"

# classes
COMPLIANCE_FINDING = 2003
DETECTION_FINDING = 2004
ACCOUNT_CHANGE = 3001
AUTHENTICATION = 3002
DEVICE_INVENTORY_INFO = 5001
API_ACTIVITY = 6003

CLASS_NAMES = {
    COMPLIANCE_FINDING: "Compliance Finding",
    DETECTION_FINDING: "Detection Finding",
    ACCOUNT_CHANGE: "Account Change",
    AUTHENTICATION: "Authentication",
    DEVICE_INVENTORY_INFO: "Device Inventory Info",
    API_ACTIVITY: "API Activity",
}
CATEGORY_NAMES = {
    2: "Findings",
    3: "Identity & Access Management",
    5: "Discovery",
    6: "Application Activity",
}
OTHER = 99
FINDINGS = (COMPLIANCE_FINDING, DETECTION_FINDING)

SEVERITIES = {0: "Unknown", 1: "Informational", 2: "Low", 3: "Medium", 4: "High", 5: "Critical"}
_INCIDENT = "incident."
_ALERT_SEVERITY = {"informational": 1, "low": 2, "medium": 3, "high": 4, "critical": 5}

# NIST SP 800-53 Rev. 5 SI-7 (software, firmware and information integrity): what a measured
# boot and firmware attestation verifies.
ATTESTATION_STANDARD = "NIST SP 800-53 Rev. 5"
ATTESTATION_CONTROL = "SI-7"

# RFC 952/1123 host name: what OCSF's hostname_t accepts
_HOSTNAME = re.compile(
    r"^(([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9\-]*[a-zA-Z0-9])\.)*"
    r"([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9\-]*[A-Za-z0-9])$"
)


@dataclass(frozen=True, slots=True)
class ClassActivity:
    class_uid: int
    activity_id: int
    activity_name: str  # the schema's caption; for Other (99), our action

    @property
    def category_uid(self) -> int:
        return self.class_uid // 1000

    @property
    def type_uid(self) -> int:
        return self.class_uid * 100 + self.activity_id

    @property
    def type_name(self) -> str:
        caption = "Other" if self.activity_id == OTHER else self.activity_name
        return f"{CLASS_NAMES[self.class_uid]}: {caption}"


# (class, activity_id, caption); the caption of 99 is replaced by the action itself
_EXACT: dict[str, tuple[int, int, str]] = {
    # Authentication: 1 Logon, 2 Logoff
    "auth.login": (AUTHENTICATION, 1, "Logon"),
    "auth.logout": (AUTHENTICATION, 2, "Logoff"),
    "mfa.recovery_code.use": (AUTHENTICATION, 1, "Logon"),
    # Account Change: 1 Create, 5 Disable, 6 Delete, 9 Lock, 10 MFA Factor Enable
    "user.create": (ACCOUNT_CHANGE, 1, "Create"),
    "user.delete": (ACCOUNT_CHANGE, 6, "Delete"),
    "account.lock": (ACCOUNT_CHANGE, 9, "Lock"),
    "mfa.enroll": (ACCOUNT_CHANGE, 10, "MFA Factor Enable"),
    # Compliance Finding: 1 Create, 3 Close
    "node.attest": (COMPLIANCE_FINDING, 1, "Create"),
    "node.certification.grant": (COMPLIANCE_FINDING, 1, "Create"),
    "node.certification.revoke": (COMPLIANCE_FINDING, 3, "Close"),
    # Detection Finding: 1 Create, 2 Update, 3 Close (an incident's life is one finding's)
    "incident.open": (DETECTION_FINDING, 1, "Create"),
    "incident.update": (DETECTION_FINDING, 2, "Update"),
    "incident.close": (DETECTION_FINDING, 3, "Close"),
    # an alert's end closes the finding its raise (alert.<rule>) created
    "alert.resolve": (DETECTION_FINDING, 3, "Close"),
}
# First matching prefix wins.
_PREFIX: list[tuple[str, tuple[int, int, str]]] = [
    ("alert.", (DETECTION_FINDING, 1, "Create")),
    ("incident.", (DETECTION_FINDING, 2, "Update")),
    ("compliance.", (COMPLIANCE_FINDING, 1, "Create")),
    ("auth.", (AUTHENTICATION, OTHER, "")),
    ("mfa.", (ACCOUNT_CHANGE, OTHER, "")),
    ("user.", (ACCOUNT_CHANGE, OTHER, "")),
    ("account.", (ACCOUNT_CHANGE, OTHER, "")),
    ("token.", (ACCOUNT_CHANGE, OTHER, "")),
    # Device Inventory Info: 1 Log (registration, inventory, state and identity of a node)
    ("node.", (DEVICE_INVENTORY_INFO, 1, "Log")),
    ("gpu.", (DEVICE_INVENTORY_INFO, 1, "Log")),
]
# API Activity: 1 Create, 2 Read, 3 Update, 4 Delete
_VERBS = {
    "create": (1, "Create"),
    "submit": (1, "Create"),
    "register": (1, "Create"),
    "load": (1, "Create"),
    "issue": (1, "Create"),
    "publish": (1, "Create"),
    "read": (2, "Read"),
    "update": (3, "Update"),
    "edit": (3, "Update"),
    "apply": (3, "Update"),
    "expire": (3, "Update"),
    "set": (3, "Update"),
    "quota": (3, "Update"),
    "place": (3, "Update"),
    "pending": (3, "Update"),
    "running": (3, "Update"),
    "dispatch": (3, "Update"),
    "cancel": (3, "Update"),
    "succeeded": (3, "Update"),
    "failed": (3, "Update"),
    "cancelled": (3, "Update"),
    "evict": (3, "Update"),
    "state": (3, "Update"),
    "repartition": (3, "Update"),
    "rotate": (3, "Update"),
    "rewrap": (3, "Update"),
    "disable": (3, "Update"),
    "enable": (3, "Update"),
    "revoke": (3, "Update"),
    "delete": (4, "Delete"),
    "remove": (4, "Delete"),
    "destroy": (4, "Delete"),
}


def classify(action: str) -> ClassActivity:
    """The OCSF class and activity for one of our actions."""
    target = _EXACT.get(action)
    if target is None:
        target = next((t for prefix, t in _PREFIX if action.startswith(prefix)), None)
    if target is None:
        verb = action.rsplit(".", 1)[-1]
        activity_id, caption = _VERBS.get(verb, (OTHER, ""))
        target = (API_ACTIVITY, activity_id, caption)
    class_uid, activity_id, caption = target
    return ClassActivity(class_uid, activity_id, action if activity_id == OTHER else caption)


def _details(event: Event) -> dict[str, Any]:
    return event.details if isinstance(event.details, dict) else {}


def severity_id(event: Event, cls: ClassActivity) -> int:
    """1 Informational, 2 Low, 3 Medium, 4 High, 5 Critical."""
    details = _details(event)
    if cls.class_uid == DETECTION_FINDING:
        raw = details.get("severity")
        if isinstance(raw, dict):  # an incident's severity changed: {"from": …, "to": …}
            raw = raw.get("to")
        known = _ALERT_SEVERITY.get(str(raw or "").lower())
        if known is not None:
            return known
        # an alert without one is High; an incident event that does not carry the incident's
        # severity (an update of its owner, its close) leaves it Unknown
        return 0 if event.action.startswith(_INCIDENT) else 4
    if event.action == "node.attest" and event.outcome is not Outcome.SUCCESS:
        return 4 if details.get("enforce", True) else 3
    if event.outcome is Outcome.DENIED:
        return 3
    if event.outcome is Outcome.FAILURE:
        return 2
    return 1


def _user(name: str) -> dict[str, Any]:
    """An OCSF user: type System for the control plane's own actor, else User."""
    system = name == "system"
    return {"name": name, "uid": name, "type_id": 3 if system else 1,
            "type": "System" if system else "User"}  # fmt: skip


def _hostname(name: str | None) -> str | None:
    return name if name and len(name) <= 253 and _HOSTNAME.match(name) else None


def _control_plane(hostname: str | None) -> dict[str, Any]:
    """The control plane as a network endpoint (where the API calls and logins arrive)."""
    out: dict[str, Any] = {"svc_name": PRODUCT, "name": PRODUCT}
    host = _hostname(hostname)
    if host:
        out["hostname"] = host
    return out


def _source(details: dict[str, Any]) -> dict[str, Any] | None:
    """The client's endpoint, when the event recorded its address."""
    raw = details.get("source_ip")
    if not isinstance(raw, str):
        return None
    try:
        ip = ipaddress.ip_address(raw.strip())
    except ValueError:
        return None
    return {"ip": str(ip)}


def _device(name: str, details: dict[str, Any]) -> dict[str, Any]:
    """A node as an OCSF device (a server)."""
    out: dict[str, Any] = {"name": name, "uid": name, "type_id": 1, "type": "Server"}
    host = _hostname(name)
    if host:
        out["hostname"] = host
    if isinstance(details.get("region"), str) and details["region"]:
        out["region"] = details["region"]
    return out


def to_ocsf(
    event: Event,
    leaf_hash: bytes,
    *,
    product_version: str,
    ocsf_version: str = OCSF_VERSION,
    hostname: str | None = None,
) -> dict[str, Any]:
    """One event as an OCSF event object of schema ``ocsf_version`` (one of ``VERSIONS``).

    ``hostname``: the control plane's host name (the endpoint logins and API calls reach)."""
    if ocsf_version not in VERSIONS:
        raise ValueError(f"OCSF {ocsf_version} is not supported; one of {', '.join(VERSIONS)}")
    cls = classify(event.action)
    sev = severity_id(event, cls)
    millis = epoch_millis(event.ts)
    product = {"name": PRODUCT, "vendor_name": VENDOR, "version": product_version}
    metadata: dict[str, Any] = {
        "version": ocsf_version,
        "product": product,
        "log_name": "audit",
        "log_provider": PRODUCT,
        "sequence": event.seq,
        "uid": leaf_hash.hex(),
    }
    out: dict[str, Any] = {
        "class_uid": cls.class_uid,
        "class_name": CLASS_NAMES[cls.class_uid],
        "category_uid": cls.category_uid,
        "category_name": CATEGORY_NAMES[cls.category_uid],
        "activity_id": cls.activity_id,
        "activity_name": cls.activity_name,
        "type_uid": cls.type_uid,
        "type_name": cls.type_name,
        "severity_id": sev,
        "severity": SEVERITIES[sev],
        "time": millis,
        "timezone_offset": 0,
        "message": f"{event.action} {event.target_type}/{event.target_id} ({event.outcome.value})",
        "metadata": metadata,
        "unmapped": {
            "proofplane": {
                "seq": event.seq,
                "leaf_hash": leaf_hash.hex(),
                "action": event.action,
                "target_type": event.target_type,
                "target_id": event.target_id,
                "outcome": event.outcome.value,
                "details": event.details,
            }
        },
    }
    reason = _details(event).get("reason")
    if cls.class_uid in FINDINGS:
        # status_id is the consumer's triage state here; the outcome goes in the finding
        metadata["profiles"] = ["host"]
        out["actor"] = {"user": _user(event.actor)}
    else:
        ok = event.outcome is Outcome.SUCCESS
        out["status_id"], out["status"] = (1, "Success") if ok else (2, "Failure")
        if not ok:
            out["status_detail"] = str(reason) if reason else event.outcome.value
    out.update(_class_fields(event, cls, product, hostname))
    return out


def _class_fields(
    event: Event, cls: ClassActivity, product: dict[str, Any], hostname: str | None
) -> dict[str, Any]:
    """The attributes each class defines besides the base event's."""
    details = _details(event)
    source = _source(details)
    if cls.class_uid == AUTHENTICATION:
        return _authentication(event, product, hostname, source)
    if cls.class_uid == ACCOUNT_CHANGE:
        user = event.target_id if event.target_type == "user" else event.actor
        out: dict[str, Any] = {"user": _user(user), "actor": {"user": _user(event.actor)}}
        if source:
            out["src_endpoint"] = source
        return out
    if cls.class_uid == DEVICE_INVENTORY_INFO:
        return {"device": _device(event.target_id, details),
                "actor": {"user": _user(event.actor)}}  # fmt: skip
    if cls.class_uid == COMPLIANCE_FINDING:
        return _compliance_finding(event, cls, details)
    if cls.class_uid == DETECTION_FINDING:
        resource = {"type": event.target_type, "uid": event.target_id, "name": event.target_id}
        # an incident's events (open, update, close) are one finding's life: one uid
        incident = event.action.startswith(_INCIDENT)
        return {
            "finding_info": {
                "uid": f"proofplane-incident-{event.target_id}"
                if incident
                else f"proofplane-{event.seq}",
                "title": f"{event.action} on {event.target_type} {event.target_id}",
                "types": [event.action],
                "created_time": epoch_millis(event.ts),
            },
            "resources": [resource],
        }
    return {
        "actor": {"user": _user(event.actor)},
        "api": {"operation": event.action, "service": {"name": PRODUCT}},
        "resources": [
            {"type": event.target_type, "uid": event.target_id, "name": event.target_id}
        ],  # fmt: skip
        "src_endpoint": source or {"name": "unknown"},
        "dst_endpoint": _control_plane(hostname),
    }


_PROTOCOLS = {"oidc": (4, "OpenID")}


def _authentication(
    event: Event, product: dict[str, Any], hostname: str | None, source: dict[str, Any] | None
) -> dict[str, Any]:
    details = _details(event)
    method = str(details.get("method") or ("recovery_code" if event.action.startswith("mfa.")
                                            else "password"))  # fmt: skip
    protocol_id, protocol = _PROTOCOLS.get(method, (OTHER, method.replace("_", " ").title()))
    mfa = bool(details.get("mfa")) or event.action == "mfa.recovery_code.use"
    if details.get("reason") in ("totp", "totp_replayed"):
        mfa = True  # the second factor was what failed
    out: dict[str, Any] = {
        "user": _user(event.target_id if event.target_type == "user" else event.actor),
        "service": {"name": PRODUCT, "version": product["version"]},
        "dst_endpoint": _control_plane(hostname),
        "auth_protocol_id": protocol_id,
        "auth_protocol": protocol,
        "logon_type_id": 3,  # Network: over the API
        "logon_type": "Network",
        "is_mfa": mfa,
        "actor": {"user": _user(event.actor)},
    }
    if source:  # is_remote only when the address says so; unknown, it is left out
        out["src_endpoint"] = source
        out["is_remote"] = not ipaddress.ip_address(source["ip"]).is_loopback
    if isinstance(details.get("token_id"), str):
        out["session"] = {"uid": details["token_id"], "is_mfa": mfa}
    return out


def _compliance_finding(
    event: Event, cls: ClassActivity, details: dict[str, Any]
) -> dict[str, Any]:
    passed = event.outcome is Outcome.SUCCESS
    created = epoch_millis(event.ts)
    info: dict[str, Any] = {"uid": f"proofplane-{event.seq}", "types": [event.action],
                            "created_time": created}  # fmt: skip
    resource: dict[str, Any] = {"type": event.target_type, "uid": event.target_id,
                                "name": event.target_id}  # fmt: skip
    out: dict[str, Any] = {"finding_info": info, "resource": resource}
    if event.target_type == "node":
        out["device"] = _device(event.target_id, details)
    if event.action == "node.attest":
        reasons = [str(r) for r in details.get("reasons") or []]
        passed = passed and bool(details.get("ok", True))
        node_class = str(details.get("node_class") or "default")
        verdict = "passed" if passed else "failed"
        info["title"] = f"Attestation of node {event.target_id} {verdict}"
        info["desc"] = (
            f"Measured boot, TPM quote and GPU firmware of node {event.target_id} checked "
            f"against the {node_class!r} attestation policy: {verdict}"
            + (f" ({', '.join(reasons)})" if reasons else "")
        )
        compliance: dict[str, Any] = {
            "standards": [ATTESTATION_STANDARD],
            "control": ATTESTATION_CONTROL,
            "requirements": [f"proofplane attestation policy {node_class}"],
            "status_id": 1 if passed else 3,
            "status": "Pass" if passed else "Fail",
        }
        if reasons:
            compliance["status_code"] = reasons[0]
            compliance["status_detail"] = ", ".join(reasons)
        data = {k: details[k] for k in ("gpu_uuids", "evidence_hash", "policy_id", "policy_hash",
                                        "evidence_id") if k in details}  # fmt: skip
        if data:
            resource["data"] = data
        out["compliance"] = compliance
        return out
    key, value = details.get("key"), details.get("value")
    standard = str(key) if key else event.action.removeprefix("compliance.")
    control = f"{key}={value}" if key and value is not None else standard
    info["title"] = f"{event.action} {control} on {event.target_type} {event.target_id}"
    if cls.activity_id == 3:  # a certification withdrawn: no longer asserted
        status_id, status = OTHER, "Revoked"
    else:
        status_id, status = (1, "Pass") if passed else (3, "Fail")
    out["compliance"] = {"standards": [standard], "control": control,
                         "status_id": status_id, "status": status}  # fmt: skip
    return out
