"""SIEM export sinks: configure them, and deliver the event record to them at least once.

Configuration changes (``sink.create``, ``sink.delete``) are events, written in the same
transaction as the change; the event details hold the redacted configuration only.

Delivery (``export_once``): for each sink, read the events after its cursor in sequence order,
encode a batch, send it with retries and backoff, and advance the cursor only after the receiver
acknowledged the batch. A sink that is down keeps its cursor; when it comes back, the next pass
resumes exactly there, so nothing is lost and nothing is skipped (a batch whose acknowledgement
was lost is sent again: receivers de-duplicate on ``seq`` / the leaf hash). Cursor progress is
bookkeeping, not a change of the cluster, and writes no event (it would feed itself); a sink
that starts failing, and one that recovers, does write one (``sink.delivery_failed``,
``sink.delivery_recovered``), since a broken audit trail is itself an audit fact (AU-5).

Sinks must not become a way into the host (issue 19, §5): what they may reach is the store's
``SinkPolicy`` (set by the server from ``PROOFPLANE_SINK_*``; read from the environment when a
store has none): file sinks write only under the sink directory, HTTP sinks need ``https://``,
loopback, link-local and metadata destinations are refused unless allow-listed (checked when a
sink is configured and again at every connection), delivery errors carry a status and a short
reason, never the receiver's answer, and a deleted sink's secrets are erased from the database.

Secrets at rest (issue 13): the configuration's secret fields (``SECRET_FIELDS``: the HEC
token, the bearer token, the TLS key file's path) are stored only as KMS ciphertext bound to
the row and field (``siem_sinks/<id>/<field>``); they are opened only to build the sink for a
delivery or a test. A secret that does not open (KMS down, tampered or copied) fails that
sink's pass or test with the KMS's error; it is never sent or used in the clear.

``proofplane.workers.siem.ExportWorker`` runs ``export_once`` in a background thread of the API
server; ``proofplane sinks flush`` runs one pass.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import func, select, update

from proofplane import config as settings
from proofplane.access import SYSTEM, Actor, Permission, authorize
from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import config as sink_config
from proofplane.errors import Conflict, NotFound, ProofplaneError
from proofplane.model import Event, Outcome, validate_name
from proofplane.service.context import Store, Tx
from proofplane.service.events import event_from_row
from proofplane.service.keys import kms_for, open_secret, seal_secret, secret_aad
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_text_cursor,
    paginate,
)
from proofplane.service.runbooks import with_runbook
from proofplane.siem import guard
from proofplane.siem.sink import Sink, build, deliver
from proofplane.siem.transport import DeliveryError, TlsFilesInvalid
from proofplane.store.db import erase_freed_pages
from proofplane.store.tables import EventRow, SinkRow

log = logging.getLogger("proofplane.export")

StartAt = Literal["beginning", "end"]
MAX_ERROR_CHARS = 500


class DeliveryFailed(ProofplaneError):
    """The sink's receiver did not acknowledge (a test message, a flush)."""

    code = "delivery_failed"


@dataclass(frozen=True, slots=True)
class SinkView:
    """A sink as it may be shown: its configuration redacted."""

    name: str
    type: str
    enabled: bool
    config: dict[str, Any]
    cursor: int
    head: int
    consecutive_failures: int
    last_error: str | None
    last_attempt_at: datetime | None
    last_success_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @property
    def lag(self) -> int:
        return max(0, self.head - self.cursor)


@dataclass
class PassResult:
    """What one export pass did for one sink."""

    name: str
    delivered: int = 0
    cursor: int = 0
    error: str | None = None


