"""Runtime settings, read once from the environment (``PROOFPLANE_*``) at the edge."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import platformdirs

from proofplane.errors import ValidationFailed


@dataclass(frozen=True, slots=True)
class OidcSettings:
    """An OpenID Connect provider for SSO (authorization code + PKCE)."""

    issuer: str
    client_id: str
    client_secret: str | None
    redirect_uri: str
    scopes: tuple[str, ...] = ("openid", "profile", "email", "groups")
    groups_claim: str = "groups"
    username_claim: str = "preferred_username"
    # group → {"roles": [...], "tenants": [...]}; a user gets the union over their groups.
    group_map: dict[str, dict[str, list[str]]] = field(default_factory=dict)


MAX_BODY_BYTES = 1 << 20  # 1 MiB: PROOFPLANE_MAX_BODY_BYTES
MAX_EVIDENCE_BYTES = 16 << 20  # 16 MiB: PROOFPLANE_MAX_EVIDENCE_BYTES
# Requests in flight per worker process (issue 20, §4): PROOFPLANE_MAX_INFLIGHT_<LEVEL>. A
# worker runs Python under one interpreter lock, so a request in flight beyond a few per core
# only waits for the CPU, and makes every other one wait longer: a handful per level. Writes
# also queue for the database's one write slot, so theirs is small, with a longer queue and
# wait (PROOFPLANE_MAX_QUEUE_<LEVEL>, PROOFPLANE_MAX_QUEUE_WAIT_MS[_<LEVEL>]).
# Attestation 8: with 16, a 2-core box under a fleet's overload ran its rounds' write
# transactions 2.4x longer and answered fewer of them (README, "The API at fleet scale").
MAX_INFLIGHT = {"attestation": 8, "read": 6, "write": 16}
MAX_INFLIGHT_CLIENT_SHARE = 0.5  # PROOFPLANE_MAX_INFLIGHT_CLIENT_SHARE
MAX_QUEUE = {"attestation": 8, "read": 3, "write": 8}
MAX_QUEUE_WAIT_MS = {"attestation": 50.0, "read": 50.0, "write": 500.0}


DEFRAG_MAX_MOVES_ENV = "PROOFPLANE_DEFRAG_MAX_MOVES_PER_HOUR"
DEFRAG_MAX_MOVES_PER_HOUR = 20

# How the scheduler may change MIG layouts on its own (issue 17 §2): "on" carves new instances
# into free slices (never touching an instance) and re-lays idle GPUs; "idle" only re-lays
# GPUs that hold no work; "off": layouts change only by inventory or a ``mig.layout`` change;
# "reclaim": as "on", and carving may also destroy *idle* instances (nothing placed on them)
# on the GPU it carves, beside running ones (the replay's ``proofplane+repartition``).
MIG_AUTO_LAYOUT_ENV = "PROOFPLANE_MIG_AUTO_LAYOUT"
MIG_AUTO_LAYOUT_MODES = ("on", "idle", "off", "reclaim")
MIG_AUTO_LAYOUT = "on"


@dataclass(frozen=True, slots=True)
class Settings:
    session_ttl: timedelta = timedelta(hours=1)
    cookie_secure: bool = True
    admin_token: str | None = None
    oidc: OidcSettings | None = None
    # The SIEM exporter's pass interval in the API server; None or 0: no exporter thread.
    siem_export_interval_s: float | None = None
    # The audit log: origin proofplane/<cluster_id>; checkpoint signing interval (None or 0: no
    # background signing); signing key file (None: $PROOFPLANE_AUDIT_KEY_FILE or the data dir).
    cluster_id: str = "default"
    audit_checkpoint_interval_s: float | None = None
    audit_key_file: str | None = None
    # Attestation (issue 5): a node under an enforcing policy whose last passing attestation is
    # older than ``attest_grace_s`` is quarantined; the server looks every
    # ``attest_stale_check_interval_s`` (None or 0: never). ``demo_attester`` = "simulated"
    # (set by ``up`` only): enrollment from a software-key simulated attester is accepted and
    # marked as simulated; otherwise (None) it is refused.
    attest_grace_s: float = 900.0
    attest_stale_check_interval_s: float | None = None
    demo_attester: str | None = None
    # Request bodies (issue 19, §3): at most ``max_body_bytes``, except a node's attestation
    # evidence (its event logs), at most ``max_evidence_bytes``; larger: 413 payload_too_large.
    max_body_bytes: int = MAX_BODY_BYTES
    max_evidence_bytes: int = MAX_EVIDENCE_BYTES
    # /docs and /redoc (issue 19, §6): off unless asked for; /openapi.json is always served.
    api_docs: bool = False
    # Change control (issue 12): "enforce" (PROOFPLANE_CHANGE_CONTROL's default, so serve's and
    # up's): governed actions only through approved change requests; "off" (this dataclass's
    # default, for tests and small labs): the direct calls work, and /readyz says so.
    change_control: str = "off"
    # An emergency change's post-implementation review is due this many hours after it applied
    # (PROOFPLANE_EMERGENCY_REVIEW_HOURS, 1..720, default 24); the server looks for overdue
    # reviews every ``change_review_check_interval_s`` (PROOFPLANE_CHANGE_REVIEW_CHECK_SECONDS,
    # default 60; None or 0: never) and alerts once an hour per overdue change.
    emergency_review_hours: float = 24.0
    change_review_check_interval_s: float | None = None
    # Overload (issue 20, §4): per worker process, at most ``max_inflight[level]`` requests in
    # flight per priority level ("attestation": the agents' routes, "read", "write"), at most
    # ``max_inflight_client_share`` of a level's slots to one client; a request that finds none
    # waits in a queue of ``max_queue[level]`` at most ``max_queue_wait_ms[level]`` (refused at
    # once when its expected wait is longer), then is refused: 429 + Retry-After.
    max_inflight: dict[str, int] = field(default_factory=lambda: dict(MAX_INFLIGHT))
    max_inflight_client_share: float = MAX_INFLIGHT_CLIENT_SHARE
    max_queue: dict[str, int] = field(default_factory=lambda: dict(MAX_QUEUE))
    max_queue_wait_ms: dict[str, float] = field(default_factory=lambda: dict(MAX_QUEUE_WAIT_MS))
    # Telemetry (issue 15): raw readings are kept ``telemetry_raw_hours``
    # (PROOFPLANE_TELEMETRY_RAW_HOURS, 1..8760, default 48; hourly rollups 400 days); the
    # server rolls up, applies retention and judges idle workloads every
    # ``telemetry_interval_s`` (PROOFPLANE_TELEMETRY_INTERVAL_SECONDS, default 60; None or 0:
    # never).
    telemetry_raw_hours: float = 48.0
    telemetry_interval_s: float | None = None
    # Alerts (issue 15, §8): where they go and how often the rules run (``AlertSettings``);
    # None: no alert worker.
    alerts: AlertSettings | None = None
    # issue 17 §3: read again at each decision (config.defrag_max_moves_per_hour); here so
    # that ``serve`` refuses a malformed value at start instead of on a MIG submit
    defrag_max_moves_per_hour: int = DEFRAG_MAX_MOVES_PER_HOUR
    # issue 17 §2: read again when the server loads its scheduler (config.mig_auto_layout);
    # here so that ``serve`` refuses a malformed value at start
    mig_auto_layout: str = MIG_AUTO_LAYOUT


DEMO_ATTESTERS = ("simulated",)


def _seconds(env: dict[str, str], name: str, default: str, low: float, high: float) -> float:
    raw = env.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not low <= value <= high:  # NaN fails this too
        off = " (0: off)" if low == 0 else ""
        raise ValidationFailed(f"{name} must be {low:g}..{high:g}{off}", code="invalid_setting")
    return value


def _bytes(env: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ValidationFailed(f"{name} must be {low}..{high} bytes", code="invalid_setting")
    return int(raw)


def _count(env: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ValidationFailed(
            f"{name} must be a whole number {low}..{high}", code="invalid_setting"
        )
    return int(raw)


def _max_inflight(env: dict[str, str]) -> dict[str, int]:
    """PROOFPLANE_MAX_INFLIGHT_ATTESTATION, _READ, _WRITE: 1..1024 each."""
    return {
        level: _count(env, f"PROOFPLANE_MAX_INFLIGHT_{level.upper()}", default, 1, 1024)
        for level, default in MAX_INFLIGHT.items()
    }


def _max_queue(env: dict[str, str]) -> dict[str, int]:
    """PROOFPLANE_MAX_QUEUE_ATTESTATION, _READ, _WRITE: 1..1024 each."""
    return {
        level: _count(env, f"PROOFPLANE_MAX_QUEUE_{level.upper()}", default, 1, 1024)
        for level, default in MAX_QUEUE.items()
    }


def _max_queue_wait_ms(env: dict[str, str]) -> dict[str, float]:
    """PROOFPLANE_MAX_QUEUE_WAIT_MS (every level), then PROOFPLANE_MAX_QUEUE_WAIT_MS_<LEVEL>
    (that one): 0..1000 each."""
    name = "PROOFPLANE_MAX_QUEUE_WAIT_MS"
    every = _seconds(env, name, "0", 0, 1000) if name in env else None
    return {
        level: _seconds(
            env, f"{name}_{level.upper()}", str(default if every is None else every), 0, 1000
        )
        for level, default in MAX_QUEUE_WAIT_MS.items()
    }


def _flag(env: dict[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValidationFailed(f"{name} must be 1 or 0", code="invalid_setting")


_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def _json(name: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValidationFailed(f"{name} is not valid JSON: {exc}", code="invalid_setting") from exc


def from_env(env: dict[str, str] | None = None) -> Settings:
    """Settings from ``PROOFPLANE_*`` variables; a malformed one is an error, not a default."""
    env = dict(os.environ if env is None else env)
    oidc = None
    if env.get("PROOFPLANE_OIDC_ISSUER"):
        missing = [
            k
            for k in ("PROOFPLANE_OIDC_CLIENT_ID", "PROOFPLANE_OIDC_REDIRECT_URI")
            if not env.get(k)
        ]
        if missing:
            raise ValidationFailed(
                f"OIDC is configured but {', '.join(missing)} is not set", code="invalid_setting"
            )
        group_map = _json("PROOFPLANE_OIDC_GROUP_MAP", env.get("PROOFPLANE_OIDC_GROUP_MAP", "{}"))
        oidc = OidcSettings(
            issuer=env["PROOFPLANE_OIDC_ISSUER"].rstrip("/"),
            client_id=env["PROOFPLANE_OIDC_CLIENT_ID"],
            client_secret=env.get("PROOFPLANE_OIDC_CLIENT_SECRET") or None,
            redirect_uri=env["PROOFPLANE_OIDC_REDIRECT_URI"],
            scopes=tuple(env.get("PROOFPLANE_OIDC_SCOPES", "openid profile email groups").split()),
            groups_claim=env.get("PROOFPLANE_OIDC_GROUPS_CLAIM", "groups"),
            username_claim=env.get("PROOFPLANE_OIDC_USERNAME_CLAIM", "preferred_username"),
            group_map=group_map,
        )
    ttl = env.get("PROOFPLANE_SESSION_TTL_SECONDS", "3600")
    if not ttl.isdigit() or not 60 <= int(ttl) <= 86400:
        raise ValidationFailed(
            "PROOFPLANE_SESSION_TTL_SECONDS must be 60..86400", code="invalid_setting"
        )
    admin_token = env.get("PROOFPLANE_ADMIN_TOKEN") or None
    if admin_token is not None and not 16 <= len(admin_token) <= 256:
        raise ValidationFailed(
            "PROOFPLANE_ADMIN_TOKEN must be 16..256 characters", code="invalid_setting"
        )
    export_s = _seconds(env, "PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS", "5", 0, 3600)
    checkpoint_s = _seconds(env, "PROOFPLANE_AUDIT_CHECKPOINT_INTERVAL_SECONDS", "5", 0, 3600)
    cluster_id = env.get("PROOFPLANE_CLUSTER_ID", "default")
    if not cluster_id or any(c in cluster_id for c in "+ \t\n") or not cluster_id.isprintable():
        raise ValidationFailed(
            "PROOFPLANE_CLUSTER_ID must be printable, without spaces or '+'",
            code="invalid_setting",
        )
    grace_s = _seconds(env, "PROOFPLANE_ATTEST_GRACE_SECONDS", "900", 10, 7 * 86400)
    stale_s = _seconds(env, "PROOFPLANE_ATTEST_STALE_CHECK_SECONDS", "30", 0, 3600)
    demo_attester = env.get("PROOFPLANE_DEMO_ATTESTER", "").strip().lower() or None
    if demo_attester is not None and demo_attester not in DEMO_ATTESTERS:
        raise ValidationFailed(
            "PROOFPLANE_DEMO_ATTESTER must be unset or 'simulated'", code="invalid_setting"
        )
    max_body = _bytes(env, "PROOFPLANE_MAX_BODY_BYTES", MAX_BODY_BYTES, 1 << 10, 1 << 30)
    max_evidence = _bytes(
        env, "PROOFPLANE_MAX_EVIDENCE_BYTES", max(MAX_EVIDENCE_BYTES, max_body), 1 << 10, 1 << 30
    )
    return Settings(
        max_body_bytes=max_body,
        max_evidence_bytes=max_evidence,
        api_docs=_flag(env, "PROOFPLANE_API_DOCS"),
        attest_grace_s=grace_s,
        attest_stale_check_interval_s=stale_s or None,
        demo_attester=demo_attester,
        cluster_id=cluster_id,
        audit_checkpoint_interval_s=checkpoint_s or None,
        audit_key_file=env.get("PROOFPLANE_AUDIT_KEY_FILE") or None,
        siem_export_interval_s=export_s or None,
        session_ttl=timedelta(seconds=int(ttl)),
        cookie_secure=env.get("PROOFPLANE_COOKIE_SECURE", "true").lower() != "false",
        admin_token=admin_token,
        oidc=oidc,
        change_control=_change_control(env),
        emergency_review_hours=_seconds(env, "PROOFPLANE_EMERGENCY_REVIEW_HOURS", "24", 1, 720),
        change_review_check_interval_s=_seconds(
            env, "PROOFPLANE_CHANGE_REVIEW_CHECK_SECONDS", "60", 0, 3600
        )
        or None,
        max_inflight=_max_inflight(env),
        max_inflight_client_share=_seconds(
            env, "PROOFPLANE_MAX_INFLIGHT_CLIENT_SHARE", str(MAX_INFLIGHT_CLIENT_SHARE), 0.01, 1
        ),
        max_queue=_max_queue(env),
        max_queue_wait_ms=_max_queue_wait_ms(env),
        telemetry_raw_hours=_seconds(env, "PROOFPLANE_TELEMETRY_RAW_HOURS", "48", 1, 8760),
        telemetry_interval_s=_seconds(env, "PROOFPLANE_TELEMETRY_INTERVAL_SECONDS", "60", 0, 3600)
        or None,
        alerts=alert_settings_from_env(env),
        defrag_max_moves_per_hour=defrag_max_moves_per_hour(env),
        mig_auto_layout=mig_auto_layout(env),
    )


def defrag_max_moves_per_hour(env: dict[str, str] | None = None) -> int:
    """Moves defragmentation may make in any rolling hour (issue 17 §3); 0 turns it off."""
    env = dict(os.environ if env is None else env)
    return _count(env, DEFRAG_MAX_MOVES_ENV, DEFRAG_MAX_MOVES_PER_HOUR, 0, 1_000_000)


def mig_auto_layout(env: dict[str, str] | None = None) -> str:
    """``PROOFPLANE_MIG_AUTO_LAYOUT``: one of :data:`MIG_AUTO_LAYOUT_MODES` (default ``on``;
    any case, surrounding blanks ignored)."""
    env = dict(os.environ if env is None else env)
    return _choice(env, MIG_AUTO_LAYOUT_ENV, MIG_AUTO_LAYOUT_MODES, MIG_AUTO_LAYOUT)


TOKEN_CACHE_SECONDS = 2.0  # PROOFPLANE_TOKEN_CACHE_SECONDS


def token_cache_ttl_s(env: dict[str, str] | None = None) -> float:
    """How long one process trusts a token check it made (issue 20): another worker or replica
    sees a revocation, a disabled user or a role change within this many seconds (this process
    at once). 0: every request reads the token from the database. At most 60."""
    env = dict(os.environ if env is None else env)
    return _seconds(env, "PROOFPLANE_TOKEN_CACHE_SECONDS", str(TOKEN_CACHE_SECONDS), 0, 60)


CHANGE_CONTROL = ("enforce", "off")


def _choice(env: dict[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` (any case, blanks around ignored; unset or blank: ``default``)."""
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValidationFailed(
            f"{name} must be one of {', '.join(choices)}",
            code="invalid_setting",
            details={"setting": name, "known": list(choices)},
        )
    return value


