"""Key inventory use cases (issue 13, part 6): list and show the KMS keys with what each one
protects and how often it was used, create, rotate, disable/enable, and rewrap the stored
secrets of a key under its newest version, in resumable batches (one transaction each).

What a key protects is counted where secrets are stored (``PLACES``: TOTP seeds, pending OIDC
logins, the agent CA's key, and the sinks' secret configuration fields) by their ciphertext
prefix ``ppk1.<key>.<version>.``; a table or column this database does not have yet counts 0.
For the ``audit-checkpoint`` key, the checkpoints signed in each version's validity period.
Encrypt/decrypt/sign are counted per key in this server process (``Kms.counts``), not recorded
one event each; every lifecycle change is an event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, inspect, select, text
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.audit.export.config import SECRET_FIELDS
from proofplane.errors import Conflict, ProofplaneError, ValidationFailed
from proofplane.keys import ENCRYPT, SIGN, check_key_name, envelope
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store.tables import AuditCheckpointRow, SinkRow

MAX_BATCH = 1000


@dataclass(frozen=True, slots=True)
class Place:
    """A text column holding KMS ciphertexts, bound to ``<table>/<row id>/<aad_column>``."""

    table: str
    id_column: str
    column: str
    aad_column: str

    @property
    def label(self) -> str:
        return f"{self.table}.{self.column}"


PLACES = (
    Place("users", "id", "totp_secret", "totp_secret"),
    Place("oidc_logins", "state", "nonce", "nonce"),
    Place("oidc_logins", "state", "code_verifier", "code_verifier"),
    Place("pki_ca", "id", "key_sealed", "key"),
)
SINKS_LABEL = "sinks.config"


def _prefix(name: str, version: int | None = None) -> str:
    return f"{envelope.PREFIX}.{name}." + ("" if version is None else f"{version}.")


def _present(session: Session) -> list[Place]:
    """The places this database has (a migration of another change may not be there yet)."""
    insp = inspect(session.connection())
    out = []
    for place in PLACES:
        if insp.has_table(place.table):
            columns = {c["name"] for c in insp.get_columns(place.table)}
            if {place.id_column, place.column} <= columns:
                out.append(place)
    return out


def _sink_secrets(row: SinkRow) -> list[tuple[str, str]]:
    config = row.config if isinstance(row.config, dict) else {}
    return [
        (k, v)
        for k, v in sorted(config.items())
        if k in SECRET_FIELDS and envelope.is_ciphertext(v)
    ]


def protected(session: Session, name: str, current: int) -> tuple[dict[str, int], int]:
    """(ciphertexts of key ``name`` per place, how many are not under version ``current``)."""
    counts: dict[str, int] = {}
    stale = 0
    for place in _present(session):
        col = f"{place.table}.{place.column}"
        total = session.execute(
            text(f"SELECT count(*) FROM {place.table} WHERE {col} LIKE :p"),
            {"p": _prefix(name) + "%"},
        ).scalar_one()
        fresh = session.execute(
            text(f"SELECT count(*) FROM {place.table} WHERE {col} LIKE :p"),
            {"p": _prefix(name, current) + "%"},
        ).scalar_one()
        counts[place.label] = counts.get(place.label, 0) + int(total)
        stale += int(total) - int(fresh)
    sinks = 0
    for row in session.scalars(select(SinkRow)):
        for _field, value in _sink_secrets(row):
            if value.startswith(_prefix(name)):
                sinks += 1
                stale += not value.startswith(_prefix(name, current))
    counts[SINKS_LABEL] = sinks
    return counts, stale


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key: keys_svc.KeyView
    protects: dict[str, int]
    stale: int  # ciphertexts not under the current version (what rewrap would do)
    operations: dict[str, int]
    checkpoints: dict[int, int] = field(default_factory=dict)  # version → signed (audit key)

    def to_json(self) -> dict[str, Any]:
        out = self.key.to_json()
        for v in out["versions"]:
            if self.key.purpose == SIGN and self.key.name == keys_svc.AUDIT_KEY:
                v["checkpoints"] = self.checkpoints.get(v["version"], 0)
        out["protects"] = self.protects
        out["stale"] = self.stale
        out["operations"] = self.operations
        return out


def _operations(store: Store, name: str) -> dict[str, int]:
    counts = dict(keys_svc.kms_for(store).counts)
    return {op: n for (key, op), n in sorted(counts.items()) if key == name}


def _info(store: Store, session: Session, view: keys_svc.KeyView) -> KeyInfo:
    if view.purpose == ENCRYPT:
        protects, stale = protected(session, view.name, view.current_version)
        return KeyInfo(view, {**protects, "total": sum(protects.values())}, stale,
                       _operations(store, view.name))  # fmt: skip
    checkpoints: dict[int, int] = {}
    if view.name == keys_svc.AUDIT_KEY:
        for v in view.versions:
            query = (
                select(func.count())
                .select_from(AuditCheckpointRow)
                .where(AuditCheckpointRow.created_at >= v.created_at)
            )
            if v.retired_at is not None:
                query = query.where(AuditCheckpointRow.created_at < v.retired_at)
            checkpoints[v.version] = int(session.scalar(query) or 0)
    protects = {"audit_checkpoints": sum(checkpoints.values())} if checkpoints else {}
    return KeyInfo(view, protects, 0, _operations(store, view.name), checkpoints)


def list_keys(store: Store, actor: Actor) -> list[KeyInfo]:
    authorize(actor, Permission.KEYS_READ)
    with store.read() as s:
        return [_info(store, s, v) for v in keys_svc.list_keys(s)]


def get_key(store: Store, actor: Actor, name: str) -> KeyInfo:
    authorize(actor, Permission.KEYS_READ)
    check_key_name(name)
    with store.read() as s:
        return _info(store, s, keys_svc.get_key(s, name))


def create_key(store: Store, actor: Actor, name: str, purpose: str) -> KeyInfo:
    authorize(actor, Permission.KEYS_WRITE)
    kms = keys_svc.kms_for(store)
    with store.write(actor) as tx:
        view = kms.create_key(tx, name, purpose)
    with store.read() as s:
        return _info(store, s, view)


def rotate_key(store: Store, actor: Actor, name: str) -> KeyInfo:
    """A new version of ``name`` becomes current (for ``audit-checkpoint``: a new verifier)."""
    authorize(actor, Permission.KEYS_WRITE)
    check_key_name(name)
    kms = keys_svc.kms_for(store)
    with store.write(actor) as tx:
        view = kms.rotate_key(tx, name)
    with store.read() as s:
        return _info(store, s, view)


def disable_key(store: Store, actor: Actor, name: str, disabled: bool = True) -> KeyInfo:
    authorize(actor, Permission.KEYS_WRITE)
    check_key_name(name)
    kms = keys_svc.kms_for(store)
    with store.write(actor) as tx:
        view = kms.disable_key(tx, name, disabled)
    with store.read() as s:
        return _info(store, s, view)


@dataclass(frozen=True, slots=True)
class RewrapProgress:
    key: str
    version: int
    rewrapped: int  # in this batch
    remaining: int  # ciphertexts still under an older version
    failed: list[dict[str, str]]  # ciphertexts that did not open (left as they are)

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "version": self.version,
            "rewrapped": self.rewrapped,
            "remaining": self.remaining,
            "done": self.done,
            "failed": self.failed,
        }


def rewrap_batch(store: Store, actor: Actor, name: str, limit: int = 100) -> RewrapProgress:
    """Re-seal up to ``limit`` stored secrets of ``name`` under its current version, in one
    transaction (with a ``key.rewrap`` event when it changed anything). Call again until
    ``done``; a batch that rewraps nothing while ``remaining`` is not 0 means the rest does
    not open (``failed`` says where)."""
    authorize(actor, Permission.KEYS_WRITE)
    check_key_name(name)
    limit = max(1, min(limit, MAX_BATCH))
    kms = keys_svc.kms_for(store)
    failed: list[dict[str, str]] = []
    done = 0
    with store.write(actor) as tx:
        s = tx.session
        view = keys_svc.get_key(s, name)
        if view.purpose != ENCRYPT:
            raise keys_svc.WrongPurpose(
                f"key {name!r} is a {view.purpose} key: only encrypt keys seal stored secrets",
                details={"key": name},
            )
        current = view.current_version
        old, fresh = _prefix(name) + "%", _prefix(name, current) + "%"
        for place in _present(s):
            col = f"{place.table}.{place.column}"
            rows = s.execute(
                text(
                    f"SELECT {place.id_column}, {col} FROM {place.table} "
                    f"WHERE {col} LIKE :old AND {col} NOT LIKE :fresh "
                    f"ORDER BY {place.id_column} LIMIT :n"
                ),
                {"old": old, "fresh": fresh, "n": limit - done + len(failed)},
            ).all()
            for row_id, value in rows:
                if done >= limit:
                    break
                aad = keys_svc.secret_aad(place.table, row_id, place.aad_column)
                try:
                    new = kms.rewrap(s, value, aad)
                except ProofplaneError as exc:
                    if exc.code in ("kms_unavailable", "key_disabled"):
                        raise
                    failed.append({"where": f"{place.table}/{row_id}/{place.aad_column}",
                                   "error": exc.message})  # fmt: skip
                    continue
                s.execute(
                    text(
                        f"UPDATE {place.table} SET {place.column} = :new "
                        f"WHERE {place.id_column} = :id"
                    ),
                    {"new": new, "id": row_id},
                )
                done += 1
        for sink in s.scalars(select(SinkRow).order_by(SinkRow.id)):
            config = dict(sink.config)
            changed = False
            for key, value in _sink_secrets(sink):
                if done >= limit:
                    break
                if not value.startswith(_prefix(name)) or value.startswith(_prefix(name, current)):
                    continue
                aad = keys_svc.secret_aad(SinkRow.__tablename__, sink.id, key)
                try:
                    config[key] = kms.rewrap(s, value, aad)
                except ProofplaneError as exc:
                    if exc.code in ("kms_unavailable", "key_disabled"):
                        raise
                    failed.append({"where": f"sinks/{sink.id}/{key}", "error": exc.message})
                    continue
                changed = True
                done += 1
            if changed:
                sink.config = config
        s.flush()
        _, remaining = protected(s, name, current)
        if done:
            tx.record("key.rewrap", "key", name, details={"version": current,
                      "rewrapped": done, "remaining": remaining})  # fmt: skip
    return RewrapProgress(name, current, done, remaining, failed)


def destroy_version(
    store: Store, actor: Actor, name: str, version: int, *, change_id: int | None = None
) -> KeyInfo:
    """Destroy a superseded version of ``name`` for good (the ``key.destroy`` change's apply,
    under dual control; direct only with change control off). Refused while anything stored
    is still sealed under that version: 409 ``key_version_in_use`` with where, so nothing
    becomes unreadable (``proofplane keys rewrap NAME`` moves them to the current version
    first). The backend's material is erased only after the transaction commits
    (``Kms.destroy_version``)."""
    authorize(actor, Permission.KEYS_WRITE)
    check_key_name(name)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValidationFailed("version is a whole number from 1", code="invalid_version")
    kms = keys_svc.kms_for(store)
    with store.write(actor) as tx:
        refuse_destroy(tx.session, name, version)
        view = kms.destroy_version(tx, name, version, change_id=change_id)
    with store.read() as s:
        return _info(store, s, view)


def check_destroy(store: Store, actor: Actor, name: str, version: int) -> None:
    """Whether ``destroy_version`` would be refused now (a ``key.destroy`` change is checked
    when it is asked for, and again when it applies)."""
    authorize(actor, Permission.KEYS_WRITE)
    check_key_name(name)
    with store.read() as session:
        refuse_destroy(session, name, version)


def refuse_destroy(session: Session, name: str, version: int) -> None:
    """Raise why version ``version`` of ``name`` may not be destroyed: no such key or version
    (404), the current version or an already destroyed one, or (409 ``key_version_in_use``)
    stored secrets still sealed under it."""
    view = keys_svc.get_key(session, name)
    found = next((v for v in view.versions if v.version == version), None)
    keys_svc.check_destroyable(
        name, version, exists=found is not None, current=view.current_version,
        destroyed=found is not None and found.destroyed_at is not None,
    )  # fmt: skip
    if view.purpose != ENCRYPT:
        return
    inside = in_version(session, name, version)
    if any(inside.values()):
        raise Conflict(
            f"{sum(inside.values())} stored secrets are still sealed under version "
            f"{version} of key {name!r}: rewrap them first (proofplane keys rewrap "
            f"{name}), then destroy the version",
            code="key_version_in_use",
            details={"key": name, "version": version,
                     "protects": {k: n for k, n in inside.items() if n}},
        )  # fmt: skip


def in_version(session: Session, name: str, version: int) -> dict[str, int]:
    """Ciphertexts sealed under exactly ``version`` of ``name``, per place."""
    counts: dict[str, int] = {}
    prefix = _prefix(name, version) + "%"
    for place in _present(session):
        col = f"{place.table}.{place.column}"
        n = session.execute(
            text(f"SELECT count(*) FROM {place.table} WHERE {col} LIKE :p"), {"p": prefix}
        ).scalar_one()
        counts[place.label] = counts.get(place.label, 0) + int(n)
    sinks = 0
    for row in session.scalars(select(SinkRow)):
        sinks += sum(1 for _f, v in _sink_secrets(row) if v.startswith(_prefix(name, version)))
    counts[SINKS_LABEL] = sinks
    return counts
