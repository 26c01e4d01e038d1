"""Reading the event record. (Writing is ``Tx.record``, inside each change's transaction.)"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import NotFound
from proofplane.model import Event, Outcome
from proofplane.service.context import Store
from proofplane.service.pagination import Page, check_limit, decode_cursor, paginate
from proofplane.store.tables import EventRow


def event_from_row(row: EventRow) -> Event:
    return Event(
        seq=row.seq,
        ts=row.ts,
        actor=row.actor,
        action=row.action,
        target_type=row.target_type,
        target_id=row.target_id,
        outcome=Outcome(row.outcome),
        details=dict(row.details),
    )


_E = EventRow.__table__.c
_EVENT_COLUMNS = (
    _E.seq, _E.ts, _E.actor, _E.action, _E.target_type, _E.target_id, _E.outcome, _E.details
)  # fmt: skip


def _events(session: Session, query: Select[Any]) -> list[Event]:
    """Events straight from result rows (no ORM objects: the log is read in pages of
    hundreds)."""
    return [
        Event(
            seq=seq,
            ts=ts,
            actor=actor,
            action=action,
            target_type=target_type,
            target_id=target_id,
            outcome=Outcome(outcome),
            details=dict(details),
        )
        for seq, ts, actor, action, target_type, target_id, outcome, details in (
            session.connection().execute(query)
        )
    ]


def list_events(
    store: Store,
    actor: Actor,
    *,
    action: str | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
    actor_name: str | None = None,
    outcome: Outcome | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    newest_first: bool = False,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[Event]:
    """Events in sequence order (``newest_first`` reverses it). ``action`` ending in ``*``
    matches a prefix (``workload.*`` → every workload action)."""
    authorize(actor, Permission.EVENTS_READ)
    check_limit(limit)
    kind = "events-desc" if newest_first else "events"
    after = decode_cursor(kind, cursor, int)
    query = select(*_EVENT_COLUMNS).order_by(EventRow.seq.desc() if newest_first else EventRow.seq)
    if after is not None:
        query = query.where(EventRow.seq < after if newest_first else EventRow.seq > after)
    if action is not None:
        prefix = action.rstrip("*")
        if action.endswith("*"):
            query = query.where(EventRow.action.startswith(prefix, autoescape=True))
        else:
            query = query.where(EventRow.action == action)
    if target_type is not None:
        query = query.where(EventRow.target_type == target_type)
    if target_id is not None:
        query = query.where(EventRow.target_id == target_id)
    if actor_name is not None:
        query = query.where(EventRow.actor == actor_name)
    if outcome is not None:
        query = query.where(EventRow.outcome == outcome.value)
    if since is not None:
        query = query.where(EventRow.ts >= since)
    if until is not None:
        query = query.where(EventRow.ts < until)
    with store.read() as session:
        items = _events(session, query.limit(limit + 1))
    return paginate(kind, items, limit, items[limit - 1].seq if len(items) > limit else None)


def get_event(store: Store, actor: Actor, seq: int) -> Event:
    authorize(actor, Permission.EVENTS_READ)
    with store.read() as session:
        row = session.get(EventRow, seq)
        if row is None:
            raise NotFound(f"event {seq} not found", details={"seq": seq})
        return event_from_row(row)