def _change_control(env: dict[str, str]) -> str:
    return _choice(env, "PROOFPLANE_CHANGE_CONTROL", CHANGE_CONTROL, "enforce")


# --- execution backends (issue 7) ---------------------------------------------------------------

BACKEND_KINDS = ("local", "slurm", "kubernetes")


@dataclass(frozen=True, slots=True)
class ExecutionSettings:
    """Which engine runs placed workloads (one per cluster) and its options.

    ``PROOFPLANE_BACKEND`` = local (default) | slurm | kubernetes, then per backend:
    local: ``PROOFPLANE_LOCAL_STATE_DIR``, ``PROOFPLANE_LOCAL_MEMORY_MB``,
    ``PROOFPLANE_LOCAL_CPUS``, ``PROOFPLANE_LOCAL_PIDS``, ``PROOFPLANE_LOCAL_SANDBOX`` (on | off),
    ``PROOFPLANE_LOCAL_JOB_USER``; slurm: ``PROOFPLANE_SLURM_CONF``,
    ``PROOFPLANE_SLURM_BIN_DIR``, ``PROOFPLANE_SLURM_PARTITION``, ``PROOFPLANE_SLURM_OUTPUT_DIR``;
    kubernetes: ``PROOFPLANE_K8S_IMAGE``, ``PROOFPLANE_K8S_NAMESPACE_PREFIX``,
    ``PROOFPLANE_K8S_PIN`` (selector | nodeName). ``PROOFPLANE_EXECUTION_SYNC_SECONDS``: how
    often the server reconciles with the engine (default 5; 0: not at all)."""

    backend: str = "local"
    local_state_dir: str | None = None  # None: <user data dir>/executor
    local_memory_mb: int | None = None
    local_cpus: float | None = None
    local_pids: int | None = None
    # issue 19, §1: jobs run in a bubblewrap sandbox as an unprivileged user; off is insecure
    local_sandbox: bool = True
    local_job_user: str = "proofplane-job"
    slurm_conf: str | None = None
    slurm_bin_dir: str | None = None
    slurm_partition: str | None = None
    slurm_output_dir: str = "/tmp"
    k8s_image: str | None = None
    k8s_namespace_prefix: str = "tenant-"
    k8s_pin: str = "selector"
    sync_interval_s: float | None = None


