"""Secrets at rest (issue 13, part 2): the secrets the database holds become KMS ciphertext.

The columns that hold them get room for a ciphertext (``users.totp_secret``,
``oidc_logins.nonce`` and ``oidc_logins.code_verifier`` become TEXT), and every value still in
the clear is sealed under the KMS key ``secrets`` (``ppk1.secrets.<version>.…``, see
``proofplane.keys.envelope``) with its row's identity as AAD (``users/<id>/totp_secret``,
``siem_sinks/<id>/<field>``, ``oidc_logins/<state>/<column>``), as the services seal them:
TOTP seeds, the sinks' secret fields (``token``, ``bearer_token``, ``key_file``) and the
nonce and PKCE verifier of the OIDC logins in flight. Values that already are ciphertext are
left as they are, so running it again changes nothing.

The KMS is the one the environment configures (``PROOFPLANE_KMS``, the embedded keyring under
``PROOFPLANE_MASTER_KEY_FILE`` by default), or the backend a caller hands Alembic as the
config attribute ``kms_backend``. It is needed only when there is something to seal: the key
``secrets`` is created (version 1, with its ``key.create`` event in the audit log, in this
transaction) on first need. A KMS that cannot be used fails the migration, and nothing of it
is kept.

Downgrade opens every ciphertext again (with the same KMS) and gives the columns their old
types back; a value that does not open stops it, nothing changed.

This migration works on the tables as they are at this revision (its own table definitions,
not the ORM's) and uses no service code: the layers below ``service`` only.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from proofplane.access import SYSTEM
from proofplane.audit.canonical import entry_leaf_hashes, format_ts, stored_details
from proofplane.keys import ALGORITHMS, ENCRYPT, DecryptFailed, KeyDisabled, WrongPurpose, envelope
from proofplane.kms import Backend, backend_from_env
from proofplane.store.audit_log import Appender
from proofplane.store.db import WRITE_LOCK_KEY
from proofplane.store.tables import UTCDateTime

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SECRETS_KEY = "secrets"
#: the sinks' secret fields at this revision (proofplane.audit.export.config.SECRET_FIELDS)
SINK_SECRET_FIELDS = ("bearer_token", "key_file", "token")

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON().with_variant(JSONB(), "postgresql")

users = sa.table("users", sa.column("id", sa.Integer), sa.column("totp_secret", sa.Text))
sinks = sa.table("siem_sinks", sa.column("id", sa.Integer), sa.column("config", Json))
oidc_logins = sa.table(
    "oidc_logins",
    sa.column("state", sa.String),
    sa.column("nonce", sa.Text),
    sa.column("code_verifier", sa.Text),
)
kms_keys = sa.table(
    "kms_keys",
    sa.column("id", BigId),
    sa.column("name", sa.String),
    sa.column("purpose", sa.String),
    sa.column("algorithm", sa.String),
    sa.column("backend", sa.String),
    sa.column("current_version", sa.Integer),
    sa.column("created_at", UTCDateTime),
    sa.column("updated_at", UTCDateTime),
    sa.column("disabled_at", UTCDateTime),
)
kms_key_versions = sa.table(
    "kms_key_versions",
    sa.column("key_id", BigId),
    sa.column("version", sa.Integer),
    sa.column("handle", sa.LargeBinary),
    sa.column("public_key", sa.LargeBinary),
    sa.column("created_at", UTCDateTime),
)


def _events(sqlite: bool) -> sa.TableClause:
    # SQLite keeps an event's details as their canonical JSON text, as Tx.record writes them
    return sa.table(
        "events",
        sa.column("seq", BigId),
        sa.column("ts", UTCDateTime),
        sa.column("actor", sa.String),
        sa.column("action", sa.String),
        sa.column("target_type", sa.String),
        sa.column("target_id", sa.String),
        sa.column("outcome", sa.String),
        sa.column("details", sa.Text if sqlite else Json),
    )


def _aad(table: str, row_id: object, column: str) -> bytes:
    return f"{table}/{row_id}/{column}".encode()  # service/keys.py secret_aad


class _Secrets:
    """The key ``secrets`` on this migration's connection: seal (creating the key on first
    need) and open, with the backend built on first use."""

    def __init__(self, conn: sa.Connection) -> None:
        self.conn = conn
        self.now = datetime.now(UTC)
        self._backend: Backend | None = None
        self._current: tuple[int, bytes] | None = None
        self._handles: dict[int, bytes] = {}

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            config = op.get_context().config
            given = config.attributes.get("kms_backend") if config is not None else None
            self._backend = given if given is not None else backend_from_env(os.environ)
        return self._backend

    def _key(self, create: bool) -> Any:
        row = self.conn.execute(
            sa.select(kms_keys.c.id, kms_keys.c.purpose, kms_keys.c.current_version,
                      kms_keys.c.disabled_at).where(kms_keys.c.name == SECRETS_KEY)
        ).first()  # fmt: skip
        if row is None and create:
            self._create()
            return self._key(create=False)
        if row is None:
            raise DecryptFailed(f"there is no key {SECRETS_KEY!r} to open the secrets with")
        if row.purpose != ENCRYPT:
            raise WrongPurpose(f"key {SECRETS_KEY!r} is for {row.purpose}, not {ENCRYPT}")
        if row.disabled_at is not None:
            raise KeyDisabled(f"key {SECRETS_KEY!r} is disabled: enable it to migrate")
        return row

    def _create(self) -> None:
        """Version 1 of the key, and its ``key.create`` event (as Kms.create_key writes)."""
        if self.conn.dialect.name == "postgresql":  # the writers' lock (store.db)
            self.conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": WRITE_LOCK_KEY})
        backend = self.backend
        handle = backend.generate(ENCRYPT, f"{SECRETS_KEY}-v1")
        key_id = self.conn.execute(
            kms_keys.insert()
            .values(name=SECRETS_KEY, purpose=ENCRYPT, algorithm=ALGORITHMS[ENCRYPT],
                    backend=backend.kind, current_version=1, created_at=self.now,
                    updated_at=self.now, disabled_at=None)
            .returning(kms_keys.c.id)
        ).scalar_one()  # fmt: skip
        self.conn.execute(
            kms_key_versions.insert().values(
                key_id=key_id, version=1, handle=handle, public_key=None, created_at=self.now
            )
        )
        self._record(
            "key.create",
            "key",
            SECRETS_KEY,
            {"purpose": ENCRYPT, "algorithm": ALGORITHMS[ENCRYPT], "backend": backend.kind,
             "version": 1},
        )  # fmt: skip

    def _record(
        self, action: str, target_type: str, target_id: str, details: dict[str, Any]
    ) -> None:
        """One event and its Merkle leaf, as ``Tx.record`` appends them."""
        sqlite = self.conn.dialect.name == "sqlite"
        value, stored, text = stored_details(details)
        events = _events(sqlite)
        last = self.conn.execute(sa.select(sa.func.max(events.c.seq))).scalar()
        seq = (last or 0) + 1
        leaves = entry_leaf_hashes(
            format_ts(self.now), SYSTEM.name, [(seq, action, target_type, target_id, "success",
                                                text)]
        )  # fmt: skip
        appender = Appender.load(self.conn, seq - 1)
        self.conn.execute(
            events.insert().values(seq=seq, ts=self.now, actor=SYSTEM.name, action=action,
                                   target_type=target_type, target_id=target_id,
                                   outcome="success", details=stored if sqlite else value)
        )  # fmt: skip
        appender.append_leaves(leaves)
        appender.flush(self.conn)

    def _handle(self, key_id: int, version: int) -> bytes:
        handle = self._handles.get(version)
        if handle is None:
            handle = self.conn.execute(
                sa.select(kms_key_versions.c.handle).where(
                    kms_key_versions.c.key_id == key_id, kms_key_versions.c.version == version
                )
            ).scalar()
            if handle is None:
                raise DecryptFailed(f"key {SECRETS_KEY!r} has no usable version {version}")
            self._handles[version] = handle
        return handle

    def seal(self, value: str, aad: bytes) -> str:
        if self._current is None:
            key = self._key(create=True)
            self._current = (key.current_version, self._handle(key.id, key.current_version))
        version, handle = self._current
        wrap: Callable[[bytes, bytes], bytes] = lambda dk, a: self.backend.wrap(handle, dk, a)  # noqa: E731
        return envelope.seal(value.encode(), aad, key=SECRETS_KEY, version=version,
                             wrap=wrap).text()  # fmt: skip

    def open(self, text: str, aad: bytes) -> str:
        env = envelope.parse(text)
        if env.key != SECRETS_KEY:
            raise DecryptFailed(f"a secret sealed under key {env.key!r}, not {SECRETS_KEY!r}")
        handle = self._handle(self._key(create=False).id, env.version)
        plain = envelope.open_envelope(
            env, aad, unwrap=lambda w, a: self.backend.unwrap(handle, w, a)
        )
        return plain.decode()


def _convert(conn: sa.Connection, change: Callable[[str, bytes], str | None]) -> None:
    """Apply ``change(stored, aad)`` (None: leave it) to every stored secret."""
    for row_id, value in conn.execute(
        sa.select(users.c.id, users.c.totp_secret).where(users.c.totp_secret.is_not(None))
    ).all():
        new = change(value, _aad("users", row_id, "totp_secret"))
        if new is not None:
            conn.execute(users.update().where(users.c.id == row_id).values(totp_secret=new))
    for row_id, config in conn.execute(sa.select(sinks.c.id, sinks.c.config)).all():
        if not isinstance(config, dict):
            continue
        out = dict(config)
        for field in SINK_SECRET_FIELDS:
            if isinstance(out.get(field), str):
                new = change(out[field], _aad("siem_sinks", row_id, field))
                if new is not None:
                    out[field] = new
        if out != config:
            conn.execute(sinks.update().where(sinks.c.id == row_id).values(config=out))
    for state, nonce, verifier in conn.execute(
        sa.select(oidc_logins.c.state, oidc_logins.c.nonce, oidc_logins.c.code_verifier)
    ).all():
        values = {}
        for column, value in (("nonce", nonce), ("code_verifier", verifier)):
            new = change(value, _aad("oidc_logins", state, column))
            if new is not None:
                values[column] = new
        if values:
            conn.execute(oidc_logins.update().where(oidc_logins.c.state == state).values(**values))


def _retype(types: dict[tuple[str, str], tuple[sa.types.TypeEngine, sa.types.TypeEngine]]) -> None:
    """Change the columns' types: ``{(table, column): (from, to)}``."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        for (table, column), (old, new) in types.items():
            op.alter_column(table, column, type_=new, existing_type=old)
        return
    # SQLite: ``users`` is referenced by ``tokens`` (ON DELETE CASCADE), so it is not rebuilt
    # (batch mode drops the table, and with foreign keys on that deletes every token): the
    # column is renamed aside, added again with its new type, copied and dropped instead.
    for (table, column), (_old, new) in types.items():
        if table != "users":
            continue
        aside = f"{column}_0012"
        op.execute(f'ALTER TABLE "{table}" RENAME COLUMN "{column}" TO "{aside}"')
        op.add_column(table, sa.Column(column, new, nullable=True))
        op.execute(f'UPDATE "{table}" SET "{column}" = "{aside}"')
        op.execute(f'ALTER TABLE "{table}" DROP COLUMN "{aside}"')
    with op.batch_alter_table("oidc_logins") as batch:  # nothing references it
        for (table, column), (old, new) in types.items():
            if table == "oidc_logins":
                batch.alter_column(column, type_=new, existing_type=old, existing_nullable=False)


def _types(down: bool) -> dict[tuple[str, str], tuple[sa.types.TypeEngine, sa.types.TypeEngine]]:
    before = {
        ("users", "totp_secret"): sa.String(length=64),
        ("oidc_logins", "nonce"): sa.String(length=64),
        ("oidc_logins", "code_verifier"): sa.String(length=128),
    }
    return {k: ((sa.Text(), v) if down else (v, sa.Text())) for k, v in before.items()}


def upgrade() -> None:
    _retype(_types(down=False))
    secrets = _Secrets(op.get_bind())

    def seal(stored: str, aad: bytes) -> str | None:
        return None if envelope.is_ciphertext(stored) else secrets.seal(stored, aad)

    _convert(op.get_bind(), seal)


def downgrade() -> None:
    secrets = _Secrets(op.get_bind())

    def open_(stored: str, aad: bytes) -> str | None:
        return secrets.open(stored, aad) if envelope.is_ciphertext(stored) else None

    _convert(op.get_bind(), open_)
    _retype(_types(down=True))
