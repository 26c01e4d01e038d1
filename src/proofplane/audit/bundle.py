"""Offline evidence bundles: selected entries, each with its inclusion proof against one
signed checkpoint, the checkpoint, and the verifier key, in one JSON file. Pure: ``verify``
needs no server and no database, only this file (and, ideally, the verifier key obtained
out of band, to pin).

Format ``proofplane-audit-bundle/v1``::

    {"format": "proofplane-audit-bundle/v1", "created_at": "...", "selection": {...},
     "verifier_key": "<name>+<key id>+<base64>", "checkpoint": "<signed note>",
     "entries": [{"index": 0, "entry": "<base64 canonical bytes>",
                  "leaf_hash": "<hex>", "proof": ["<hex>", ...]}]}
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from proofplane.audit import merkle, note
from proofplane.errors import ProofplaneError

FORMAT = "proofplane-audit-bundle/v1"


class BundleError(ProofplaneError, ValueError):
    """The bundle is malformed (not a verdict on its contents)."""

    code = "bundle_malformed"


@dataclass
class BundleReport:
    ok: bool
    origin: str = ""
    tree_size: int = 0
    entries: int = 0
    failures: list[str] = field(default_factory=list)


def make_bundle(
    *,
    checkpoint: str,
    verifier_key: str,
    items: Sequence[tuple[int, bytes, Sequence[bytes]]],
    created_at: datetime,
    selection: dict[str, Any],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "created_at": created_at.isoformat(),
        "selection": selection,
        "verifier_key": verifier_key,
        "checkpoint": checkpoint,
        "entries": [
            {
                "index": index,
                "entry": base64.b64encode(entry).decode(),
                "leaf_hash": merkle.leaf_hash(entry).hex(),
                "proof": [p.hex() for p in proof],
            }
            for index, entry, proof in items
        ],
    }


def parse(raw: bytes | str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"not a JSON document: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"not a {FORMAT} bundle")
    for key, kind in (("verifier_key", str), ("checkpoint", str), ("entries", list)):
        if not isinstance(data.get(key), kind):
            raise BundleError(f"bundle field {key!r} is missing or not a {kind.__name__}")
    return data


def verify(raw: bytes | str, trusted_key: str | None = None) -> BundleReport:
    """Check the checkpoint signature, then every entry's leaf hash and inclusion proof.
    ``trusted_key``: the verifier key the auditor holds; the bundle's own key must equal it."""
    data = parse(raw)
    key_text = data["verifier_key"]
    if trusted_key is not None and trusted_key.strip() != key_text.strip():
        return BundleReport(False, failures=["the bundle is signed by a key you do not trust"])
    try:
        vk = note.parse_verifier_key(key_text)
        cp = note.verify_checkpoint(data["checkpoint"], vk)
    except note.NoteError as exc:
        return BundleReport(False, failures=[f"checkpoint: {exc}"])
    report = BundleReport(True, cp.origin, cp.size, len(data["entries"]))
    for n, item in enumerate(data["entries"]):
        index, entry, claimed, proof = _item(n, item)
        lh = merkle.leaf_hash(entry)
        if lh != claimed:
            report.failures.append(f"entry {index}: the leaf hash does not match the entry")
        elif not merkle.verify_inclusion(lh, index, cp.size, proof, cp.root_hash):
            report.failures.append(f"entry {index}: the inclusion proof does not verify")
    report.ok = not report.failures
    return report


def _item(n: int, item: Any) -> tuple[int, bytes, bytes, list[bytes]]:
    try:
        index = item["index"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise BundleError(f"entries[{n}].index is not a non-negative integer")
        entry = base64.b64decode(item["entry"], validate=True)
        claimed = bytes.fromhex(item["leaf_hash"])
        proof = [bytes.fromhex(p) for p in item["proof"]]
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise BundleError(f"entries[{n}] is malformed: {exc}") from exc
    return index, entry, claimed, proof
