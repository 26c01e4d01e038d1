"""Compliance tags and labels: ``key=value`` pairs with Kubernetes-label-like syntax.

Tags drive placement (a workload's tags must be a subset of a node's certifications), so their
spelling is validated strictly: a typo must fail loudly, not silently match nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from proofplane.errors import ValidationFailed

_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?$")
_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


NAME_PATTERN = r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$"  # nodes, tenants, workloads (DNS label)
_NAME = re.compile(NAME_PATTERN)

# Bounds shared by the API's bodies and the services (issue 19, §3): a tag set travels in every
# event about its workload or node, and so to every SIEM.
MAX_NAME_CHARS = 63  # a node, tenant or workload name (what NAME_PATTERN allows)
MAX_TAGS = 64  # pairs in one tag set (workload tags, node labels, a profile's required tags)
MAX_TAG_CHARS = 63  # a tag's key, and its value (what the key and value patterns allow)


def validate_name(name: str, what: str) -> str:
    """Names of nodes, tenants and workloads are DNS-label-like, so they are safe everywhere
    (URLs, Slurm node lists, Kubernetes objects, file names)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValidationFailed(
            f"invalid {what} name {name!r}: lowercase letters, digits and '-', "
            "starting with a letter, at most 63 characters",
            code="invalid_name",
            details={"name": name},
        )
    return name


def validate_tags(tags: Mapping[str, str], *, field: str = "tags") -> dict[str, str]:
    """Return a sorted copy of ``tags`` or raise ValidationFailed naming every bad pair (or
    saying there are more than ``MAX_TAGS``)."""
    if len(tags) > MAX_TAGS:
        raise ValidationFailed(
            f"{field}: {len(tags)} pairs, at most {MAX_TAGS}",
            code="too_many_tags",
            details={"field": field, "count": len(tags), "limit": MAX_TAGS},
        )
    bad: list[str] = []
    for key, value in tags.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            bad.append(f"key {key!r}: lowercase letters, digits, '.', '_', '-', '/' (max 63)")
        elif not isinstance(value, str) or not _VALUE.fullmatch(value):
            bad.append(f"value {value!r} of {key!r}: letters, digits, '.', '_', '-' (max 63)")
    if bad:
        raise ValidationFailed(f"invalid {field}", code="invalid_tag", details={field: bad})
    return dict(sorted(tags.items()))


def parse_tag_pairs(pairs: Iterable[str], *, field: str = "tags") -> dict[str, str]:
    """Parse ``["hipaa=true", "gdpr-zone=frankfurt"]`` (the CLI's form) into a validated dict."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValidationFailed(
                f"{field}: {pair!r} is not key=value", code="invalid_tag", details={field: [pair]}
            )
        if key in out and out[key] != value:
            raise ValidationFailed(
                f"{field}: {key!r} given twice", code="invalid_tag", details={field: [pair]}
            )
        out[key] = value
    return validate_tags(out, field=field)


def missing_tags(required: Mapping[str, str], held: Mapping[str, str]) -> dict[str, str]:
    """The required pairs that ``held`` does not carry with exactly the same value."""
    return {k: v for k, v in required.items() if held.get(k) != v}
