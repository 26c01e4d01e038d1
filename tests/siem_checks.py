"""Checks of recorded events as a SIEM receives them, shared by the SIEM and API tests: the
events of some actions, each encoded as OCSF (validated against the published 1.1.0 schema, no
errors and no warnings) and as CEF (the client address it carries)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from ocsf_schema_files import schema
from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import cef, ocsf, ocsf_schema
from proofplane.model import Event, Outcome
from proofplane.service.context import Store
from proofplane.store.tables import EventRow


def events_of(store: Store, *actions: str) -> list[Event]:
    with store.read() as session:
        rows = session.scalars(
            select(EventRow).where(EventRow.action.in_(actions)).order_by(EventRow.seq)
        )
        return [
            Event(r.seq, r.ts, r.actor, r.action, r.target_type, r.target_id,
                  Outcome(r.outcome), r.details)
            for r in rows
        ]  # fmt: skip


def valid_ocsf(event: Event) -> dict[str, Any]:
    out = ocsf.to_ocsf(event, event_leaf_hash(event), product_version="1", hostname="cp-1")
    errors = [str(f) for f in ocsf_schema.errors(schema().validate(out))]
    assert errors == [], (event.action, errors)
    warnings = [str(f) for f in schema().validate(out) if f.severity == ocsf_schema.WARNING]
    assert warnings == [], (event.action, warnings)
    return out


def cef_source(event: Event) -> str | None:
    line = cef.format_event(event, event_leaf_hash(event), product_version="1")
    for key in ("src", "c6a2"):
        for part in line.split(" "):
            if part.startswith(f"{key}="):
                return part.split("=", 1)[1]
    return None
