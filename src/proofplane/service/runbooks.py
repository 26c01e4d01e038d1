"""Runbooks (issue 12, part 8): the shipped set, published versions, and which one answers an
event.

Where versions live: the shipped runbooks (``proofplane/data/runbooks/*.md``) are version 1 of
their ids. A new version is published only through an approved ``runbook.publish`` change,
whose apply function is :func:`publish_runbook`. There is no runbook table: a published
version is the ``runbook.publish`` event itself, carrying the full text (at most 64 KiB) in its
details, so every version is in the tamper-evident audit log with its inclusion proof. The
current version of an id is the newest one among the shipped file and the published events.

:func:`with_runbook` is what an alert uses to name the runbook that answers it
(``"runbook": "<id>@v<N>"`` in its details).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane.access import Actor, Forbidden, Permission, authorize
from proofplane.errors import Conflict, NotFound
from proofplane.govern.runbooks import Runbook, invalid, parse_runbook
from proofplane.govern.runbooks import runbook_for as match_runbook
from proofplane.service.context import Store, Tx
from proofplane.store.tables import EventRow

PUBLISH_ACTION = "runbook.publish"
SHIPPED, PUBLISHED = "shipped", "published"


@dataclass(frozen=True, slots=True)
class Version:
    """One version of a runbook and where it came from."""

    runbook: Runbook
    source: str  # shipped | published
    seq: int | None = None  # the runbook.publish event
    change_id: int | None = None

    def summary(self) -> dict[str, Any]:
        return {**self.runbook.summary(), "source": self.source, "event_seq": self.seq,
                "change_id": self.change_id}  # fmt: skip

    def full(self) -> dict[str, Any]:
        return {**self.summary(), "steps": self.runbook.body, "text": self.runbook.text}


@lru_cache(maxsize=1)
def shipped() -> tuple[Runbook, ...]:
    """The runbooks that ship with the package, by id (a file that does not parse is a
    packaging bug: it raises here and in the tests)."""
    folder = resources.files("proofplane") / "data" / "runbooks"
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".md"):
            rb = parse_runbook(entry.read_text("utf-8"))
            if rb.version != 1 or f"{rb.id}.md" != entry.name:
                raise ValueError(f"shipped runbook {entry.name} must be {rb.id}.md at version 1")
            out.append(rb)
    return tuple(out)


def _published(session: Session) -> list[Version]:
    rows = session.execute(
        select(EventRow.seq, EventRow.details)
        .where(EventRow.action == PUBLISH_ACTION)
        .order_by(EventRow.seq)
    )
    out = []
    for seq, details in rows:
        text = details.get("text") if isinstance(details, Mapping) else None
        rb = parse_runbook(text)  # validated when published: the same parser accepts it
        out.append(Version(rb, PUBLISHED, seq, details.get("change_id")))
    return out


def versions(session: Session | None) -> dict[str, dict[int, Version]]:
    """Every version of every runbook: id → version → where it came from."""
    out: dict[str, dict[int, Version]] = {}
    for rb in shipped():
        out.setdefault(rb.id, {})[rb.version] = Version(rb, SHIPPED)
    for v in _published(session) if session is not None else ():
        out.setdefault(v.runbook.id, {})[v.runbook.version] = v
    return out


def current(session: Session | None) -> list[Runbook]:
    """The newest version of each runbook, by id (shipped only without a session)."""
    return [byver[max(byver)].runbook for _id, byver in sorted(versions(session).items())]


def runbook_for(
    action: str, outcome: str | None, session: Session | None = None
) -> tuple[str, int] | None:
    """(id, version) of the current runbook that answers an event, or None. With ``session``
    published versions count; without it only the shipped ones."""
    return match_runbook(action, outcome, current(session))


def with_runbook(
    details: dict[str, Any] | None,
    action: str,
    outcome: str | None,
    session: Session | None = None,
) -> dict[str, Any]:
    """``details`` plus ``{"runbook": "<id>@v<N>"}`` when a runbook answers the event."""
    out = dict(details or {})
    found = runbook_for(action, outcome, session)
    if found is not None:
        out["runbook"] = f"{found[0]}@v{found[1]}"
    return out


def publish_runbook(tx: Tx, text: Any, *, change_id: int | None = None) -> dict[str, Any]:
    """Store a new version (inside the ``runbook.publish`` change's transaction): the text must
    parse and its version be newer than every version of its id. The version is the event."""
    rb = parse_runbook(text)
    known = versions(tx.session).get(rb.id, {})
    newest = max(known, default=0)
    if rb.version <= newest:
        raise Conflict(
            f"runbook {rb.id!r} is already at version {newest}: publish version {newest + 1}",
            code="runbook_version_not_newer",
            details={"id": rb.id, "version": rb.version, "current": newest},
        )
    event = tx.record(
        PUBLISH_ACTION,
        "runbook",
        rb.id,
        details={
            **rb.summary(),
            "previous": newest or None,
            "change_id": change_id,
            "text": rb.text,
        },  # fmt: skip
    )
    return Version(rb, PUBLISHED, event.seq, change_id).summary()


def check_runbook(text: Any) -> dict[str, Any]:
    """Parse without storing (a change's payload check and its diff): the summary."""
    return parse_runbook(text).summary()


def _authorize_read(actor: Actor) -> None:
    """Anyone who reads nodes or the audit log reads the runbooks."""
    try:
        authorize(actor, Permission.NODES_READ)
    except Forbidden:
        authorize(actor, Permission.AUDIT_READ)


def list_runbooks(store: Store, actor: Actor) -> list[dict[str, Any]]:
    """The current version of every runbook, by id, with the versions it has."""
    _authorize_read(actor)
    with store.read() as session:
        found = versions(session)
    return [
        {**byver[max(byver)].summary(), "versions": sorted(byver)}
        for _id, byver in sorted(found.items())
    ]


def get_runbook(
    store: Store, actor: Actor, runbook_id: str, version: int | None = None
) -> dict[str, Any]:
    """One runbook with its steps: the current version, or ``version``."""
    _authorize_read(actor)
    if version is not None and (isinstance(version, bool) or version < 1):
        raise invalid("version is a whole number from 1")
    with store.read() as session:
        byver = versions(session).get(runbook_id)
    if not byver:
        raise NotFound(f"runbook {runbook_id!r} not found", code="runbook_not_found",
                       details={"id": runbook_id})  # fmt: skip
    chosen = max(byver) if version is None else version
    if chosen not in byver:
        raise NotFound(
            f"runbook {runbook_id!r} has no version {chosen}",
            code="runbook_not_found",
            details={"id": runbook_id, "version": chosen, "versions": sorted(byver)},
        )
    return {**byver[chosen].full(), "versions": sorted(byver)}
