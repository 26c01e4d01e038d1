"""The unit of work: one transaction per use case, with its events written inside it.

``Store.write`` is the only way service code changes state. It opens a write transaction (the
single-writer lock, see ``store.db``), hands out a ``Tx`` whose ``record`` appends events with
gap-free sequence numbers, and commits state and events together, or neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from proofplane.access import Actor
from proofplane.errors import Conflict, Unavailable, ValidationFailed
from proofplane.model import Outcome
from proofplane.store.db import make_engine, read_session, write_session
from proofplane.store.tables import EventRow


class Tx:
    """A write transaction in progress: the session, who acts, and when."""

    def __init__(self, session: Session, actor: Actor, now: datetime) -> None:
        self.session = session
        self.actor = actor
        self.now = now
        self._next_seq: int | None = None

    def record(
        self,
        action: str,
        target_type: str,
        target_id: str,
        *,
        outcome: Outcome = Outcome.SUCCESS,
        details: dict[str, Any] | None = None,
    ) -> EventRow:
        """Append one event to this transaction. The single place events are written."""
        if self._next_seq is None:
            last = self.session.scalar(select(func.max(EventRow.seq)))
            self._next_seq = (last or 0) + 1
        row = EventRow(
            seq=self._next_seq,
            ts=self.now,
            actor=self.actor.name,
            action=action,
            target_type=target_type,
            target_id=target_id,
            outcome=outcome.value,
            details=details or {},
        )
        self._next_seq += 1
        self.session.add(row)
        return row


class Store:
    """The database a control plane instance works on."""

    def __init__(self, url: str, engine: Engine | None = None) -> None:
        self.url = url
        self.engine = engine or make_engine(url)

    @contextmanager
    def write(self, actor: Actor, now: datetime | None = None) -> Iterator[Tx]:
        session = write_session(self.engine)
        try:
            with session.begin():
                yield Tx(session, actor, now or datetime.now(UTC))
        except IntegrityError as exc:
            # Services check uniqueness first under the writer lock; this is the safety net.
            raise Conflict(
                "the change conflicts with existing data", details=str(exc.orig)
            ) from exc
        except DataError as exc:
            raise _unstorable(exc) from exc
        except OperationalError as exc:
            raise Unavailable("the database is unavailable", details=str(exc.orig)) from exc
        finally:
            session.close()

    @contextmanager
    def read(self) -> Iterator[Session]:
        session = read_session(self.engine)
        try:
            with session.begin():
                yield session
        except DataError as exc:
            raise _unstorable(exc) from exc
        except OperationalError as exc:
            raise Unavailable("the database is unavailable", details=str(exc.orig)) from exc
        finally:
            session.close()

    def dispose(self) -> None:
        self.engine.dispose()


def _unstorable(exc: DataError) -> ValidationFailed:
    """A value the database refuses (a NUL character, a number out of range): the input's
    fault, so a 422, never a 500."""
    return ValidationFailed(
        "a value in the request cannot be stored or compared (out of range or invalid characters)",
        code="invalid_value",
        details=str(exc.orig).splitlines()[0],
    )
