"""Failed logins counted beyond the user row: by source address and by unknown username.

PCI DSS 4.0 §8.3.4's lockout stays (``LOCK_AFTER`` consecutive failures lock an account for
``LOCK_FOR``), with two additions (issue 19, §4):

* **Unknown usernames lock too.** A username no account has is counted in ``auth_failures``
  under the SHA-256 of the name and "locked" after the same count, for the same time, with the
  same 423 body: a lockout no longer tells which usernames exist. Only strings that could be
  usernames are counted (what is not one cannot be an account, and may be a password typed in
  the wrong box).
* **A source address is throttled.** After ``THROTTLE_FREE`` failed logins from one address
  (as many as lock one account; an IPv6 address counts by its /64), each further attempt from
  it must wait a delay that doubles with every failure, 1 s up to ``THROTTLE_MAX_DELAY``
  (at most about 16 guesses an hour: one or two lockouts, not all); an attempt made sooner is
  refused with 429 ``too_many_attempts`` and ``Retry-After`` before any password is checked
  (so it can neither guess nor lock). An address with no failure for ``THROTTLE_FORGET`` starts
  afresh; a success does not reset it (one valid account would otherwise reset the delay).
  The refusals themselves are not written anywhere: an attacker cannot fill the log with them.

The counters live in the database, so every API replica shares them and a restart forgets
nothing. ``MAX_TRACKED`` bounds the table: rows that mean nothing any more (an address idle
past ``THROTTLE_FORGET``, a lock that has run out) go first, then the oldest.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from datetime import datetime, timedelta

from sqlalchemy import delete, func, or_, select

from proofplane.errors import ProofplaneError
from proofplane.model import Outcome
from proofplane.service.context import Tx
from proofplane.service.runbooks import with_runbook
from proofplane.store.tables import AuthFailureRow

LOCK_AFTER = 10  # consecutive failures (PCI DSS 4.0 §8.3.4: at most 10)
LOCK_FOR = timedelta(minutes=30)  # (…for at least 30 minutes)
THROTTLE_FREE = 10  # failed logins from one address before delays begin (one lockout's worth)
THROTTLE_MAX_DELAY = timedelta(minutes=15)
THROTTLE_FORGET = timedelta(hours=1)  # an address with no failure this long starts afresh
MAX_TRACKED = 10_000  # rows of ``auth_failures`` kept at most

# The username pattern (common.USERNAME_PATTERN), repeated to keep this module standalone.
_USERNAME = re.compile(r"[a-z0-9][a-z0-9._@-]{0,62}")


class TooManyAttempts(ProofplaneError):
    """Too many failed logins from this source address: wait ``details.retry_after`` seconds."""

    code = "too_many_attempts"


def source_key(address: str) -> str:
    """The throttle's key for a client address: the address itself, or an IPv6 address's /64
    (one subscriber's allocation: an attacker holding a /64 is one source, not 2**64)."""
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return "addr:" + address.strip()[:64]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv6Address):
        return f"addr:{ipaddress.IPv6Network((ip, 64), strict=False)}"
    return f"addr:{ip}"


def throttle_delay(failures: int) -> timedelta:
    """How long a source with ``failures`` counted failures waits after its last one: nothing
    up to ``THROTTLE_FREE``, then 1 s, 2 s, 4 s … at most ``THROTTLE_MAX_DELAY``."""
    if failures < THROTTLE_FREE:
        return timedelta(0)
    exponent = min(failures - THROTTLE_FREE, 32)
    return min(timedelta(seconds=2**exponent), THROTTLE_MAX_DELAY)


def _live(row: AuthFailureRow | None, now: datetime) -> AuthFailureRow | None:
    """The row if it still counts: an address idle past ``THROTTLE_FORGET`` and a name whose
    lock has run out count as no failure at all (as an account's counter after its lock)."""
    if row is None:
        return None
    if row.key.startswith("addr:") and now - row.last_failure_at >= THROTTLE_FORGET:
        return None
    if row.locked_until is not None and row.locked_until <= now:
        return None
    return row


