"""The console's and the evidence package's test world: the shipped demo cluster admitted by
its simulated attesters (one node drifts and is quarantined), people with passwords (a
security officer who must enroll TOTP, a developer of the hospital, a developer of the bank),
a signed checkpoint, and a way to sign a browser session in without a browser."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from dbtest import demo_text
from proofplane.access import SYSTEM, totp
from proofplane.access.credentials import csrf_token
from proofplane.config import Settings
from proofplane.demo.attester import load_attested_demo
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service import access as access_svc
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store
from proofplane.store import migrate

PASSWORD = "correct horse battery staple"
OFFICER = "sofia-officer"
HOSPITAL_DEV = "hana-hospital-dev"
BANK_DEV = "bert-bank-dev"
HOSPITAL = "st-marys-hospital"
BANK = "nordbank"
SETTINGS = Settings(cookie_secure=False)


@dataclass
class World:
    store: Store
    url: str
    keys: audit_svc.AuditKeys


def build_world(tmp_path: Path, admin_token: str | None = None) -> World:
    """A migrated SQLite file with the attested demo, its people and a signed checkpoint
    (``admin_token``: also the bootstrap admin's token, which works only on a new database)."""
    url = f"sqlite:///{tmp_path / 'console.db'}"
    store = Store(url)
    migrate.upgrade(store.engine)
    if admin_token is not None:
        access_svc.bootstrap_admin(store, admin_token)
    load_attested_demo(store, parse_cluster(demo_text()))
    access_svc.create_user(store, SYSTEM, OFFICER, PASSWORD, ["security-officer"], [])
    access_svc.create_user(store, SYSTEM, HOSPITAL_DEV, PASSWORD, ["developer"], [HOSPITAL])
    access_svc.create_user(store, SYSTEM, BANK_DEV, PASSWORD, ["developer"], [BANK])
    keys = audit_svc.AuditKeys(origin=audit_svc.origin_for(SETTINGS.cluster_id))
    audit_svc.sign_checkpoint(store, SYSTEM, keys, datetime.now(UTC))
    return World(store, url, keys)


def session_cookies(store: Store, username: str, secret: str | None = None) -> dict[str, str]:
    """Browser cookies of a signed-in session of ``username`` (TOTP from ``secret``: the next
    step's code, which the server's window accepts and no earlier use has spent)."""
    code = None if secret is None else next_code(secret)
    issued = access_svc.login(store, username, PASSWORD, code, session_ttl=SETTINGS.session_ttl)
    return {"proofplane_session": issued.token, "proofplane_csrf": csrf_token(issued.token)}


def next_code(secret: str) -> str:
    """The code of the next TOTP step (the current one may be spent already)."""
    return totp.code_at_step(secret, totp.step_at(time.time()) + 1)


def enroll_totp(store: Store, username: str) -> str:
    """Enroll ``username``'s TOTP through the service (as the enrollment page does); the
    secret."""
    issued = access_svc.login(store, username, PASSWORD, None, session_ttl=SETTINGS.session_ttl)
    actor = access_svc.authenticate(store, issued.token, datetime.now(UTC))
    secret, _ = access_svc.mfa_begin(store, actor)
    code = totp.code_at_step(secret, totp.step_at(time.time()))
    access_svc.mfa_confirm(store, actor, code)
    return secret