def _view(row: SinkRow, head: int) -> SinkView:
    return SinkView(
        name=row.name,
        type=row.kind,
        enabled=row.enabled,
        config=sink_config.redact(dict(row.config)),
        cursor=row.cursor,
        head=head,
        consecutive_failures=row.consecutive_failures,
        last_error=row.last_error,
        last_attempt_at=row.last_attempt_at,
        last_success_at=row.last_success_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _secret_aad(row_id: int, field: str) -> bytes:
    return secret_aad(SinkRow.__tablename__, row_id, field)


def _seal_config(store: Store, tx: Tx, row_id: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` as stored: each secret field present sealed under the ``secrets`` key."""
    kms = kms_for(store)
    return {
        k: seal_secret(kms, tx, v, _secret_aad(row_id, k))
        if k in sink_config.SECRET_FIELDS and isinstance(v, str)
        else v
        for k, v in cfg.items()
    }


def open_config(store: Store, session: Any, row_id: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A stored configuration with its secrets in the clear (to build the sink, and only for
    that). DecryptFailed / KmsUnavailable when one does not open."""
    kms = kms_for(store)
    return {
        k: open_secret(kms, session, v, _secret_aad(row_id, k))
        if k in sink_config.SECRET_FIELDS and isinstance(v, str)
        else v
        for k, v in cfg.items()
    }


def _head(session: Any) -> int:
    return int(session.scalar(select(func.max(EventRow.seq))) or 0)


def _row(session: Any, name: str) -> SinkRow:
    row = session.scalar(select(SinkRow).where(SinkRow.name == name))
    if row is None:
        raise NotFound(f"sink {name!r} not found", details={"sink": name})
    return row  # type: ignore[no-any-return]


# --- configuration -----------------------------------------------------------------------------


def policy_from(sinks: settings.SinkSettings) -> sink_config.SinkPolicy:
    return sink_config.SinkPolicy(
        sink_dir=sinks.sink_dir,
        allow_insecure=sinks.allow_insecure,
        allow_hosts=sinks.allow_hosts,
        tls_dir=sinks.tls_dir,
        ocsf_version=sinks.ocsf_version,
    )


def sink_policy(store: Store) -> sink_config.SinkPolicy:
    """What this store's sinks may reach: the server's policy, or ``PROOFPLANE_SINK_*``."""
    if store.sink_policy is None:
        return policy_from(settings.sink_settings_from_env())
    return store.sink_policy


def _check_destination(kind: str, cfg: dict[str, Any], policy: sink_config.SinkPolicy) -> None:
    where = sink_config.destination(kind, cfg)
    if where is not None:
        guard.check(*where, policy)


def create_sink(
    store: Store,
    actor: Actor,
    name: str,
    kind: str,
    config: dict[str, Any],
    *,
    enabled: bool = True,
    start_at: StartAt = "beginning",
) -> SinkView:
    """Add a sink. ``start_at="end"`` skips the history: delivery starts with this change."""
    authorize(actor, Permission.SINKS_WRITE)
    validate_name(name, "sink")
    policy = sink_policy(store)
    normalized = sink_config.validate(kind, config, is_file=os.path.isfile, policy=policy)
    _check_destination(kind, normalized, policy)
    with store.write(actor) as tx:
        if tx.session.scalar(select(SinkRow.id).where(SinkRow.name == name)):
            raise Conflict(f"sink {name!r} already exists", details={"sink": name})
        cursor = _head(tx.session) if start_at == "end" else 0
        row = SinkRow(
            name=name,
            kind=kind,
            config=normalized,
            enabled=enabled,
            cursor=cursor,
            consecutive_failures=0,
            last_error=None,
            last_attempt_at=None,
            last_success_at=None,
            created_at=tx.now,
            updated_at=tx.now,
        )
        tx.session.add(row)
        tx.session.flush()
        row.config = _seal_config(store, tx, row.id, normalized)  # the id is the secrets' AAD
        tx.session.flush()
        tx.record(
            "sink.create",
            "sink",
            name,
            details={
                "type": kind,
                "config": sink_config.redact(normalized),
                "enabled": enabled,
                "start_at": start_at,
                "cursor": cursor,
            },
        )
        return _view(row, _head(tx.session))


def list_sinks(
    store: Store, actor: Actor, *, limit: int = 100, cursor: str | None = None
) -> Page[SinkView]:
    authorize(actor, Permission.SINKS_READ)
    check_limit(limit)
    after = decode_text_cursor("sinks", cursor)
    query = select(SinkRow).order_by(SinkRow.name).limit(limit + 1)
    if after is not None:
        query = query.where(SinkRow.name > after)
    with store.read() as session:
        rows = list(session.scalars(query))
        head = _head(session)
        items = [_view(r, head) for r in rows]
    return paginate("sinks", items, limit, rows[limit - 1].name if len(rows) > limit else None)


def get_sink(store: Store, actor: Actor, name: str) -> SinkView:
    authorize(actor, Permission.SINKS_READ)
    with store.read() as session:
        return _view(_row(session, name), _head(session))


def delete_sink(store: Store, actor: Actor, name: str) -> SinkView:
    """Remove a sink and erase its secrets: the row's secrets are overwritten before it is
    deleted, and on SQLite (``secure_delete``) the freed space is zeroed and the write-ahead
    log truncated, so no copy of a token stays in the database files. (PostgreSQL keeps a
    deleted row version until VACUUM reclaims it.)"""
    authorize(actor, Permission.SINKS_WRITE)
    with store.write(actor) as tx:
        row = _row(tx.session, name)
        view = _view(row, _head(tx.session))
        kind, cursor = row.kind, row.cursor
        row.config = sink_config.redact(dict(row.config))
        tx.session.flush()
        tx.session.delete(row)
        tx.record(
            "sink.delete",
            "sink",
            name,
            details={"type": kind, "config": view.config, "cursor": cursor},
        )
    erase_freed_pages(store.engine)
    return view


def test_sink(store: Store, actor: Actor, name: str, *, now: datetime | None = None) -> SinkView:
    """Send one synthetic message (``sink.test``, sequence number 0) now, without retries;
    the cursor does not move. Raises DeliveryFailed with the receiver's error."""
    authorize(actor, Permission.SINKS_WRITE)
    with store.read() as session:
        row = _row(session, name)
        view = _view(row, _head(session))
        kind, cfg = row.kind, open_config(store, session, row.id, dict(row.config))
    event = Event(
        seq=0,
        ts=now or datetime.now(UTC),
        actor=actor.name,
        action="sink.test",
        target_type="sink",
        target_id=name,
        outcome=Outcome.SUCCESS,
        details={"test": True},
    )
    try:
        sink = build(kind, cfg, policy=sink_policy(store))
        sink.transport.send([sink.encode(event, event_leaf_hash(event))])
    except TlsFilesInvalid:
        raise  # the sink's configuration is wrong (422), not the receiver's answer
    except (DeliveryError, ValueError) as exc:
        raise DeliveryFailed(
            f"sink {name!r} did not accept the test message",
            details={"error": str(exc)[:MAX_ERROR_CHARS]},
        ) from exc
    return view


# --- delivery ----------------------------------------------------------------------------------


@dataclass
class RetryPolicy:
    """Retries within a pass (per batch), and the wait between passes of a failing sink."""

    attempts: int = 3
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    sleep: Callable[[float], None] = field(default=time.sleep)


def _read_batch(store: Store, after: int, limit: int) -> list[Event]:
    with store.read() as session:
        rows = session.scalars(
            select(EventRow).where(EventRow.seq > after).order_by(EventRow.seq).limit(limit)
        )
        return [event_from_row(r) for r in rows]


def _advance(store: Store, sink_id: int, name: str, old: int, new: int, recovered: bool) -> None:
    with store.write(SYSTEM) as tx:
        result = tx.session.execute(
            update(SinkRow)
            .where(SinkRow.id == sink_id, SinkRow.cursor < new)
            .values(
                cursor=new,
                consecutive_failures=0,
                last_error=None,
                last_attempt_at=tx.now,
                last_success_at=tx.now,
            )
        )
        if recovered and result.rowcount:  # type: ignore[attr-defined]
            tx.record("sink.delivery_recovered", "sink", name, details={"cursor": new, "from": old})


def _failed(store: Store, sink_id: int, name: str, cursor: int, error: str) -> None:
    with store.write(SYSTEM) as tx:
        row = tx.session.get(SinkRow, sink_id)
        if row is None:  # deleted meanwhile
            return
        if row.consecutive_failures == 0:
            tx.record(
                "sink.delivery_failed",
                "sink",
                name,
                outcome=Outcome.FAILURE,
                details=with_runbook(
                    {"cursor": cursor, "error": error},
                    "sink.delivery_failed",
                    "failure",
                    tx.session,
                ),  # fmt: skip
            )
        row.consecutive_failures += 1
        row.last_error = error
        row.last_attempt_at = tx.now


def export_sink(
    store: Store,
    row_id: int,
    name: str,
    sink: Sink,
    cursor: int,
    failures: int,
    *,
    retry: RetryPolicy,
    max_batches: int | None = None,
) -> PassResult:
    """Deliver a sink's backlog from ``cursor`` (one batch at a time, cursor after each)."""
    result = PassResult(name, cursor=cursor)
    batches = 0
    recovered = failures > 0
    while max_batches is None or batches < max_batches:
        events = _read_batch(store, result.cursor, sink.batch_size)
        if not events:
            break
        records = [sink.encode(e, event_leaf_hash(e)) for e in events]
        try:
            deliver(
                sink.transport,
                records,
                attempts=retry.attempts,
                base_delay_s=retry.base_delay_s,
                max_delay_s=retry.max_delay_s,
                sleep=retry.sleep,
            )
        except DeliveryError as exc:
            result.error = str(exc)[:MAX_ERROR_CHARS]
            _failed(store, row_id, name, result.cursor, result.error)
            log.warning("sink %s: delivery failed at seq %d: %s", name, result.cursor + 1, exc)
            return result
        _advance(store, row_id, name, result.cursor, events[-1].seq, recovered)
        recovered = False
        result.cursor = events[-1].seq
        result.delivered += len(events)
        batches += 1
    return result


def export_once(
    store: Store,
    actor: Actor = SYSTEM,
    *,
    names: list[str] | None = None,
    retry: RetryPolicy | None = None,
    max_batches: int | None = None,
    build_sink: Callable[[str, dict[str, Any]], Sink] | None = None,
) -> list[PassResult]:
    """One export pass over the enabled sinks (or the named ones, enabled or not)."""
    authorize(actor, Permission.SINKS_WRITE)
    retry = retry or RetryPolicy()
    policy = sink_policy(store) if build_sink is None else None

    def build_with_policy(kind: str, cfg: dict[str, Any]) -> Sink:
        return build(kind, cfg, policy=policy)

    make = build_sink or build_with_policy

    with store.read() as session:
        query = select(SinkRow).order_by(SinkRow.name)
        if names:
            rows = list(session.scalars(query.where(SinkRow.name.in_(names))))
            missing = sorted(set(names) - {r.name for r in rows})
            if missing:
                raise NotFound(f"sink {missing[0]!r} not found", details={"sinks": missing})
        else:
            rows = list(session.scalars(query.where(SinkRow.enabled.is_(True))))
        plan = []
        for r in rows:
            try:  # a secret that does not open fails this sink's pass, not the others'
                cfg: dict[str, Any] | ProofplaneError = open_config(
                    store, session, r.id, dict(r.config)
                )
            except ProofplaneError as exc:
                cfg = exc
            plan.append((r.id, r.name, r.kind, cfg, r.cursor, r.consecutive_failures))
    results = []
    for row_id, name, kind, cfg, cursor, failures in plan:
        if isinstance(cfg, ProofplaneError):
            results.append(PassResult(name, cursor=cursor, error=cfg.message[:MAX_ERROR_CHARS]))
            continue
        try:
            sink = make(kind, cfg)
        except (ProofplaneError, ValueError, OSError) as exc:
            error = exc.message if isinstance(exc, ProofplaneError) else str(exc)
            results.append(PassResult(name, cursor=cursor, error=error[:MAX_ERROR_CHARS]))
            continue
        results.append(
            export_sink(
                store, row_id, name, sink, cursor, failures, retry=retry, max_batches=max_batches
            )
        )
    return results


def enabled_sink_names(store: Store) -> list[str]:
    """The names of the enabled sinks (what a background export pass may deliver to)."""
    with store.read() as session:
        return list(session.scalars(select(SinkRow.name).where(SinkRow.enabled.is_(True))))
