"""Events as OCSF 1.1 JSON objects. Pure: an event in, a dict out.

Each event maps to one OCSF class by its action (``mapping``); the identifiers follow the
schema's rules: ``category_uid`` is the class's category (``class_uid // 1000``) and
``type_uid = class_uid * 100 + activity_id``. Anything not mapped explicitly is an API Activity
(every change in proofplane arrives through its API), with activity Other (99) unless the verb
says create, read, update or delete.

``metadata.sequence`` is the event's sequence number and ``metadata.uid`` its Merkle leaf hash
(hex); the original event rides along under ``unmapped.proofplane`` so nothing is lost to the
mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proofplane.model import Event, Outcome

OCSF_VERSION = "1.1.0"
#: the schema versions this module can write (the setting ``PROOFPLANE_OCSF_VERSION``)
VERSIONS = (OCSF_VERSION,)

# classes
DETECTION_FINDING = 2004
COMPLIANCE_FINDING = 2003
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


@dataclass(frozen=True, slots=True)
class ClassActivity:
    class_uid: int
    activity_id: int
    activity_name: str

    @property
    def category_uid(self) -> int:
        return self.class_uid // 1000

    @property
    def type_uid(self) -> int:
        return self.class_uid * 100 + self.activity_id


_EXACT: dict[str, tuple[int, int, str]] = {
    # Authentication: 1 Logon, 2 Logoff, 99 Other
    "auth.login": (AUTHENTICATION, 1, "Logon"),
    "auth.logout": (AUTHENTICATION, 2, "Logoff"),
    "mfa.recovery_code.use": (AUTHENTICATION, 1, "Logon"),
    # Account Change: 1 Create, 2 Enable, 5 Disable, 6 Delete, 9 Lock, 10 MFA Factor Enable
    "user.create": (ACCOUNT_CHANGE, 1, "Create"),
    "user.update": (ACCOUNT_CHANGE, OTHER, "Other"),
    "user.delete": (ACCOUNT_CHANGE, 6, "Delete"),
    "account.lock": (ACCOUNT_CHANGE, 9, "Lock"),
    "account.unlock": (ACCOUNT_CHANGE, OTHER, "Unlock"),
    "mfa.enroll": (ACCOUNT_CHANGE, 10, "MFA Factor Enable"),
    "token.issue": (ACCOUNT_CHANGE, OTHER, "Token Issue"),
    "token.rotate": (ACCOUNT_CHANGE, OTHER, "Token Rotate"),
    "token.revoke": (ACCOUNT_CHANGE, OTHER, "Token Revoke"),
    # Device Inventory Info: 1 Log
    "node.register": (DEVICE_INVENTORY_INFO, 1, "Log"),
    "node.update": (DEVICE_INVENTORY_INFO, 1, "Log"),
    "node.state": (DEVICE_INVENTORY_INFO, 1, "Log"),
    "node.inventory": (DEVICE_INVENTORY_INFO, 1, "Log"),
    # Compliance Finding: 1 Create, 3 Close
    "node.certification.grant": (COMPLIANCE_FINDING, 1, "Create"),
    "node.certification.revoke": (COMPLIANCE_FINDING, 3, "Close"),
}
# First matching prefix wins.
_PREFIX: list[tuple[str, tuple[int, int, str]]] = [
    ("alert.", (DETECTION_FINDING, 1, "Create")),
    ("attest.", (COMPLIANCE_FINDING, 1, "Create")),
    ("compliance.", (COMPLIANCE_FINDING, 1, "Create")),
    ("mfa.", (AUTHENTICATION, OTHER, "Other")),
    ("auth.", (AUTHENTICATION, OTHER, "Other")),
    ("user.", (ACCOUNT_CHANGE, OTHER, "Other")),
    ("node.", (DEVICE_INVENTORY_INFO, 1, "Log")),
    ("gpu.", (DEVICE_INVENTORY_INFO, 1, "Log")),
]
# API Activity: 1 Create, 2 Read, 3 Update, 4 Delete
_VERBS = {
    "create": (1, "Create"),
    "submit": (1, "Create"),
    "register": (1, "Create"),
    "load": (1, "Create"),
    "read": (2, "Read"),
    "update": (3, "Update"),
    "place": (3, "Update"),
    "pending": (3, "Update"),
    "cancel": (3, "Update"),
    "evict": (3, "Update"),
    "state": (3, "Update"),
    "delete": (4, "Delete"),
    "remove": (4, "Delete"),
}


def classify(action: str) -> ClassActivity:
    """The OCSF class and activity for one of our actions."""
    if action in _EXACT:
        return ClassActivity(*_EXACT[action])
    for prefix, target in _PREFIX:
        if action.startswith(prefix):
            return ClassActivity(*target)
    verb = action.rsplit(".", 1)[-1]
    activity_id, name = _VERBS.get(verb, (OTHER, "Other"))
    return ClassActivity(API_ACTIVITY, activity_id, name)


def _severity_id(event: Event, cls: ClassActivity) -> int:
    """1 Informational, 2 Low, 3 Medium, 4 High."""
    if cls.class_uid == DETECTION_FINDING:
        return 4
    if event.outcome is Outcome.DENIED:
        return 3
    if event.outcome is Outcome.FAILURE:
        return 2
    return 1


def _status(outcome: Outcome) -> tuple[int, str]:
    return (1, "Success") if outcome is Outcome.SUCCESS else (2, "Failure")


def to_ocsf(
    event: Event, leaf_hash: bytes, *, product_version: str, ocsf_version: str = OCSF_VERSION
) -> dict[str, Any]:
    """One event as an OCSF event object of schema ``ocsf_version`` (one of ``VERSIONS``)."""
    if ocsf_version not in VERSIONS:
        raise ValueError(f"OCSF {ocsf_version} is not supported; one of {', '.join(VERSIONS)}")
    cls = classify(event.action)
    status_id, status = _status(event.outcome)
    millis = int(event.ts.timestamp() * 1000)
    out: dict[str, Any] = {
        "class_uid": cls.class_uid,
        "class_name": CLASS_NAMES[cls.class_uid],
        "category_uid": cls.category_uid,
        "category_name": CATEGORY_NAMES[cls.category_uid],
        "activity_id": cls.activity_id,
        "activity_name": cls.activity_name,
        "type_uid": cls.type_uid,
        "type_name": f"{CLASS_NAMES[cls.class_uid]}: {cls.activity_name}",
        "severity_id": _severity_id(event, cls),
        "status_id": status_id,
        "status": status,
        "time": millis,
        "message": f"{event.action} {event.target_type}/{event.target_id} ({event.outcome.value})",
        "metadata": {
            "version": ocsf_version,
            "product": {
                "name": "proofplane",
                "vendor_name": "proofplane",
                "version": product_version,
            },
            "sequence": event.seq,
            "uid": leaf_hash.hex(),
            "log_name": "audit",
        },
        "actor": {"user": {"name": event.actor}},
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
    if event.outcome is not Outcome.SUCCESS:
        reason = event.details.get("reason") if isinstance(event.details, dict) else None
        out["status_detail"] = str(reason) if reason else event.outcome.value
    out.update(_class_fields(event, cls))
    return out


def _class_fields(event: Event, cls: ClassActivity) -> dict[str, Any]:
    """The attributes each class requires besides the base event's."""
    target = {"type": event.target_type, "uid": event.target_id, "name": event.target_id}
    if cls.class_uid in (AUTHENTICATION, ACCOUNT_CHANGE):
        user = event.target_id if event.target_type == "user" else event.actor
        return {"user": {"name": user, "uid": user}}
    if cls.class_uid == DEVICE_INVENTORY_INFO:
        return {
            "device": {
                "hostname": event.target_id,
                "name": event.target_id,
                "type_id": 1,
                "type": "Server",
            }
        }
    if cls.class_uid in (DETECTION_FINDING, COMPLIANCE_FINDING):
        info = {
            "uid": f"proofplane-{event.seq}",
            "title": f"{event.action} {event.target_type}/{event.target_id}",
            "types": [event.action],
        }
        extra: dict[str, Any] = {"finding_info": info, "resources": [target]}
        if cls.class_uid == COMPLIANCE_FINDING:
            passed = event.outcome is Outcome.SUCCESS
            extra["compliance"] = {
                "control": event.action,
                "standards": ["proofplane"],
                "status_id": 1 if passed else 3,
                "status": "Pass" if passed else "Fail",
            }
        return extra
    return {
        "api": {"operation": event.action, "service": {"name": "proofplane"}},
        "resources": [target],
        "src_endpoint": {"name": "proofplane"},
    }
