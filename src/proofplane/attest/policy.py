"""Attestation policy: what a node of a class must prove (golden PCRs, boot chain, GPU firmware).

A policy is a frozen value with a canonical JSON form; its hash goes into every verdict so an
auditor knows exactly which rules a node was judged by.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from proofplane.attest.errors import AttestError

DEFAULT_REQUIRED_PCRS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
DEFAULT_EVENTLOG_PCRS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)


class PolicyError(AttestError):
    """A policy document that cannot be used (bad field, bad hex, unknown key)."""

    code = "policy_invalid"


def canonical_json(value: Any) -> bytes:
    """The canonical JSON encoding hashed for evidence and policies: sorted keys, no spaces,
    ASCII only. Same value, same bytes, on every machine."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _hexset(values: Any, what: str) -> frozenset[bytes]:
    if not isinstance(values, list | tuple | set | frozenset):
        raise PolicyError(f"{what} must be a list of hex digests")
    out = set()
    for v in values:
        try:
            out.add(bytes.fromhex(v) if isinstance(v, str) else bytes(v))
        except (ValueError, TypeError):
            raise PolicyError(f"{what}: {v!r} is not a hex digest") from None
    return frozenset(out)


@functools.lru_cache(maxsize=1024)
def parse_version(text: str) -> tuple[int, ...]:
    """'550.54.15' → (550, 54, 15); PolicyError when a component is not a number."""
    try:
        return tuple(int(p) for p in str(text).strip().split("."))
    except ValueError:
        raise PolicyError(
            f"version {text!r} is not dotted numbers", reason="version_invalid"
        ) from None


@dataclass(frozen=True, slots=True)
class Policy:
    """What a node class must prove. ``None`` for an allow-list means "not checked"; an empty
    allow-list allows nothing. An empty ``golden_pcrs`` checks no PCR values — the quote itself
    (signature, nonce, digest, freshness, clock) is still checked in full."""

    id: str = "default"
    node_class: str = "default"
    pcr_bank: str = "sha256"
    required_pcrs: tuple[int, ...] = DEFAULT_REQUIRED_PCRS
    golden_pcrs: Mapping[int, frozenset[bytes]] = field(default_factory=dict)
    require_eventlog: bool = True
    eventlog_pcrs: tuple[int, ...] = DEFAULT_EVENTLOG_PCRS
    require_secure_boot: bool = True
    allowed_boot_apps: frozenset[bytes] | None = None
    allowed_kernels: frozenset[bytes] | None = None
    require_inventory: bool = True
    allowed_vbios: frozenset[str] | None = None
    min_driver: str | None = None
    max_quote_age_s: float = 300.0
    _hash: str = field(default="", init=False, repr=False, compare=False)
    _vbios: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    _min_driver: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # freeze the golden map (the hash is computed once and must stay true)
        golden = MappingProxyType({int(k): frozenset(v) for k, v in self.golden_pcrs.items()})
        object.__setattr__(self, "golden_pcrs", golden)
        if self.allowed_vbios is not None:
            vbios = frozenset(v.strip().upper() for v in self.allowed_vbios)
            object.__setattr__(self, "_vbios", vbios)
        if self.min_driver is not None:
            object.__setattr__(self, "_min_driver", parse_version(self.min_driver))
        object.__setattr__(
            self, "_hash", hashlib.sha256(canonical_json(self.to_json())).hexdigest()
        )

    def to_json(self) -> dict[str, Any]:
        def hexes(s: frozenset[bytes] | None) -> list[str] | None:
            return None if s is None else sorted(v.hex() for v in s)

        return {
            "id": self.id,
            "node_class": self.node_class,
            "pcr_bank": self.pcr_bank,
            "required_pcrs": sorted(self.required_pcrs),
            "golden_pcrs": {str(k): hexes(v) for k, v in sorted(self.golden_pcrs.items())},
            "require_eventlog": self.require_eventlog,
            "eventlog_pcrs": sorted(self.eventlog_pcrs),
            "require_secure_boot": self.require_secure_boot,
            "allowed_boot_apps": hexes(self.allowed_boot_apps),
            "allowed_kernels": hexes(self.allowed_kernels),
            "require_inventory": self.require_inventory,
            "allowed_vbios": None if self.allowed_vbios is None else sorted(self.allowed_vbios),
            "min_driver": self.min_driver,
            "max_quote_age_s": self.max_quote_age_s,
        }

    @property
    def hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON of this policy."""
        return self._hash

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Policy:
        """Build a policy from its JSON form; unknown keys are an error (a typo must not
        silently drop a rule)."""
        if not isinstance(data, Mapping):
            raise PolicyError("policy must be a JSON object")
        known = {k for k in cls.__dataclass_fields__ if not k.startswith("_")}
        unknown = set(data) - known
        if unknown:
            raise PolicyError(f"unknown policy keys: {', '.join(sorted(unknown))}")
        kw: dict[str, Any] = {}
        try:
            for key in ("id", "node_class", "pcr_bank"):
                if key in data:
                    kw[key] = str(data[key])
            for key in ("required_pcrs", "eventlog_pcrs"):
                if key in data:
                    pcrs = tuple(int(i) for i in data[key])
                    if any(not 0 <= i <= 23 for i in pcrs):
                        raise PolicyError(f"{key}: PCR indexes are 0 to 23")
                    kw[key] = pcrs
            if "golden_pcrs" in data:
                golden = {}
                for k, v in dict(data["golden_pcrs"]).items():
                    idx = int(k)
                    if not 0 <= idx <= 23:
                        raise PolicyError("golden_pcrs: PCR indexes are 0 to 23")
                    golden[idx] = _hexset([v] if isinstance(v, str) else v, f"golden_pcrs[{k}]")
                kw["golden_pcrs"] = golden
            for key in ("require_eventlog", "require_secure_boot", "require_inventory"):
                if key in data:
                    if not isinstance(data[key], bool):
                        raise PolicyError(f"{key} must be true or false")
                    kw[key] = data[key]
            for key in ("allowed_boot_apps", "allowed_kernels"):
                if data.get(key) is not None:
                    kw[key] = _hexset(data[key], key)
            if data.get("allowed_vbios") is not None:
                kw["allowed_vbios"] = frozenset(
                    str(v).strip().upper() for v in data["allowed_vbios"]
                )
            if data.get("min_driver") is not None:
                parse_version(data["min_driver"])
                kw["min_driver"] = str(data["min_driver"])
            if "max_quote_age_s" in data:
                age = float(data["max_quote_age_s"])
                if not age > 0:
                    raise PolicyError("max_quote_age_s must be positive")
                kw["max_quote_age_s"] = age
        except PolicyError:
            raise
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"bad policy: {exc}") from None
        return cls(**kw)