def _positive(env: dict[str, str], name: str, kind: type) -> Any:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValidationFailed(f"{name} must be a positive number", code="invalid_setting")
    return value


def execution_from_env(env: dict[str, str] | None = None) -> ExecutionSettings:
    """Execution settings from ``PROOFPLANE_*`` variables; a malformed one is an error."""
    env = dict(os.environ if env is None else env)
    backend = env.get("PROOFPLANE_BACKEND", "local").strip().lower() or "local"
    if backend not in BACKEND_KINDS:
        raise ValidationFailed(
            f"PROOFPLANE_BACKEND must be one of {', '.join(BACKEND_KINDS)}, not {backend!r}",
            code="invalid_setting",
        )
    pin = env.get("PROOFPLANE_K8S_PIN", "selector")
    if pin not in ("selector", "nodeName"):
        raise ValidationFailed(
            "PROOFPLANE_K8S_PIN must be selector or nodeName", code="invalid_setting"
        )
    sync_s = _seconds(env, "PROOFPLANE_EXECUTION_SYNC_SECONDS", "5", 0, 3600)
    sandbox = env.get("PROOFPLANE_LOCAL_SANDBOX", "on").strip().lower() or "on"
    if sandbox not in ("on", "off"):
        raise ValidationFailed(
            "PROOFPLANE_LOCAL_SANDBOX must be on or off (off is insecure)", code="invalid_setting"
        )
    job_user = env.get("PROOFPLANE_LOCAL_JOB_USER", "").strip() or "proofplane-job"
    if not _USER_NAME.fullmatch(job_user):
        # handed to useradd: a name starting with '-' would be read as an option
        raise ValidationFailed(
            "PROOFPLANE_LOCAL_JOB_USER must be a user name (a-z, 0-9, '_', '-'; at most 32"
            " characters, not starting with '-')",
            code="invalid_setting",
        )
    return ExecutionSettings(
        backend=backend,
        local_state_dir=env.get("PROOFPLANE_LOCAL_STATE_DIR") or None,
        local_memory_mb=_positive(env, "PROOFPLANE_LOCAL_MEMORY_MB", int),
        local_cpus=_positive(env, "PROOFPLANE_LOCAL_CPUS", float),
        local_pids=_positive(env, "PROOFPLANE_LOCAL_PIDS", int),
        local_sandbox=sandbox == "on",
        local_job_user=job_user,
        slurm_conf=env.get("PROOFPLANE_SLURM_CONF") or None,
        slurm_bin_dir=env.get("PROOFPLANE_SLURM_BIN_DIR") or None,
        slurm_partition=env.get("PROOFPLANE_SLURM_PARTITION") or None,
        slurm_output_dir=env.get("PROOFPLANE_SLURM_OUTPUT_DIR") or "/tmp",
        k8s_image=env.get("PROOFPLANE_K8S_IMAGE") or None,
        k8s_namespace_prefix=env.get("PROOFPLANE_K8S_NAMESPACE_PREFIX", "tenant-"),
        k8s_pin=pin,
        sync_interval_s=sync_s or None,
    )