def check_source(tx: Tx, key: str) -> None:
    """Refuse the attempt (TooManyAttempts) while the source's delay runs."""
    row = _live(tx.session.get(AuthFailureRow, key), tx.now)
    if row is None:
        return
    wait_until = row.last_failure_at + throttle_delay(row.failures)
    if tx.now < wait_until:
        retry_after = max(1, math.ceil((wait_until - tx.now).total_seconds()))
        raise TooManyAttempts(
            f"too many failed logins from this address; try again in {retry_after} s",
            details={"retry_after": retry_after},
        )


def _count(tx: Tx, key: str) -> AuthFailureRow:
    """One more failure under ``key`` (a fresh count where the old one no longer counts)."""
    row = tx.session.get(AuthFailureRow, key)
    if row is None:
        _make_room(tx)
        row = AuthFailureRow(key=key, failures=0, last_failure_at=tx.now, locked_until=None)
        tx.session.add(row)
    elif _live(row, tx.now) is None:
        row.failures, row.locked_until = 0, None
    row.failures += 1
    row.last_failure_at = tx.now
    return row


def _make_room(tx: Tx) -> None:
    """Keep the table bounded: forget what no longer counts, then the oldest rows."""
    tx.session.execute(
        delete(AuthFailureRow).where(
            or_(
                AuthFailureRow.locked_until <= tx.now,
                (AuthFailureRow.key.startswith("addr:"))
                & (AuthFailureRow.last_failure_at <= tx.now - THROTTLE_FORGET),
            )
        )
    )
    count = tx.session.scalar(select(func.count()).select_from(AuthFailureRow)) or 0
    if count >= MAX_TRACKED:
        oldest = select(AuthFailureRow.key).order_by(AuthFailureRow.last_failure_at)
        keys = list(tx.session.scalars(oldest.limit(count - MAX_TRACKED + 1)))
        tx.session.execute(delete(AuthFailureRow).where(AuthFailureRow.key.in_(keys)))


def count_source_failure(tx: Tx, key: str) -> None:
    """A failed login from this source; the first time it starts being delayed, an alert."""
    row = _count(tx, key)
    if row.failures == THROTTLE_FREE:
        tx.record(
            "alert.auth_source_throttled",
            "source",
            key.removeprefix("addr:"),
            outcome=Outcome.FAILURE,
            details=with_runbook(
                {"failed_logins": row.failures, "severity": "medium"},
                "alert.auth_source_throttled",
                Outcome.FAILURE,
                tx.session,
            ),
        )


def name_key(username: str) -> str | None:
    """The key an unknown username is counted under, or None for what cannot be a username."""
    if not isinstance(username, str) or not _USERNAME.fullmatch(username):
        return None
    return "name:" + hashlib.sha256(username.encode()).hexdigest()


def unknown_name_locked_until(tx: Tx, username: str) -> datetime | None:
    """When the lock on this unknown username runs out, if it is locked now."""
    key = name_key(username)
    row = _live(tx.session.get(AuthFailureRow, key), tx.now) if key is not None else None
    return row.locked_until if row is not None else None


def count_unknown_name_failure(tx: Tx, username: str) -> None:
    """A failed login for a username no account has: counted and locked like an account; the
    lock is recorded (``account.lock`` with ``unknown_user``) in the same transaction, as an
    account's is. The count itself is the ``auth.login`` failure the caller records."""
    key = name_key(username)
    if key is None:
        return
    row = _count(tx, key)
    if row.failures >= LOCK_AFTER:
        row.locked_until = tx.now + LOCK_FOR
        tx.record(
            "account.lock",
            "user",
            username,  # a valid username: name_key accepted it
            details={
                "consecutive_failures": row.failures,
                "locked_until": row.locked_until.isoformat(),
                "unknown_user": True,
            },
        )
