"""Audit-log use cases: checkpoints (signed on demand, and in the background by
``proofplane.workers.checkpoints``), proofs, canonical entries, whole-log verification on the
database, and offline evidence bundles.

Checkpoints are signed through the KMS (issue 13): the ``sign`` key ``audit-checkpoint``
(``service.keys.AUDIT_KEY``; in the HSM with ``pkcs11``, in OpenBao with ``openbao``, in the
embedded keyring with ``local``), created on first use. The note's key name is the log's
origin, ``proofplane/<cluster-id>``; each key version has its own verifier key (its key id
differs), derived from the version's public key in the key inventory, and is valid from the
version's creation until its retirement (``keys rotate``). A checkpoint signed before a rotation
verifies with its own version's verifier. A KMS that cannot sign fails the round (nothing is
written; the signer retries at its next interval): a checkpoint is never skipped silently nor
signed with anything else.

Deployments before the KMS signed with a key file (``PROOFPLANE_AUDIT_KEY_FILE``, default
``<user data dir>/audit-signing.key``). That file is never created nor signed with again; while
it is there, its public half is published as the *legacy* verifier, valid until the KMS key's
first version was created (the switch), so the checkpoints it signed still verify.

Checkpoints are not events: a checkpoint signs the log, it does not change it (recording one
would grow the log and call for another checkpoint, forever).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import platformdirs
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from proofplane.access import Actor, Permission, authorize
from proofplane.audit import bundle as bundle_mod
from proofplane.audit import merkle, note
from proofplane.audit.canonical import entry_bytes
from proofplane.errors import Conflict, NotFound, ProofplaneError, ValidationFailed
from proofplane.keys import SIGN, KeyDisabled, KmsError, KmsUnavailable
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.store import audit_log, audit_verify
from proofplane.store.tables import AuditCheckpointRow, EventRow, KmsKeyRow, KmsKeyVersionRow

log = logging.getLogger("proofplane.audit")

MAX_ENTRIES = 1000  # per GET /audit/entries request
KEY_FILE_ENV = "PROOFPLANE_AUDIT_KEY_FILE"


class ProofOutOfRange(ProofplaneError):
    code = "proof_out_of_range"


def origin_for(cluster_id: str) -> str:
    return f"proofplane/{cluster_id}"


def default_key_file() -> Path:
    """``$PROOFPLANE_AUDIT_KEY_FILE``, else ``<user data dir>/audit-signing.key``: where
    deployments before the KMS kept their signing key (the legacy verifier's source)."""
    configured = os.environ.get(KEY_FILE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(platformdirs.user_data_dir("proofplane")) / "audit-signing.key"


def load_or_create_signer(path: Path, name: str) -> note.SignerKey:
    """A signing key file as deployments before the KMS kept it (and tests make legacy keys
    with): generated (Ed25519, os.urandom) and written 0600 when the file does not exist yet.
    A key file readable by others is refused. The server no longer signs with it."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        signer = note.generate_signer(name, os.urandom(32))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process created it first: use theirs
        else:
            with os.fdopen(fd, "w") as f:
                f.write(signer.text() + "\n")
            return signer
    if path.stat().st_mode & 0o077:
        raise ValidationFailed(
            f"the audit signing key {path} is readable by others: chmod 600 it",
            code="audit_key_permissions",
        )
    signer = note.parse_signer_key(path.read_text())
    if signer.name != name:
        raise ValidationFailed(
            f"the audit signing key {path} is for {signer.name!r}, this log is {name!r}",
            code="audit_key_mismatch",
        )
    return signer


def read_legacy_verifier(path: Path) -> note.VerifierKey | None:
    """The public half of a pre-KMS signing key file; None when there is no such file. Only
    read, never created: the server does not sign with it any more."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return note.parse_signer_key(path.read_text()).verifier
    except (OSError, UnicodeDecodeError, note.NoteError) as exc:
        raise ValidationFailed(
            f"the legacy audit signing key {path} ({KEY_FILE_ENV}) cannot be read: {exc}",
            code="audit_key_invalid",
        ) from None


@dataclass
class AuditKeys:
    """The log's origin (the notes' key name) and where a pre-KMS signing key file may be
    (``key_file``, default ``default_key_file()``): its verifier stays published as legacy."""

    origin: str = "proofplane/default"
    key_file: Path | None = None

    def legacy_verifier(self) -> note.VerifierKey | None:
        return read_legacy_verifier(self.key_file or default_key_file())

    def verifier(self, store: Store) -> note.VerifierKey:
        """The verifier of the current ``audit-checkpoint`` version (``no_audit_key`` when no
        checkpoint was signed through the KMS yet)."""
        with store.read() as s:
            current = [v.key for v in verifiers(s, self) if v.current]
        if not current:
            raise NotFound("no checkpoint has been signed through the KMS yet",
                           code="no_audit_key")  # fmt: skip
        return current[0]


@dataclass(frozen=True, slots=True)
class Verifier:
    """One published verifier key and when it signed: a KMS key version's (``version``), or
    the pre-KMS key file's (``legacy``)."""

    key: note.VerifierKey
    version: int | None
    valid_from: datetime | None
    valid_until: datetime | None  # None: still signing (the current version)
    current: bool
    legacy: bool = False
    destroyed_at: datetime | None = None
    checkpoints: int = 0  # checkpoints stored that were signed in this validity period

    def to_json(self) -> dict[str, Any]:
        return {
            "verifier": self.key.text(),
            "key_id": self.key.key_id.hex(),
            "kms_key": None if self.legacy else keys_svc.AUDIT_KEY,
            "version": self.version,
            "valid_from": self.valid_from.isoformat() if self.valid_from else None,
            "valid_until": self.valid_until.isoformat() if self.valid_until else None,
            "current": self.current,
            "legacy": self.legacy,
            "destroyed_at": self.destroyed_at.isoformat() if self.destroyed_at else None,
            "checkpoints": self.checkpoints,
        }


def _checkpoints_between(session: Any, start: datetime | None, end: datetime | None) -> int:
    query = select(func.count()).select_from(AuditCheckpointRow)
    if start is not None:
        query = query.where(AuditCheckpointRow.created_at >= start)
    if end is not None:
        query = query.where(AuditCheckpointRow.created_at < end)
    return int(session.scalar(query) or 0)


def verifiers(session: Any, keys: AuditKeys) -> list[Verifier]:
    """Every verifier of the log, oldest first: the legacy file key's (while the file is
    there), then one per version of the KMS key ``audit-checkpoint``. Read from the key
    inventory only (public keys): no KMS call, so this works with the KMS down."""
    row = session.scalar(select(KmsKeyRow).where(KmsKeyRow.name == keys_svc.AUDIT_KEY))
    versions = (
        list(
            session.scalars(
                select(KmsKeyVersionRow)
                .where(KmsKeyVersionRow.key_id == row.id)
                .order_by(KmsKeyVersionRow.version)
            )
        )
        if row is not None
        else []
    )
    out: list[Verifier] = []
    legacy = keys.legacy_verifier()
    if legacy is not None:
        switch = versions[0].created_at if versions else None
        out.append(Verifier(legacy, None, None, switch, current=False, legacy=True,
                            checkpoints=_checkpoints_between(session, None, switch)))  # fmt: skip
    for v in versions:
        if v.public_key is None:
            continue
        assert row is not None
        out.append(
            Verifier(
                note.verifier_for(keys.origin, bytes(v.public_key)),
                v.version,
                v.created_at,
                v.retired_at,
                current=v.version == row.current_version,
                destroyed_at=v.destroyed_at,
                checkpoints=_checkpoints_between(session, v.created_at, v.retired_at),
            )
        )
    return out


def known_verifiers(store: Store, keys: AuditKeys) -> list[note.VerifierKey]:
    """The verifier keys of every checkpoint the log may hold (see ``verifiers``)."""
    with store.read() as s:
        return [v.key for v in verifiers(s, keys)]


# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    entry: bytes
    leaf_hash: bytes  # as stored in the Merkle log


def get_verifier_key(store: Store, keys: AuditKeys, actor: Actor) -> str:
    """The verifier key new checkpoints are signed with: the current version of the KMS key
    ``audit-checkpoint`` (created now, on first use, when no checkpoint was signed yet)."""
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        current = [v for v in verifiers(s, keys) if v.current and not v.legacy]
    if not current:
        _ensure_audit_key(store, keys_svc.kms_for(store), actor, datetime.now(UTC))
        with store.read() as s:
            current = [v for v in verifiers(s, keys) if v.current and not v.legacy]
    return current[0].key.text()


def list_verifiers(store: Store, keys: AuditKeys, actor: Actor) -> list[Verifier]:
    """Every verifier key of the log with its validity period (``audit key --all``)."""
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        return verifiers(s, keys)


def latest_checkpoint(store: Store, actor: Actor) -> str:
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        row = s.scalars(
            select(AuditCheckpointRow).order_by(AuditCheckpointRow.id.desc()).limit(1)
        ).first()
        if row is None:
            raise NotFound("no checkpoint has been signed yet", code="no_checkpoint")
        return row.note


def list_entries(store: Store, actor: Actor, start: int, end: int) -> list[Entry]:
    """Entries ``[start, end)`` in canonical form, with their stored leaf hashes."""
    authorize(actor, Permission.AUDIT_READ)
    if start < 0 or end < start:
        raise ProofOutOfRange("need 0 <= start <= end", code="bad_range")
    if end - start > MAX_ENTRIES:
        raise ProofOutOfRange(f"at most {MAX_ENTRIES} entries per request", code="bad_range")
    with store.read() as s:
        size = audit_log.tree_size(s)
        if end > size:
            raise ProofOutOfRange(f"end {end} is beyond the log size {size}", code="bad_range")
        rows = s.scalars(
            select(EventRow).where(EventRow.seq > start, EventRow.seq <= end).order_by(EventRow.seq)
        ).all()
        leaves = audit_log.leaf_hashes(s, start, end)
    if len(rows) != end - start:
        raise audit_log.LogCorrupted("events are missing from the requested range")
    return [Entry(start + i, entry_bytes(event_from_row(r)), leaves[i]) for i, r in enumerate(rows)]


def inclusion_proof(
    store: Store, actor: Actor, index: int, tree_size: int
) -> tuple[bytes, list[bytes]]:
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        try:
            return audit_log.inclusion(s, index, tree_size)
        except audit_log.ProofRangeError as exc:
            raise ProofOutOfRange(str(exc)) from exc


def consistency_proof(store: Store, actor: Actor, old_size: int, new_size: int) -> list[bytes]:
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        try:
            return audit_log.consistency(s, old_size, new_size)
        except audit_log.ProofRangeError as exc:
            raise ProofOutOfRange(str(exc)) from exc


# --- checkpoints --------------------------------------------------------------------------


def sign_checkpoint(
    store: Store, actor: Actor, keys: AuditKeys, now: datetime, *, only_if_grown: bool = False
) -> str | None:
    """Sign the log as it is now with the KMS key ``audit-checkpoint`` (created on first use)
    and keep the signed note. With ``only_if_grown`` (the background worker), nothing happens
    when the newest checkpoint already covers the log. A KMS that cannot sign raises
    (``KmsUnavailable``…): nothing is written, and the error is logged."""
    authorize(actor, Permission.AUDIT_CHECKPOINT)
    kms = keys_svc.kms_for(store)
    try:
        if only_if_grown:
            with store.read() as s:
                if not _grown(s):
                    return None
        _ensure_audit_key(store, kms, actor, now)
        with store.write(actor, now) as tx:
            s = tx.session
            if only_if_grown and not _grown(s):
                return None
            key = kms.ensure_key(tx, keys_svc.AUDIT_KEY, SIGN)
            size = audit_log.tree_size(s)
            root = audit_log.root_at(s, size)
            text = note.Checkpoint(keys.origin, size, root).text()
            version, signature = kms.sign(s, keys_svc.AUDIT_KEY, text.encode())
            ver = s.get(KmsKeyVersionRow, (key.id, version))
            if ver is None or ver.public_key is None:
                raise KmsError(f"key {keys_svc.AUDIT_KEY!r} version {version} has no public key")
            try:
                signed = note.signed_note(
                    text, note.verifier_for(keys.origin, bytes(ver.public_key)), signature
                )
            except note.NoteError as exc:
                raise KmsError(
                    f"the KMS signature does not verify with key {keys_svc.AUDIT_KEY!r} "
                    f"version {version}'s public key: {exc}",
                    code="kms_bad_signature",
                ) from None
            s.add(AuditCheckpointRow(tree_size=size, root_hash=root, note=signed, created_at=now))
    except (KmsError, KmsUnavailable, KeyDisabled) as exc:
        log.warning("audit checkpoint not signed (retried at the next round): %s", exc)
        raise
    return signed


def _grown(session: Any) -> bool:
    """Whether the log has entries the newest checkpoint does not cover (or none exists)."""
    last = session.scalar(
        select(AuditCheckpointRow.tree_size).order_by(AuditCheckpointRow.id.desc()).limit(1)
    )
    return last is None or last < audit_log.tree_size(session)


def _ensure_audit_key(store: Store, kms: keys_svc.Kms, actor: Actor, now: datetime) -> None:
    """Create the key ``audit-checkpoint`` on first use, in its own write transaction: its
    ``key.create`` event is then in the log the first checkpoint signs."""
    with store.read() as s:
        if s.scalar(select(KmsKeyRow.id).where(KmsKeyRow.name == keys_svc.AUDIT_KEY)):
            return
    try:
        with store.write(actor, now) as tx:
            kms.ensure_key(tx, keys_svc.AUDIT_KEY, SIGN)
    except Conflict:
        pass  # another replica created it first (KeyExists, or the unique name)


# --- verification on the database ----------------------------------------------------------


@dataclass
class VerifyReport:
    ok: bool
    events: int
    tree_size: int
    checkpoint_size: int | None
    first_bad_index: int | None = None
    problems: list[str] = field(default_factory=list)
    checkpoint_root: bytes | None = None  # the signed checkpoint checked against, if any

    @property
    def verified_against_checkpoint(self) -> bool:
        """True only when a signed checkpoint verified and the events reproduce it. ``ok``
        with this False means no checkpoint was signed yet: only the stored tree was checked,
        which an attacker with database access could have rewritten along with the events."""
        return self.ok and self.checkpoint_size is not None

    def to_dict(self) -> dict[str, Any]:
        checkpoint = None
        if self.checkpoint_size is not None:
            root = self.checkpoint_root.hex() if self.checkpoint_root is not None else None
            checkpoint = {"size": self.checkpoint_size, "root_hash": root}
        return {
            "ok": self.ok,
            "events": self.events,
            "tree_size": self.tree_size,
            "checkpoint_size": self.checkpoint_size,
            "first_bad_index": self.first_bad_index,
            "problems": self.problems,
            "checkpoint": checkpoint,
            "verified_against_checkpoint": self.verified_against_checkpoint,
        }


def iter_leaf_hashes(store: Store, batch: int = 20_000) -> Iterator[tuple[int, bytes]]:
    """(seq, recomputed leaf hash) for every event row, in seq order, straight from the
    rows (a fast raw-cursor path on SQLite)."""
    if store.engine.dialect.name == "sqlite":
        yield from _sqlite_leaf_hashes(store, batch)
        return
    with store.read(streaming=True) as s:
        result = s.execute(
            select(EventRow).order_by(EventRow.seq).execution_options(yield_per=batch)
        )
        for (row,) in result:
            try:
                leaf = merkle.leaf_hash(entry_bytes(event_from_row(row)))
            except (TypeError, ValueError):
                leaf = UNREADABLE_LEAF
            yield row.seq, leaf


# The leaf of a row that is no event at all (unparseable details, a column of the wrong
# type): no entry hashes to it, so the row is reported where it is, not crashed on.
UNREADABLE_LEAF = hashlib.sha256(b"proofplane: unreadable event row").digest()


def _sqlite_leaf_hashes(store: Store, batch: int) -> Iterator[tuple[int, bytes]]:
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        cur.execute("BEGIN")
        cur.execute(
            "SELECT seq, ts, actor, action, target_type, target_id, outcome, details "
            "FROM events ORDER BY seq"
        )
        while rows := cur.fetchmany(batch):
            for row in rows:
                try:
                    leaf = audit_verify.exact_leaf(row)
                except audit_verify.Unverifiable:
                    leaf = UNREADABLE_LEAF
                yield row[0], leaf
        cur.execute("COMMIT")
    finally:
        raw.close()


# The problem line of a log with no signed checkpoint yet (``VerifyReport.ok`` may still be
# True: the events reproduce the stored tree; ``verified_against_checkpoint`` is False).
NO_CHECKPOINT = "no signed checkpoint: only the stored tree can be checked"


def verify_log(
    store: Store,
    verifier: note.VerifierKey | Sequence[note.VerifierKey],
    origin: str | None = None,
    *,
    workers: int | None = None,
) -> VerifyReport:
    """See ``_verify_log``; a row whose text is not valid UTF-8 (which SQLite will not decode)
    is reported as the first bad index, not raised."""
    try:
        return _verify_log(store, verifier, origin, workers=workers)
    except (sqlite3.OperationalError, DBAPIError) as exc:
        path = store.engine.url.database
        if store.engine.dialect.name != "sqlite" or not path or "decode" not in str(exc):
            raise
        found = audit_verify.first_undecodable(path)
        if found is None:
            raise
        index, seq = found
        with store.read() as s:
            stored_size = audit_log.tree_size(s)
        report = VerifyReport(
            ok=False, events=index, tree_size=stored_size, checkpoint_size=None,
            first_bad_index=index,
        )  # fmt: skip
        report.problems.append(f"index {index}: event seq {seq} holds text that is not UTF-8")
        return report


def _verify_log(
    store: Store,
    verifier: note.VerifierKey | Sequence[note.VerifierKey],
    origin: str | None = None,
    *,
    workers: int | None = None,
) -> VerifyReport:
    """Recompute every leaf from the event rows and the tree from the leaves, and check it
    against the newest signed checkpoint (by ``verifier``, or by whichever of several signed
    it: a log signed by successive key versions) and the stored Merkle log. Names the first index
    that does not match. (No actor: this runs with direct database access, as an auditor.)

    On SQLite a fast pass runs first (``store.audit_verify``, ``workers`` processes, default
    one per CPU); only when it cannot prove the log whole does the exact pass below run."""
    with store.read() as s:
        cp_row = s.scalars(
            select(AuditCheckpointRow).order_by(AuditCheckpointRow.id.desc()).limit(1)
        ).first()
        stored_size = audit_log.tree_size(s)
        checkpoints = [
            (r.tree_size, bytes(r.root_hash), r.note)
            for r in s.scalars(select(AuditCheckpointRow).order_by(AuditCheckpointRow.tree_size))
        ]
    report = VerifyReport(False, 0, stored_size, None)
    cp: note.Checkpoint | None = None
    if cp_row is None:
        report.problems.append(NO_CHECKPOINT)
    else:
        try:
            cp = note.verify_checkpoint(cp_row.note, verifier, origin)
        except note.NoteError as exc:
            report.problems.append(f"the newest checkpoint does not verify: {exc}")
            return report
        report.checkpoint_size = cp.size
        report.checkpoint_root = cp.root_hash
    if cp is not None and cp.size <= stored_size:
        fast = _fast_verify(store, stored_size, cp, workers)
        if fast is not None:
            return fast

    stack = merkle.CompactRange()
    cp_root: bytes | None = None if cp is None or cp.size else merkle.EMPTY_ROOT
    first_bad: int | None = None
    for seq, leaf in iter_leaf_hashes(store):
        index = stack.size
        if seq != index + 1 and first_bad is None:
            first_bad = index
            report.problems.append(f"index {index}: expected event seq {index + 1}, found {seq}")
        stack.append(leaf)
        if cp is not None and stack.size == cp.size:
            cp_root = stack.root()
    report.events = stack.size
    if cp is not None:
        if stack.size < cp.size:
            first_bad = stack.size if first_bad is None else first_bad
            report.problems.append(
                f"the checkpoint covers {cp.size} entries but only {stack.size} events exist"
            )
        elif cp_root != cp.root_hash:
            report.problems.append(
                f"the events do not reproduce the checkpoint root at size {cp.size}"
            )
            if first_bad is None:
                first_bad = _locate(store, min(cp.size, stack.size), checkpoints)
    with store.read() as s:
        stored_root = audit_log.root_at(s, stored_size) if stored_size else merkle.EMPTY_ROOT
    if stack.size != stored_size:
        report.problems.append(f"{stack.size} events but {stored_size} leaves in the Merkle log")
    if stack.size == stored_size and stack.root() != stored_root:
        report.problems.append("the events do not reproduce the stored Merkle log")
        if first_bad is None:
            first_bad = _locate(store, stack.size, checkpoints)
    report.first_bad_index = first_bad
    report.ok = not report.problems or (cp is None and len(report.problems) == 1)
    if cp is None:
        report.ok = report.ok and first_bad is None and stack.size == stored_size
    return report


def _fast_verify(
    store: Store, size: int, cp: note.Checkpoint, workers: int | None
) -> VerifyReport | None:
    """The fast pass (SQLite, ``proofplane.store.audit_verify``): a report when it proves the log
    whole (exactly ``size`` events, seq 1..size, reproducing the signed checkpoint root and
    the stored tree); None otherwise, and the exact pass then says what is wrong."""
    path = store.engine.url.database
    if store.engine.dialect.name != "sqlite" or not path:
        return None
    with store.read() as s:
        # two statements: SQLite reads min() or max() of the key off the b-tree's edge only
        # when it is the query's one aggregate (together, they scan the table)
        lo_hi = (s.scalar(select(func.min(EventRow.seq))), s.scalar(select(func.max(EventRow.seq))))
        stored_root = audit_log.root_at(s, size) if size else merkle.EMPTY_ROOT
    if lo_hi != ((1, size) if size else (None, None)):
        return None
    try:
        full, at, _slow = audit_verify.log_roots(path, size, [cp.size], workers=workers)
    except audit_verify.Unverifiable:
        return None
    if full != stored_root or at.get(cp.size) != cp.root_hash:
        return None
    return VerifyReport(True, size, size, cp.size, checkpoint_root=cp.root_hash)


def _locate(store: Store, upto: int, checkpoints: list[tuple[int, bytes, str]]) -> int | None:
    """The first index whose recomputed leaf differs from the stored leaf hash; when the
    stored hashes were rewritten to match, the end of the last checkpointed stretch whose
    root the events still reproduce."""
    chunk: list[bytes] = []
    base = 0
    with store.read() as s:
        for _seq, leaf in iter_leaf_hashes(store):
            if base + len(chunk) >= upto:
                break
            chunk.append(leaf)
            if len(chunk) == 4096:
                bad = _first_difference(chunk, audit_log.leaf_hashes(s, base, base + len(chunk)))
                if bad is not None:
                    return base + bad
                base, chunk = base + len(chunk), []
        if chunk:
            bad = _first_difference(chunk, audit_log.leaf_hashes(s, base, base + len(chunk)))
            if bad is not None:
                return base + bad
    stack = merkle.CompactRange()
    pending = [c for c in checkpoints if 0 < c[0] <= upto]
    good_until = 0
    for _seq, leaf in iter_leaf_hashes(store):
        if not pending:
            break
        stack.append(leaf)
        while pending and pending[0][0] == stack.size:
            if stack.root() != pending[0][1]:
                return good_until
            good_until = stack.size
            pending.pop(0)
    return good_until if good_until < upto else None


def _first_difference(a: list[bytes], b: list[bytes]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return k
    return None


# --- bundles ------------------------------------------------------------------------------


def export_bundle(
    store: Store,
    actor: Actor,
    keys: AuditKeys,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    tenant: str | None = None,
    now: datetime,
) -> dict[str, Any]:
    """The events of a time range and/or a tenant, each with its inclusion proof against the
    newest checkpoint, plus that checkpoint and the verifier key that signed it: checkable
    offline."""
    authorize(actor, Permission.AUDIT_READ)
    signed = latest_checkpoint(store, actor)
    try:
        verifier = note.signed_by(signed, known_verifiers(store, keys))
    except note.NoteError as exc:
        raise ValidationFailed(
            f"the newest checkpoint does not verify with any published verifier key: {exc}",
            code="checkpoint_unverifiable",
        ) from None
    cp = note.verify_checkpoint(signed, verifier)
    query = select(EventRow).where(EventRow.seq <= cp.size).order_by(EventRow.seq)
    if since is not None:
        query = query.where(EventRow.ts >= since)
    if until is not None:
        query = query.where(EventRow.ts < until)
    items = []
    with store.read() as s:
        for row in s.scalars(query):
            event = event_from_row(row)
            if tenant is not None and not _mentions_tenant(event, tenant):
                continue
            _, proof = audit_log.inclusion(s, row.seq - 1, cp.size)
            items.append((row.seq - 1, entry_bytes(event), proof))
    return bundle_mod.make_bundle(
        checkpoint=signed,
        verifier_key=verifier.text(),
        items=items,
        created_at=now,
        selection={
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
            "tenant": tenant,
        },
    )


def _mentions_tenant(event: Any, tenant: str) -> bool:
    if event.target_type == "tenant" and event.target_id == tenant:
        return True
    details = event.details or {}
    return details.get("tenant") == tenant


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- group commit -------------------------------------------------------------------------


class _Batch:
    """One commit's worth of events: acknowledged together, once the commit returned."""

    __slots__ = ("done", "errors", "seqs")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.seqs: list[int] = []
        self.errors: dict[int, BaseException] = {}  # by offset in the batch


class Ack:
    """An event's acknowledgement: ``result()`` blocks until its batch's transaction has
    committed (then returns the event's seq) or failed (then raises the error)."""

    __slots__ = ("_batch", "_offset")

    def __init__(self, batch: _Batch, offset: int) -> None:
        self._batch, self._offset = batch, offset

    def done(self) -> bool:
        return self._batch.done.is_set()

    def result(self, timeout: float | None = None) -> int:
        batch = self._batch
        if not batch.done.wait(timeout):
            raise TimeoutError("the event's batch has not committed yet")
        error = batch.errors.get(self._offset)
        if error is not None:
            raise error
        return batch.seqs[self._offset]


class GroupCommitter:
    """Many writers, one transaction: events submitted from any thread are recorded together
    (``Tx.record_many``: the same rows and Merkle hashes as ``Tx.record``) in one write
    transaction per batch, and each submitter is acknowledged only after that commit has
    returned. This amortizes the commit (and its fsync) over the batch, so SQLite's single
    writer stops being the bottleneck for high-volume event-only writes (agent telemetry,
    attestation results). A failed batch fails every event in it; nothing of it is stored.
    While one batch commits, the next one fills (up to ``max_batch`` events)."""

    def __init__(self, store: Store, actor: Actor, max_batch: int = 8192) -> None:
        self.store, self.actor, self.max_batch = store, actor, max_batch
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # batches waiting for the committer, oldest first; new events join the last one
        self._queue: list[tuple[_Batch, list[tuple[str, str, str, dict[str, Any] | None]]]] = []
        self._closed = False
        self._idle = False  # the committer waits for work (only then is it worth a notify)
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="audit-group-commit", daemon=True)
        self._thread.start()

    def _open_batch(self, room: int) -> tuple[_Batch, list[Any]]:
        # caller holds the lock
        if self._closed:
            raise RuntimeError("the group committer is closed")
        if self._queue:
            batch, events = self._queue[-1]
            if not events or len(events) + room <= self.max_batch:
                return batch, events
        entry: tuple[_Batch, list[Any]] = (_Batch(), [])
        self._queue.append(entry)
        return entry

    def submit(
        self, action: str, target_type: str, target_id: str, details: dict[str, Any] | None = None
    ) -> Ack:
        """Queue one event; its ``Ack`` resolves after the commit of its batch."""
        with self._lock:
            batch, events = self._open_batch(1)
            ack = Ack(batch, len(events))
            events.append((action, target_type, target_id, details))
            if self._idle:
                self._wake.notify()
        return ack

    def submit_many(self, events: list[tuple[str, str, str, dict[str, Any] | None]]) -> list[Ack]:
        """Queue several events, kept together and in order in one batch."""
        with self._lock:
            batch, queued = self._open_batch(len(events))
            base = len(queued)
            queued.extend(events)
            if self._idle:
                self._wake.notify()
        return [Ack(batch, base + k) for k in range(len(events))]

    def record(
        self, action: str, target_type: str, target_id: str, details: dict[str, Any] | None = None
    ) -> int:
        """Record one event durably; returns its seq once committed."""
        return self.submit(action, target_type, target_id, details).result()

    def close(self) -> None:
        """Commit what is queued, then stop."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._idle = True
                    self._wake.wait()
                    self._idle = False
                if not self._queue:
                    return
                batch, events = self._queue.pop(0)
            try:
                with self.store.write(self.actor) as tx:
                    batch.seqs = tx.record_many(events)
                self.batches += 1  # the commit returned: durable, acknowledge
            except ValueError:
                # an event JSON cannot carry: commit the others one by one, fail only it
                batch.seqs = [0] * len(events)
                for k, ev in enumerate(events):
                    try:
                        with self.store.write(self.actor) as tx:
                            batch.seqs[k] = tx.record_many([ev])[0]
                        self.batches += 1
                    except Exception as exc:
                        batch.errors[k] = exc
            except Exception as exc:  # every submitter of the batch hears of it
                batch.errors = dict.fromkeys(range(len(events)), exc)
            batch.done.set()