# --- SIEM sinks (issue 19, §5) ------------------------------------------------------------------


#: the OCSF schema versions OCSF sinks can write (``proofplane.audit.export.ocsf.VERSIONS``)
OCSF_VERSIONS = ("1.1.0",)
OCSF_DEFAULT_VERSION = "1.1.0"


@dataclass(frozen=True, slots=True)
class SinkSettings:
    """What SIEM sinks may reach (``proofplane.audit.export.config.SinkPolicy`` is built from
    it): ``PROOFPLANE_SINK_DIR`` (where file sinks write; default ``<user data dir>/sinks``),
    ``PROOFPLANE_SINK_ALLOW_INSECURE`` (1: ``http://`` HEC/OCSF receivers allowed),
    ``PROOFPLANE_SINK_ALLOW_HOSTS`` (host names, addresses, CIDR networks a sink may reach
    although they are loopback, link-local or unspecified; the metadata address only by its
    exact address), ``PROOFPLANE_SINK_TLS_DIR`` (where sinks' CA, certificate and key files
    must live; default ``<sink dir>/tls``), ``PROOFPLANE_OCSF_VERSION`` (the OCSF schema
    version OCSF sinks write; default and only choice today ``1.1.0``)."""

    sink_dir: str
    allow_insecure: bool = False
    allow_hosts: tuple[str, ...] = ()
    tls_dir: str | None = None
    ocsf_version: str = OCSF_DEFAULT_VERSION


