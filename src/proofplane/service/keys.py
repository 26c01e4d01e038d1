"""The KMS as the services use it: the key inventory in the database, material in a backend.

``Kms`` seals and opens secrets (envelope encryption: ``proofplane.keys.envelope``), signs with
Ed25519, and manages keys' lifecycle (create, rotate, disable, destroy a version), each change
an event (``key.create``, ``key.rotate``…). Key versions' handles are read from
``kms_key_versions`` and cached per process (a handle never changes); which version is current
(and whether the key is disabled) is cached for ``META_TTL_S`` (1 s), so a rotation or a
disable in another replica is seen within a second, this process's own at once.

Secrets at rest go through ``seal_secret``/``open_secret`` under the key ``secrets``, with the
row's identity as AAD (``users/42/totp_secret``): a ciphertext copied to another row does not
open. ``kms_for(store)`` is the store's KMS (``PROOFPLANE_KMS``, default the embedded keyring
under ``PROOFPLANE_MASTER_KEY_FILE``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from proofplane.errors import Conflict
from proofplane.keys import (
    ALGORITHMS,
    ENCRYPT,
    PURPOSES,
    SIGN,
    DecryptFailed,
    KeyDisabled,
    KeyExists,
    KeyNotFound,
    WrongPurpose,
    check_key_name,
    envelope,
)
from proofplane.kms import Backend, backend_from_env
from proofplane.service.context import Store, Tx
from proofplane.service.instruments import count_kms
from proofplane.store.tables import KmsKeyRow, KmsKeyVersionRow

log = logging.getLogger(__name__)

META_TTL_S = 1.0  # how long a process trusts its cached view of a key's current version
SECRETS_KEY = "secrets"  # seals every secret stored in the database
AUDIT_KEY = "audit-checkpoint"  # signs the audit log's checkpoints


@dataclass(frozen=True, slots=True)
class VersionView:
    version: int
    created_at: datetime
    retired_at: datetime | None
    destroyed_at: datetime | None
    public_key: bytes | None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "created_at": self.created_at.isoformat(),
            "retired_at": self.retired_at.isoformat() if self.retired_at else None,
            "destroyed_at": self.destroyed_at.isoformat() if self.destroyed_at else None,
            "public_key": self.public_key.hex() if self.public_key else None,
        }


@dataclass(frozen=True, slots=True)
class KeyView:
    name: str
    purpose: str
    algorithm: str
    backend: str
    current_version: int
    created_at: datetime
    updated_at: datetime
    disabled_at: datetime | None
    versions: tuple[VersionView, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "purpose": self.purpose,
            "algorithm": self.algorithm,
            "backend": self.backend,
            "current_version": self.current_version,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "disabled_at": self.disabled_at.isoformat() if self.disabled_at else None,
            "versions": [v.to_json() for v in self.versions],
        }


def _key_row(session: Session, name: str) -> KmsKeyRow:
    row = session.scalar(select(KmsKeyRow).where(KmsKeyRow.name == name))
    if row is None:
        raise KeyNotFound(f"key {name!r} not found", details={"key": name})
    return row


def _versions(session: Session, key: KmsKeyRow) -> list[KmsKeyVersionRow]:
    return list(
        session.scalars(
            select(KmsKeyVersionRow)
            .where(KmsKeyVersionRow.key_id == key.id)
            .order_by(KmsKeyVersionRow.version)
        )
    )


def key_view(session: Session, row: KmsKeyRow) -> KeyView:
    versions = tuple(
        VersionView(v.version, v.created_at, v.retired_at, v.destroyed_at, v.public_key)
        for v in _versions(session, row)
    )
    return KeyView(row.name, row.purpose, row.algorithm, row.backend, row.current_version,
                   row.created_at, row.updated_at, row.disabled_at, versions)  # fmt: skip


def _record_erase_failure(
    committed: Session, name: str, version: int, change_id: int | None, exc: Exception
) -> None:
    """The destroy committed but the backend still holds the material: say so in the audit
    log (its own transaction: the destroy's has ended), so an auditor sees what a person
    must remove by hand. The error's class only: a backend's message may quote a handle."""
    from proofplane.access import SYSTEM
    from proofplane.model import Outcome

    bind = committed.get_bind()
    store = Store(str(bind.engine.url), engine=bind.engine)
    try:
        with store.write(SYSTEM) as tx:
            tx.record("key.destroy", "key", name, outcome=Outcome.FAILURE, details={
                "version": version, "change_id": change_id, "stage": "backend_erase",
                "error": type(exc).__name__,
                "message": "the version is destroyed here; its material is still in the "
                           "KMS backend and must be removed there by hand",
            })  # fmt: skip
    except Exception:
        log.exception("KMS: recording the failed erase of version %s of key %s", version, name)


def check_destroyable(
    name: str, version: int, *, exists: bool, current: int, destroyed: bool
) -> None:
    """Why version ``version`` of ``name`` cannot be destroyed, if it cannot: no such
    version (404), the current one (rotate first), or one already destroyed (409)."""
    details = {"key": name, "version": version}
    if not exists:
        raise KeyNotFound(f"key {name!r} has no version {version}", details=details)
    if version == current:
        raise KeyDisabled("the current version cannot be destroyed: rotate first", details=details)
    if destroyed:
        raise Conflict(f"version {version} of key {name!r} is already destroyed",
                       code="key_version_destroyed", details=details)  # fmt: skip


class Kms:
    """Keys in the inventory, material in ``backend`` (see the module's docstring)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._handles: dict[tuple[str, int], tuple[str, bytes]] = {}
        self._meta: dict[str, tuple[int, str, bool, float]] = {}
        self._lock = threading.Lock()
        #: operations done per key (decrypt and sign are counted, not recorded one by one)
        self.counts: dict[tuple[str, str], int] = {}

    def _count(self, name: str, op: str) -> None:
        with self._lock:
            self.counts[(name, op)] = self.counts.get((name, op), 0) + 1
        count_kms(self.backend.kind, name, op)

    def _failed(self, name: str, op: str) -> None:
        """An operation with key material raised (counted on /metrics; the error goes on)."""
        count_kms(self.backend.kind, name, op, ok=False)

    # --- lifecycle (events) --------------------------------------------------------------------

    def _new_version(self, tx: Tx, row: KmsKeyRow, version: int) -> None:
        try:
            handle = self.backend.generate(row.purpose, f"{row.name}-v{version}")
        except Exception:
            self._failed(row.name, "generate")
            raise
        count_kms(self.backend.kind, row.name, "generate")  # on /metrics, not in ``counts``
        public = self.backend.public_key(handle) if row.purpose == SIGN else None
        tx.session.add(KmsKeyVersionRow(key_id=row.id, version=version, handle=handle,
                                        public_key=public, created_at=tx.now))  # fmt: skip

    def create_key(self, tx: Tx, name: str, purpose: str) -> KeyView:
        check_key_name(name)
        if purpose not in PURPOSES:
            raise WrongPurpose(f"a key's purpose is one of {', '.join(PURPOSES)}",
                               details={"purpose": purpose})  # fmt: skip
        if tx.session.scalar(select(KmsKeyRow.id).where(KmsKeyRow.name == name)) is not None:
            raise KeyExists(f"key {name!r} exists", details={"key": name})
        row = KmsKeyRow(name=name, purpose=purpose, algorithm=ALGORITHMS[purpose],
                        backend=self.backend.kind, current_version=1, created_at=tx.now,
                        updated_at=tx.now)  # fmt: skip
        tx.session.add(row)
        tx.session.flush()
        self._new_version(tx, row, 1)
        tx.record("key.create", "key", name, details={"purpose": purpose,
                  "algorithm": row.algorithm, "backend": row.backend, "version": 1})  # fmt: skip
        tx.session.flush()
        return key_view(tx.session, row)

    def ensure_key(self, tx: Tx, name: str, purpose: str) -> KmsKeyRow:
        """The key ``name``, created (version 1) on first use."""
        row = tx.session.scalar(select(KmsKeyRow).where(KmsKeyRow.name == name))
        if row is None:
            self.create_key(tx, name, purpose)
            row = _key_row(tx.session, name)
        if row.purpose != purpose:
            raise WrongPurpose(f"key {name!r} is for {row.purpose}, not {purpose}",
                               details={"key": name})  # fmt: skip
        return row

    def rotate_key(self, tx: Tx, name: str) -> KeyView:
        """A new version becomes current; older versions still open and verify."""
        self._forget(name)
        row = _key_row(tx.session, name)
        if row.disabled_at is not None:
            raise KeyDisabled(f"key {name!r} is disabled", details={"key": name})
        old = tx.session.get(KmsKeyVersionRow, (row.id, row.current_version))
        if old is not None:
            old.retired_at = tx.now
        row.current_version += 1
        row.updated_at = tx.now
        self._new_version(tx, row, row.current_version)
        tx.record("key.rotate", "key", name, details={"version": row.current_version})
        tx.session.flush()
        return key_view(tx.session, row)

    def disable_key(self, tx: Tx, name: str, disabled: bool = True) -> KeyView:
        """Disable (or enable again) a key: nothing is sealed, opened or signed with it."""
        self._forget(name)
        row = _key_row(tx.session, name)
        row.disabled_at = tx.now if disabled else None
        row.updated_at = tx.now
        tx.record("key.disable" if disabled else "key.enable", "key", name)
        return key_view(tx.session, row)

    def destroy_version(
        self, tx: Tx, name: str, version: int, *, change_id: int | None = None
    ) -> KeyView:
        """Erase one superseded version's material for good: what it sealed no longer opens.

        The order is safe: the inventory marks the version destroyed (its handle dropped) in
        ``tx``, and the backend's material (an HSM object, an OpenBao version) is erased only
        once ``tx`` commits. A transaction that rolls back (a refused change, a failed
        write) leaves the material where it was; an erase that fails after the commit is
        logged: the version is unusable through proofplane either way (no handle), and the
        backend's copy is removed by hand (``key.destroy`` names it)."""
        self._forget(name)
        row = _key_row(tx.session, name)
        ver = tx.session.get(KmsKeyVersionRow, (row.id, version))
        check_destroyable(
            name, version, exists=ver is not None, current=row.current_version,
            destroyed=ver is not None and ver.destroyed_at is not None,
        )  # fmt: skip
        assert ver is not None
        handle = ver.handle
        ver.handle, ver.destroyed_at = None, tx.now
        with self._lock:
            self._handles.pop((name, version), None)
        tx.record("key.destroy", "key", name, details={
            "version": version, "change_id": change_id})  # fmt: skip
        if handle is not None:
            backend = self.backend

            def erase(session: Session) -> None:
                try:
                    backend.destroy(handle)
                except Exception as exc:  # the commit stands; the material is removed by hand
                    log.exception("KMS: erasing version %s of key %s failed after the "
                                  "commit", version, name)  # fmt: skip
                    _record_erase_failure(session, name, version, change_id, exc)

            event.listen(tx.session, "after_commit", erase, once=True)
        return key_view(tx.session, row)

    # --- use -----------------------------------------------------------------------------------

    def _handle(self, session: Session, name: str, version: int, purpose: str) -> bytes:
        cached = self._handles.get((name, version))
        if cached is None:
            row = _key_row(session, name)
            ver = session.get(KmsKeyVersionRow, (row.id, version))
            if ver is None:
                raise DecryptFailed(f"key {name!r} has no version {version}")
            if ver.handle is None:
                raise KeyDisabled(f"version {version} of key {name!r} was destroyed",
                                  details={"key": name, "version": version})  # fmt: skip
            cached = (row.purpose, ver.handle)
            with self._lock:
                self._handles[(name, version)] = cached
        if cached[0] != purpose:
            raise WrongPurpose(f"key {name!r} is for {cached[0]}, not {purpose}",
                               details={"key": name})  # fmt: skip
        return cached[1]

    def _usable(self, session: Session, name: str) -> tuple[int, str]:
        """(current version, purpose) of an enabled key. Read from the inventory at most every
        ``META_TTL_S`` per process (another replica's rotation or disable is seen within it;
        this process's own at once): a SELECT per secret would cost more than the crypto."""
        now = time.monotonic()
        cached = self._meta.get(name)
        if cached is None or now - cached[3] > META_TTL_S:
            row = _key_row(session, name)
            cached = (row.current_version, row.purpose, row.disabled_at is not None, now)
            with self._lock:
                self._meta[name] = cached
        if cached[2]:
            raise KeyDisabled(f"key {name!r} is disabled", details={"key": name})
        return cached[0], cached[1]

    def _forget(self, name: str) -> None:
        with self._lock:
            self._meta.pop(name, None)

    def encrypt(self, session: Session, name: str, plaintext: bytes, aad: bytes) -> str:
        """Seal ``plaintext`` under the current version of ``name`` (an ``encrypt`` key)."""
        version, _ = self._usable(session, name)
        handle = self._handle(session, name, version, ENCRYPT)
        try:
            sealed = envelope.seal(plaintext, aad, key=name, version=version,
                                   wrap=lambda dk, a: self.backend.wrap(handle, dk, a))  # fmt: skip
        except Exception:
            self._failed(name, "encrypt")
            raise
        self._count(name, "encrypt")
        return sealed.text()

    def decrypt(self, session: Session, ciphertext: str, aad: bytes) -> bytes:
        """Open a ciphertext of ``encrypt`` (any version of its key that is not destroyed)."""
        env = envelope.parse(ciphertext)
        self._usable(session, env.key)
        handle = self._handle(session, env.key, env.version, ENCRYPT)
        try:
            plain = envelope.open_envelope(
                env, aad, unwrap=lambda w, a: self.backend.unwrap(handle, w, a)
            )
        except Exception:
            self._failed(env.key, "decrypt")
            raise
        self._count(env.key, "decrypt")
        return plain

    def sign(self, session: Session, name: str, message: bytes) -> tuple[int, bytes]:
        """(version, Ed25519 signature) under the current version of ``name``."""
        version, _ = self._usable(session, name)
        handle = self._handle(session, name, version, SIGN)
        try:
            signature = self.backend.sign(handle, message)
        except Exception:
            self._failed(name, "sign")
            raise
        self._count(name, "sign")
        return version, signature

    def rewrap(self, session: Session, ciphertext: str, aad: bytes) -> str:
        """The same secret sealed under its key's current version (unchanged if it is)."""
        env = envelope.parse(ciphertext)
        version, _ = self._usable(session, env.key)
        if env.version == version:
            return ciphertext
        return self.encrypt(session, env.key, self.decrypt(session, ciphertext, aad), aad)


def list_keys(session: Session) -> list[KeyView]:
    rows = session.scalars(select(KmsKeyRow).order_by(KmsKeyRow.name))
    return [key_view(session, r) for r in rows]


def get_key(session: Session, name: str) -> KeyView:
    return key_view(session, _key_row(session, name))


# --- the store's KMS and secrets at rest ---------------------------------------------------------

_BUILD_LOCK = threading.Lock()


def kms_for(store: Store) -> Kms:
    """The store's KMS: set by the server at start, else built from the environment once."""
    kms = store.kms
    if kms is None:
        with _BUILD_LOCK:
            kms = store.kms
            if kms is None:
                kms = Kms(backend_from_env(os.environ))
                store.kms = kms
    return kms  # type: ignore[no-any-return]


def secret_aad(table: str, row_id: object, column: str) -> bytes:
    """The identity a stored secret is bound to: ``<table>/<row id>/<column>``."""
    return f"{table}/{row_id}/{column}".encode()


def seal_secret(kms: Kms, tx: Tx, value: str, aad: bytes) -> str:
    """``value`` as stored: KMS ciphertext under the ``secrets`` key (created on first use)."""
    kms.ensure_key(tx, SECRETS_KEY, ENCRYPT)
    return kms.encrypt(tx.session, SECRETS_KEY, value.encode(), aad)


def open_secret(kms: Kms, session: Session, stored: str, aad: bytes) -> str:
    """The plaintext of a stored secret (``DecryptFailed`` if it is not the row's)."""
    return kms.decrypt(session, stored, aad).decode()