def default_sink_dir() -> str:
    return str(Path(platformdirs.user_data_dir("proofplane")) / "sinks")


def _allow_host(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
        return True
    except ValueError:
        labels = entry.rstrip(".").split(".")
        return 0 < len(entry) <= 253 and all(
            0 < len(label) <= 63 and label.replace("-", "").replace("_", "").isalnum()
            for label in labels
        )


def sink_settings_from_env(env: dict[str, str] | None = None) -> SinkSettings:
    """Sink settings from ``PROOFPLANE_SINK_*``; a malformed one is an error, not a default."""
    env = dict(os.environ if env is None else env)
    sink_dir = env.get("PROOFPLANE_SINK_DIR", "").strip() or default_sink_dir()
    if not os.path.isabs(sink_dir):
        raise ValidationFailed(
            "PROOFPLANE_SINK_DIR must be an absolute path", code="invalid_setting"
        )
    insecure = _flag(env, "PROOFPLANE_SINK_ALLOW_INSECURE")
    tls_dir = env.get("PROOFPLANE_SINK_TLS_DIR", "").strip() or os.path.join(sink_dir, "tls")
    if not os.path.isabs(tls_dir):
        raise ValidationFailed(
            "PROOFPLANE_SINK_TLS_DIR must be an absolute path", code="invalid_setting"
        )
    hosts = tuple(env.get("PROOFPLANE_SINK_ALLOW_HOSTS", "").replace(",", " ").split())
    bad = [h for h in hosts if not _allow_host(h)]
    if bad:
        raise ValidationFailed(
            f"PROOFPLANE_SINK_ALLOW_HOSTS: {bad[0]!r} is not a host name, address or network",
            code="invalid_setting",
        )
    ocsf_version = env.get("PROOFPLANE_OCSF_VERSION", "").strip() or OCSF_DEFAULT_VERSION
    if ocsf_version not in OCSF_VERSIONS:
        raise ValidationFailed(
            f"PROOFPLANE_OCSF_VERSION: {ocsf_version!r} is not supported; one of "
            f"{', '.join(OCSF_VERSIONS)}",
            code="invalid_setting",
        )
    return SinkSettings(
        sink_dir=os.path.normpath(sink_dir),
        allow_insecure=insecure,
        allow_hosts=hosts,
        tls_dir=os.path.normpath(tls_dir),
        ocsf_version=ocsf_version,
    )


# --- network segmentation (issue 14) ------------------------------------------------------------

VNI_LIMITS = (1, (1 << 24) - 1)  # RFC 7348: 24 bits
PKEY_LIMITS = (0x0001, 0x7FFE)  # 15 bits; 0x7FFF is the default partition, never a tenant's


@dataclass(frozen=True, slots=True)
class NetworkSettings:
    """Where tenant segments come from: ``PROOFPLANE_VNI_POOL`` (``LO-HI``, default
    10000-16000000), ``PROOFPLANE_PKEY_POOL`` (default 0x0001-0x7ffe) and
    ``PROOFPLANE_SEGMENT_COOLDOWN_DAYS`` (default 30; 0..3650): a released VNI or PKey is not
    handed out again for that long, so a late packet never reaches its next owner."""

    vni_pool: tuple[int, int] = (10_000, 16_000_000)
    pkey_pool: tuple[int, int] = PKEY_LIMITS
    cooldown: timedelta = timedelta(days=30)


def _pool(
    env: dict[str, str], name: str, default: tuple[int, int], limits: tuple[int, int]
) -> tuple[int, int]:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    lo_text, sep, hi_text = raw.partition("-")
    try:
        lo, hi = (int(t.strip(), 0) for t in (lo_text, hi_text))
    except ValueError:
        lo, hi = 1, 0
    if not sep or not limits[0] <= lo <= hi <= limits[1]:
        raise ValidationFailed(
            f"{name} must be LO-HI within {limits[0]}..{limits[1]} "
            f"(e.g. {default[0]}-{default[1]})",
            code="invalid_setting",
        )
    return (lo, hi)


def network_from_env(env: dict[str, str] | None = None) -> NetworkSettings:
    """``NetworkSettings`` from ``PROOFPLANE_*``; a malformed value is an error, not a default."""
    env = dict(os.environ if env is None else env)
    days = _seconds(env, "PROOFPLANE_SEGMENT_COOLDOWN_DAYS", "30", 0, 3650)
    return NetworkSettings(
        vni_pool=_pool(env, "PROOFPLANE_VNI_POOL", (10_000, 16_000_000), VNI_LIMITS),
        pkey_pool=_pool(env, "PROOFPLANE_PKEY_POOL", PKEY_LIMITS, PKEY_LIMITS),
        cooldown=timedelta(days=days),
    )


# --- alerts (issue 15, §8) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AlertSettings:
    """The alert worker: a pass every ``interval_s`` (``PROOFPLANE_ALERT_INTERVAL_SECONDS``,
    default 60; 0: no worker) evaluates the rules (``PROOFPLANE_ALERT_RULES``: a YAML file;
    default the shipped ``data/alert-rules.yaml``) and sends what fires to each Alertmanager in
    ``PROOFPLANE_ALERTMANAGER_URLS`` (``POST /api/v2/alerts``) and each webhook in
    ``PROOFPLANE_ALERT_WEBHOOKS`` (Alertmanager's webhook body), with the bearer token in
    ``PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE`` when set. URLs are the operator's (http or https;
    loopback allowed: an Alertmanager beside the server is the usual set-up), never with
    credentials in them. ``PROOFPLANE_EXTERNAL_URL``: this server's address as people reach it,
    for each alert's link to its event."""

    interval_s: float = 60.0
    alertmanagers: tuple[str, ...] = ()
    webhooks: tuple[str, ...] = ()
    webhook_token_file: str | None = None
    rules_file: str | None = None
    external_url: str | None = None


def _urls(env: dict[str, str], name: str) -> tuple[str, ...]:
    from urllib.parse import urlsplit

    out = []
    for url in env.get(name, "").replace(",", " ").split():
        try:
            parts = urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
            credentials = parts.username is not None or parts.password is not None
        except ValueError:
            ok, credentials = False, False
        if not ok:
            raise ValidationFailed(
                f"{name}: {url[:100]!r} is not an http(s) URL", code="invalid_setting"
            )
        if credentials:
            raise ValidationFailed(
                f"{name}: put no credentials in the URL (they would be logged); webhooks take "
                "PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE",
                code="invalid_setting",
            )
        out.append(url.rstrip("/"))
    return tuple(out)


def alert_settings_from_env(env: dict[str, str] | None = None) -> AlertSettings:
    """Alert settings from ``PROOFPLANE_ALERT*``; a malformed one is an error, not a default."""
    env = dict(os.environ if env is None else env)
    token = env.get("PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE", "").strip() or None
    rules = env.get("PROOFPLANE_ALERT_RULES", "").strip() or None
    for name, value in (
        ("PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE", token),
        ("PROOFPLANE_ALERT_RULES", rules),
    ):
        if value is not None and not os.path.isabs(value):
            raise ValidationFailed(f"{name} must be an absolute path", code="invalid_setting")
    external = _urls(env, "PROOFPLANE_EXTERNAL_URL")
    return AlertSettings(
        interval_s=_seconds(env, "PROOFPLANE_ALERT_INTERVAL_SECONDS", "60", 0, 86400),
        alertmanagers=_urls(env, "PROOFPLANE_ALERTMANAGER_URLS"),
        webhooks=_urls(env, "PROOFPLANE_ALERT_WEBHOOKS"),
        webhook_token_file=token,
        rules_file=rules,
        external_url=external[0] if external else None,
    )
