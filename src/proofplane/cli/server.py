"""Server-side commands: ``serve``, ``up`` (with the demo cluster) and ``db upgrade|current``.

These work on the database directly (through the store and service layer), not through the API.
Store errors become one message on stderr and exit status 1.

``serve`` and ``up`` read their settings from ``PROOFPLANE_*`` (``proofplane.config``). With
``PROOFPLANE_ADMIN_TOKEN`` set, a control plane without users gets an ``admin`` user holding
that token; ``up`` always has one (a fresh random token unless the variable is set), shows it,
and stores it in the CLI's credentials file so that the demo's commands work as they are.

TLS: ``serve --tls-cert/--tls-key`` (``PROOFPLANE_TLS_CERT``/``_KEY``) serves HTTPS with the
policy of ``proofplane.pki.tls`` (TLS 1.2+, ECDHE+AEAD suites), checked before anything starts;
``--tls-client-ca`` requires client certificates from that CA. ``serve`` refuses to listen on
an address other than loopback in plain HTTP unless ``--insecure-http`` says so. ``up --tls``
makes a throwaway CA and server certificate for loopback in the demo's data directory.

Both hand placed workloads to the execution engine (``PROOFPLANE_BACKEND``, the local executor
by default). ``up`` reconciles with it every second and keeps the local executor's state next to
its database; when it stops, it stops the demo's processes.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import platformdirs
import typer
import uvicorn
from alembic.util import CommandError
from rich.console import Group
from rich.panel import Panel
from rich.text import Text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from proofplane import config
from proofplane.access import SYSTEM
from proofplane.access.credentials import new_token
from proofplane.agent.tpm import swtpm
from proofplane.api.app import create_app
from proofplane.api.routes_attest import EK_CA_BUNDLE_ENV
from proofplane.api.tls_scope import ClientCertProtocol
from proofplane.audit.export.config import SinkPolicy
from proofplane.backends.base import BackendUnavailable
from proofplane.cli import credentials, render
from proofplane.cli.client import DEFAULT_SERVER, CliError, format_details
from proofplane.cli.demo_agents import HttpAgents
from proofplane.cli.worker_app import (
    SERVE_URL_ENV,
    NoDelayClientCertProtocol,
    NoDelayHttpToolsProtocol,
    TlsContextFactory,
)
from proofplane.demo import swtpm as demo_swtpm
from proofplane.demo.attester import DemoAttester, load_attested_demo
from proofplane.demo.governance import GovernanceSeed, seed_governance
from proofplane.demo.telemetry import DemoTelemetry
from proofplane.errors import Conflict, InvalidState, ProofplaneError, ValidationFailed
from proofplane.hardware.cluster_file import ClusterSpec, parse_cluster
from proofplane.model import WorkloadStatus
from proofplane.pki import tls as pki_tls
from proofplane.service import execution as execution_svc
from proofplane.service import instruments
from proofplane.service import keys as keys_svc
from proofplane.service import sinks as sinks_svc
from proofplane.service.access import MAX_TOKEN_TTL, bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.workloads import cancel_workload, list_workloads
from proofplane.store import migrate
from proofplane.store.db import check_private, default_database_url

DB_ENV = "PROOFPLANE_DATABASE_URL"
DEFAULT_PORT = 8470
DEMO_SYNC_SECONDS = 1.0  # `up`: how often the demo reconciles with its engine

db_app = typer.Typer(help="Database schema migrations.", no_args_is_help=True)

HostOpt = typer.Option("127.0.0.1", "--host", help="Interface to listen on.")
PortOpt = typer.Option(DEFAULT_PORT, "--port", "-p", min=1, max=65535, help="TCP port.")
TlsCertOpt = typer.Option(
    None,
    "--tls-cert",
    envvar="PROOFPLANE_TLS_CERT",
    help="Serve HTTPS with this PEM certificate (chain); needs --tls-key.",
    show_default=False,
)
TlsKeyOpt = typer.Option(
    None,
    "--tls-key",
    envvar="PROOFPLANE_TLS_KEY",
    help="The PEM private key of --tls-cert (unencrypted; keep it 0600).",
    show_default=False,
)
TlsClientCaOpt = typer.Option(
    None,
    "--tls-client-ca",
    envvar="PROOFPLANE_TLS_CLIENT_CA",
    help="Require client certificates signed by this PEM CA (mutual TLS).",
    show_default=False,
)
TlsClientOptionalOpt = typer.Option(
    False,
    "--tls-client-optional",
    envvar="PROOFPLANE_TLS_CLIENT_OPTIONAL",
    help="With --tls-client-ca: check a client certificate when one is shown, but let clients "
    "without one in (node agents with their channel certificates, people with tokens).",
)
WorkersOpt = typer.Option(
    None,
    "--workers",
    envvar="PROOFPLANE_SERVE_WORKERS",
    min=1,
    max=64,
    help="API worker processes (default: one per CPU core). Background work runs in one of "
    "them (a leader lease on the database); the others serve requests.",
    show_default=False,
)
AccessLogOpt = typer.Option(
    False,
    "--access-log/--no-access-log",
    envvar="PROOFPLANE_ACCESS_LOG",
    help="Print one line per HTTP request (uvicorn's access log). Off by default: every "
    "decision is already in the audit log, and the line costs each request CPU.",
)
InsecureHttpOpt = typer.Option(
    False,
    "--insecure-http",
    help="Allow plain HTTP on an address other than loopback (tokens travel in clear).",
)
DbOpt = typer.Option(
    None,
    "--db",
    envvar=DB_ENV,
    help="Database URL: sqlite:///PATH or postgresql://… (default: a SQLite file in the user "
    "data directory).",
    show_default=False,
)


# --- helpers -----------------------------------------------------------------------------------


def demo_database_path() -> Path:
    """Where ``up`` keeps its throwaway demo database."""
    return Path(platformdirs.user_data_dir("proofplane")) / "demo.db"


def shown_url(url: str) -> str:
    """A database URL fit to print: the password hidden, a SQLite URL as its file path."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    if parsed.get_backend_name() == "sqlite" and parsed.database:
        return parsed.database
    return parsed.render_as_string(hide_password=True)


@contextmanager
def store_errors(what: str = "") -> Iterator[None]:
    """Turn store and database failures into a one-message CliError (exit 1)."""
    prefix = f"proofplane: {what}: " if what else "proofplane: "
    try:
        yield
    except ProofplaneError as exc:
        raise CliError(prefix + exc.message, lines=format_details(exc.details)) from exc
    except DBAPIError as exc:
        lines = [line.strip() for line in str(exc.orig).splitlines() if line.strip()]
        first = lines[0] if lines else type(exc.orig).__name__
        raise CliError(
            f"{prefix}database error: {first}", lines=[f"  {line}" for line in lines[1:4]]
        ) from exc
    except CommandError as exc:  # alembic: e.g. the database is at a revision this code lacks
        raise CliError(f"{prefix}migration failed: {exc}") from exc


def open_store(url: str) -> Store:
    """A store on ``url`` with its schema migrated to the head revision; a SQLite file other
    users can read is refused (with the chmod to run)."""
    with store_errors():
        check_private(url)
        store = Store(url)
        try:
            migrate.upgrade(store.engine)
        except BaseException:
            store.dispose()
            raise
    return store


def check_port(host: str, port: int) -> None:
    """Fail early (before a demo database is wiped) when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CliError(
                    f"proofplane: port {port} on {host} is already in use "
                    "(is proofplane already running?); pick another with --port"
                ) from exc
            raise CliError(f"proofplane: cannot listen on {host}:{port}: {exc.strerror}") from exc


def base_url(host: str, port: int, tls: bool = False) -> str:
    """The URL clients on this machine use to reach a server listening on host:port."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, an IPv4-mapped one) or
    ``localhost``: what only this machine can reach."""
    text = host.strip().strip("[]").lower()
    if text in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_exposure(host: str, tls: bool, insecure_http: bool) -> None:
    """Refuse plain HTTP on an address other machines can reach (bearer tokens, passwords and
    session cookies would cross the network in clear) unless ``--insecure-http`` says so."""
    if tls or insecure_http or is_loopback(host):
        return
    raise CliError(
        f"proofplane: refusing to serve plain HTTP on {host or '(every address)'}: tokens and "
        "passwords would cross the network in clear; give --tls-cert and --tls-key (or "
        "PROOFPLANE_TLS_CERT/PROOFPLANE_TLS_KEY), listen on 127.0.0.1, or pass --insecure-http "
        "(e.g. behind a TLS-terminating proxy)"
    )


def server_tls(
    cert: str | None, key: str | None, client_ca: str | None
) -> pki_tls.ServerTls | None:
    """The checked TLS files of ``serve`` (None: plain HTTP). Half a pair, an unreadable file,
    a key of another certificate or an expired one is one error line (exit 1)."""
    cert, key, client_ca = cert or None, key or None, client_ca or None
    if cert is None and key is None:
        if client_ca is not None:
            raise CliError("proofplane: --tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise CliError(f"proofplane: {given} needs {missing} too (give both, or neither)")
    try:
        return pki_tls.check_server_files(cert, key, client_ca)
    except ValidationFailed as exc:
        raise CliError(f"proofplane: {exc.message}") from exc


def demo_tls_dir() -> Path:
    """Where ``up --tls`` keeps its throwaway CA and server certificate."""
    return Path(platformdirs.user_data_dir("proofplane")) / "demo-tls"


DEMO_TLS_HOSTS = ["127.0.0.1", "localhost", "::1"]


def prepare_demo_tls(directory: Path, host: str) -> tuple[pki_tls.ServerTls, Path]:
    """A fresh throwaway CA and a server certificate for loopback (and ``host`` when it is a
    name or a specific address) in ``directory`` (0700; keys 0600): (server files, CA path)."""
    hosts = list(DEMO_TLS_HOSTS)
    if host not in ("", "0.0.0.0", "::") and host not in hosts:
        hosts.append(host)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        directory.chmod(0o700)
        ca_cert, ca_key = pki_tls.make_ca(directory, "demo-ca")
        cert, key = pki_tls.make_server_cert(ca_cert, ca_key, hosts, directory, name="server")
    except OSError as exc:
        raise CliError(
            f"proofplane: cannot write the demo TLS files in {directory}: {exc}"
        ) from exc
    except ValidationFailed as exc:
        raise CliError(f"proofplane: cannot make the demo TLS files: {exc.message}") from exc
    return pki_tls.ServerTls(cert, key), ca_cert


def uvicorn_tls(tls: pki_tls.ServerTls | None) -> dict[str, object]:
    """uvicorn.run's arguments for ``tls``: the context of ``proofplane.pki.tls`` (TLS 1.2+,
    its cipher list, client certificates when required). A uvicorn without
    ``ssl_context_factory`` gets the same policy as files, cipher string and CERT_REQUIRED
    (Python's own minimum is already TLS 1.2)."""
    if tls is None:
        return {}
    if "ssl_context_factory" in inspect.signature(uvicorn.Config).parameters:
        return {"ssl_context_factory": TlsContextFactory(tls)}
    return {  # pragma: no cover - older uvicorn
        "ssl_certfile": str(tls.cert),
        "ssl_keyfile": str(tls.key),
        "ssl_ciphers": pki_tls.TLS12_CIPHERS,
        **(
            {"ssl_ca_certs": str(tls.client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
            if tls.client_ca is not None
            else {}
        ),
    }


def read_cluster(path: Path | None) -> tuple[ClusterSpec, str]:
    """Parse the given cluster file, or the shipped demo cluster; (spec, where it came from)."""
    if path is None:
        source = "the demo cluster"
        text = (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text("utf-8")
    else:
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise CliError(f"proofplane: cluster file {source} does not exist") from exc
        except IsADirectoryError as exc:
            raise CliError(f"proofplane: cluster file {source} is a directory") from exc
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CliError(f"proofplane: cannot read cluster file {source}: {why}") from exc
    try:
        return parse_cluster(text), source
    except ValidationFailed as exc:
        why = "" if exc.message == "invalid cluster file" else f" {exc.message}"
        raise CliError(
            f"proofplane: invalid cluster file {source}:{why}", lines=format_details(exc.details)
        ) from exc


def _fresh_demo_database() -> str:
    path = demo_database_path()
    try:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    except OSError as exc:
        raise CliError(f"proofplane: cannot remove the old demo database {path}: {exc}") from exc
    return f"sqlite:///{path}"


def local_jobs_dir(url: str) -> Path | None:
    """Where the local executor keeps its jobs for a SQLite database: next to the file
    (``demo.db`` -> ``demo.db.jobs``), so each database has its own. None for other databases
    (the executor's default, in the user data directory)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    if parsed.database == ":memory:" or parsed.database.startswith("file:"):
        return None
    return Path(f"{parsed.database}.jobs")


def load_execution(url: str, *, demo: bool = False) -> config.ExecutionSettings:
    """The execution settings from ``PROOFPLANE_*`` for a server on ``url``: the local
    executor's state next to a SQLite database unless PROOFPLANE_LOCAL_STATE_DIR says where;
    ``demo`` (``up``): reconciled every second unless PROOFPLANE_EXECUTION_SYNC_SECONDS says."""
    try:
        settings = config.execution_from_env()
    except ValidationFailed as exc:
        raise CliError(f"proofplane: invalid configuration: {exc.message}") from exc
    if settings.backend == "local" and settings.local_state_dir is None:
        jobs = local_jobs_dir(url)
        if jobs is not None:
            settings = dataclasses.replace(settings, local_state_dir=str(jobs))
    if demo and settings.sync_interval_s is None:
        settings = dataclasses.replace(settings, sync_interval_s=DEMO_SYNC_SECONDS)
    return settings


def _clear_jobs_dir(path: Path) -> None:
    """Stop what a previous demo left running in its executor directory, then remove it (its
    database is gone, so nothing else knows these jobs)."""
    from proofplane.backends.local import LocalExecutor

    if not path.exists():
        return
    old = LocalExecutor(path, kill_grace_s=1.0)
    execution_svc.stop_jobs(old, old.adopt())
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise CliError(f"proofplane: cannot remove the old demo jobs in {path}: {exc}") from exc


def load_settings() -> config.Settings:
    """The server settings from ``PROOFPLANE_*``; a malformed one is one error line (exit 1)."""
    try:
        return config.from_env()
    except ValidationFailed as exc:
        raise CliError(f"proofplane: invalid configuration: {exc.message}") from exc


def load_sink_policy() -> SinkPolicy:
    """What SIEM sinks may reach, from ``PROOFPLANE_SINK_*``; a malformed one is one error line
    (exit 1)."""
    try:
        return sinks_svc.policy_from(config.sink_settings_from_env())
    except ValidationFailed as exc:
        raise CliError(f"proofplane: invalid configuration: {exc.message}") from exc


def bootstrap(store: Store, token: str) -> bool:
    """Install the admin token on a control plane without users; whether it did."""
    try:
        with store_errors("cannot install PROOFPLANE_ADMIN_TOKEN"):
            return bootstrap_admin(store, token)
    except CliError:
        store.dispose()
        raise


def _save_demo_token(url: str, token: str) -> str | None:
    """Store the demo admin token for ``url`` in the CLI's credentials file; the file's path,
    or None (with a warning) when it cannot be written."""
    expires = (datetime.now(UTC) + MAX_TOKEN_TTL).isoformat()
    try:
        path = credentials.store(url, token=token, username="admin", expires_at=expires, kind="api")
    except CliError as exc:
        render.print_line(f"{exc.message} (use PROOFPLANE_TOKEN instead)", style="yellow")
        return None
    return str(path)


def _welcome(
    url: str,
    db: str,
    counts: dict[str, int],
    cluster: str,
    token: str | None,
    saved_in: str | None,
    engine: str = "",
    ca_file: str | None = None,
    governance: GovernanceSeed | None = None,
) -> Panel:
    env = [] if url == DEFAULT_SERVER else [f"export PROOFPLANE_SERVER={url}"]
    cacert = ""
    if ca_file is not None:
        env.append(f"export PROOFPLANE_CA_FILE={ca_file}")
        cacert = f"--cacert {ca_file} "
    commands = [
        *env,
        *([f"curl {cacert}{url}/healthz"] if ca_file is not None else []),
        "proofplane whoami",
        "proofplane users create <you> --role auditor   # then sign in to the console",
        "proofplane nodes list",
        "proofplane workloads list",
        "proofplane workloads show radiology-triage",
        "proofplane workloads logs radiology-triage",
        "proofplane network segments",
        "proofplane network render fra-h100-01 --format nftables",
        f'curl -s {cacert}-H "Authorization: Bearer $PROOFPLANE_TOKEN" {url}/api/v1/nodes',
        'proofplane nodes state fra-h100-01 failed --reason "PSU fault"',
        "proofplane events list --newest --action 'workload.*'",
        # chargeback from the log (issue 15): today so far, priced with the shipped rate card
        f"proofplane usage report --from {datetime.now(UTC).date().isoformat()} "
        f"--to {(datetime.now(UTC) + timedelta(days=1)).date().isoformat()}",
    ]
    if governance is not None:  # change control (issue 12): two other people approve
        cid = governance.change_id
        commands += [
            f"proofplane changes show {cid}",
            f"proofplane changes approve {cid}   # refused: separation_of_duties (you asked)",
            f"PROOFPLANE_TOKEN={governance.second_admin_token} proofplane changes approve {cid}",
            f"PROOFPLANE_TOKEN={governance.security_officer_token} "
            f"proofplane changes approve {cid}",
            f"proofplane changes apply {cid}",
        ]
    facts = Text()
    for key, value in (
        ("API", f"{url}/api/v1"),
        ("console", f"{url}/"),
        ("docs", f"{url}/docs"),
        ("database", db),
        (
            "loaded",
            f"{counts['tenants']} tenants, {counts['nodes']} nodes, "
            f"{counts['workloads']} workloads from {cluster}",
        ),
        *([("engine", engine)] if engine else []),
        *([("TLS CA", ca_file)] if ca_file is not None else []),
    ):
        facts.append(f"{key:<10}", style="bold cyan")
        facts.append(f"{value}\n")
    access = Text()
    if token is None:
        access.append(
            "The database already had users, so no demo admin token was installed: log in "
            "with 'proofplane login'.\n",
            style="yellow",
        )
    else:
        access.append("demo admin token  ", style="bold cyan")
        access.append(f"{token}\n")
        if saved_in is not None:
            access.append(
                f"Saved in {saved_in} for {url}, so the proofplane commands below use it as "
                "they are. For curl or another machine:\n"
            )
        else:
            access.append("Set it for the commands below (and curl):\n")
        access.append(f"  export PROOFPLANE_TOKEN={token}\n", style="green")
        if governance is not None:
            access.append("second admin token  ", style="bold cyan")
            access.append(f"{governance.second_admin_token}\n")
            access.append("security officer token  ", style="bold cyan")
            access.append(f"{governance.security_officer_token}\n")
            access.append(
                f"Change control is on: change {governance.change_id} (certify fra-h100-04 "
                "hipaa=true) waits for two approvals by people other than you.\n"
            )
    tries = Text("Try:\n", style="bold")
    for cmd in commands:
        tries.append(f"  {cmd}\n", style="green")
    tries.append("\nCtrl-C stops the server and the demo's processes.", style="dim")
    return Panel(
        Group(facts, access, tries),
        title="proofplane is up",
        title_align="left",
        border_style="cyan",
        expand=False,
    )


def _engine_line(store: Store) -> str:
    """The welcome panel's line about the engine running the demo's workloads."""
    backend = store.backend
    if backend is None:
        return ""
    described = backend.describe()
    where = described.get("state_dir")
    live = len(execution_svc.live_job_ids(store, backend))
    line = f"{backend.name}: {live} workload(s) dispatched"
    return line + (f", processes' state and output in {where}" if where else "")


def _sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm() -> object:
    """Make SIGTERM end the process through Python's exit path. uvicorn shuts down on it and
    then raises the signal again; with the default handler that would kill the process before
    ``_serve`` stops the demo's processes. Returns the previous handler (None: not the main
    thread, nothing changed)."""
    try:
        return signal.signal(signal.SIGTERM, _sigterm)
    except ValueError:
        return None


def _serve(
    store: Store,
    host: str,
    port: int,
    settings: config.Settings,
    execution: config.ExecutionSettings,
    *,
    stop_jobs: bool = False,
    attester: DemoAttester | None = None,
    tls: pki_tls.ServerTls | None = None,
    workers: int = 1,
    telemetry: DemoTelemetry | None = None,
    access_log: bool = False,
) -> None:
    """Serve until stopped; ``stop_jobs`` (``up``): then cancel the engine jobs still live;
    ``attester`` (``up``): the demo's simulated agents keep attesting while it serves;
    ``tls``: serve HTTPS on these files; ``workers`` > 1: that many worker processes, each
    building its application from the environment (``cli/worker_app.py``); ``access_log``:
    uvicorn prints a line per request."""
    previous = _exit_on_sigterm()
    try:
        if attester is not None:
            attester.start()
        if telemetry is not None:  # the demo's simulated GPU telemetry (issue 15)
            telemetry.start()
        # With TLS, uvicorn's h11 protocol plus the client certificate in each request's
        # scope (api/tls_scope.py): a node agent's channel certificate is its identity.
        protocol = {"http": ClientCertProtocol} if tls is not None else {}
        if workers > 1:
            protocol = {
                "http": NoDelayClientCertProtocol if tls is not None else NoDelayHttpToolsProtocol
            }
            os.environ[SERVE_URL_ENV] = store.url
            store.dispose()  # the worker processes open their own connections
            # /metrics sums every worker's counters (prometheus_client's multiprocess mode,
            # service/instruments.py): the workers inherit PROMETHEUS_MULTIPROC_DIR
            metrics_dir, made = instruments.prepare_multiprocess()
            try:
                uvicorn.run(
                    "proofplane.cli.worker_app:app_from_env",
                    factory=True,
                    workers=workers,
                    # a worker imports and builds the whole application before it answers the
                    # supervisor's health check: seconds on a busy two-core machine
                    timeout_worker_healthcheck=60,
                    host=host,
                    port=port,
                    access_log=access_log,
                    **uvicorn_tls(tls),
                    **protocol,  # type: ignore[arg-type]
                )
            finally:
                instruments.forget_multiprocess(metrics_dir, made)
            return
        with store_errors("cannot start the server"):  # e.g. a KMS setting that is wrong
            application = create_app(store, settings, execution, settle_heap=True)
        uvicorn.run(
            application,
            host=host,
            port=port,
            access_log=access_log,
            **uvicorn_tls(tls),
            **protocol,  # type: ignore[arg-type]
        )
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
        if attester is not None:
            attester.stop()
        if telemetry is not None:
            telemetry.stop()
        try:
            if stop_jobs and store.backend is not None:
                with store_errors("cannot stop the demo's processes"):
                    stopped = stop_demo_workloads(store)
                if stopped:
                    render.print_line(f"stopped {len(stopped)} demo workload process(es)")
                    render.print_line(
                        "each is recorded cancelled (workload.cancel: proofplane up stopped)"
                    )
        finally:
            store.dispose()


UP_STOPPED = "proofplane up stopped: the demo's processes stop with it"


class _StoppingBackend:
    """The engine while ``up`` stops: cancels go through; a new job is refused as the engine
    being unavailable (capacity a cancel frees must not start processes nobody will stop)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.name = backend.name

    def submit(self, job: Any) -> str:
        raise BackendUnavailable("the engine is stopping with proofplane up")

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._backend, attr)


def stop_demo_workloads(store: Store) -> list[str]:
    """``up``'s shutdown: cancel every placed or running workload through the cancel use case
    (its engine job stopped, ``workload.engine_cancel`` and ``workload.cancel`` recorded in
    one transaction each), then stop whatever the engine still runs for this database.
    Returns the names of the workloads cancelled."""
    backend = store.backend
    assert backend is not None
    live: list[tuple[str, str]] = []
    for status in (WorkloadStatus.PLACED, WorkloadStatus.RUNNING):
        cursor = None
        while True:
            page = list_workloads(store, SYSTEM, status=status, limit=500, cursor=cursor)
            live.extend((w.name, w.tenant) for w in page.items if w.command)  # engine work
            cursor = page.next
            if cursor is None:
                break
    cancelled = []
    store.backend = _StoppingBackend(backend)  # type: ignore[assignment]
    try:
        for name, tenant in live:
            try:
                cancel_workload(store, SYSTEM, name, UP_STOPPED, tenant=tenant)
            except InvalidState:  # it ended meanwhile: its end is its record
                continue
            cancelled.append(name)
    finally:
        store.backend = backend
    execution_svc.stop_jobs(backend, execution_svc.live_job_ids(store, backend))
    return cancelled


# --- commands ----------------------------------------------------------------------------------


def serve(
    host: str = HostOpt,
    port: int = PortOpt,
    db: str | None = DbOpt,
    tls_cert: str | None = TlsCertOpt,
    tls_key: str | None = TlsKeyOpt,
    tls_client_ca: str | None = TlsClientCaOpt,
    tls_client_optional: bool = TlsClientOptionalOpt,
    insecure_http: bool = InsecureHttpOpt,
    workers: int | None = WorkersOpt,
    access_log: bool = AccessLogOpt,
) -> None:
    """Run the control plane API on an existing database (migrated on start).

    Settings come from PROOFPLANE_* variables; with PROOFPLANE_ADMIN_TOKEN set, a database
    without users gets an `admin` user holding that token (90 days). With --tls-cert and
    --tls-key it serves HTTPS (TLS 1.2+); on an address other than loopback it refuses plain
    HTTP unless --insecure-http is given."""
    settings = load_settings()
    sink_policy = load_sink_policy()
    tls = server_tls(tls_cert, tls_key, tls_client_ca)
    if tls_client_optional:
        if tls is None or tls.client_ca is None:
            raise CliError("proofplane: --tls-client-optional needs --tls-client-ca")
        tls = dataclasses.replace(tls, client_optional=True)
    check_exposure(host, tls is not None, insecure_http)
    url = db or default_database_url()
    execution = load_execution(url)
    check_port(host, port)
    store = open_store(url)
    store.sink_policy = sink_policy
    with store_errors("cannot start the server"):
        keys_svc.kms_for(store)  # the KMS (PROOFPLANE_KMS) answers before anything is served
    installed = settings.admin_token is not None and bootstrap(store, settings.admin_token)
    shown = base_url(host, port, tls is not None)
    render.print_line(
        f"proofplane serving on {shown} (docs {shown}/docs, database {shown_url(url)})"
    )
    if tls is not None and tls.client_ca is not None:
        must = "may" if tls.client_optional else "must"
        render.print_line(f"clients {must} present a certificate signed by {tls.client_ca}")
    if installed:
        render.print_line("created user admin with the PROOFPLANE_ADMIN_TOKEN token (90 days)")
    processes = workers or os.cpu_count() or 1
    if processes > 1:
        render.print_line(
            f"{processes} worker processes; background work runs in the one holding the lease"
        )
    _serve(
        store, host, port, settings, execution, tls=tls, workers=processes, access_log=access_log
    )


def _swtpm_nodes(spec: ClusterSpec) -> tuple[demo_swtpm.SwtpmFleet | None, str]:
    """The demo's swtpm nodes, started (None when swtpm cannot run here), and the line that
    says which nodes attest how."""
    simulated = "every demo node uses the simulated attester"
    if os.environ.get("PROOFPLANE_DEMO_SWTPM", "1") == "0":
        return None, f"PROOFPLANE_DEMO_SWTPM=0: {simulated}"
    if os.environ.get(EK_CA_BUNDLE_ENV):
        # the swtpm EK certificates come from a throwaway CA that bundle would refuse
        return None, f"{EK_CA_BUNDLE_ENV} is set (the swtpm EKs are not from it): {simulated}"
    missing = demo_swtpm.missing_tools()
    if missing:
        return None, f"swtpm/tpm2-tools not installed ({', '.join(missing)} missing): {simulated}"
    names = demo_swtpm.pick_nodes(spec)
    if not names:
        return None, f"no demo node to attest with swtpm: {simulated}"
    try:
        fleet = demo_swtpm.SwtpmFleet.start([ns.node for ns in spec.nodes if ns.node.name in names])
    except (swtpm.TpmToolError, OSError, subprocess.SubprocessError) as exc:
        return None, f"swtpm did not start ({exc}): {simulated}"
    return fleet, (
        f"attesting with swtpm (node agent, real TPM 2.0 quotes, boot log "
        f"{Path(fleet.log_source).name}): {', '.join(fleet.nodes)}; the other nodes use the "
        "simulated attester"
    )


def up(
    host: str = HostOpt,
    port: int = PortOpt,
    db: str | None = typer.Option(
        None,
        "--db",
        help="Load into this (empty) database instead of a fresh demo SQLite file.",
        show_default=False,
    ),
    cluster: Path | None = typer.Option(
        None,
        "--cluster",
        help="A cluster file to load instead of the shipped demo cluster.",
        show_default=False,
    ),
    tls: bool = typer.Option(
        False,
        "--tls",
        help="Serve HTTPS with a throwaway CA and loopback certificate made in the demo's data "
        "directory (the CA's path is printed: pass it as --ca-file / curl --cacert).",
    ),
    insecure_http: bool = InsecureHttpOpt,
    access_log: bool = AccessLogOpt,
) -> None:
    """Start the control plane with a demo cluster, on a fresh database, with a demo admin
    token (PROOFPLANE_ADMIN_TOKEN, or a fresh random one) stored for the CLI.

    A demo on loopback: plain HTTP, so browser session cookies are not marked Secure, and the
    Swagger UI at /docs is served (its scripts come from a CDN: never in production). The demo
    runs in demo-attester mode (PROOFPLANE_DEMO_ATTESTER=simulated): its nodes are admitted by
    simulated TPM attesters through the real verifier, and one of them drifts. With swtpm and
    tpm2-tools installed, two nodes are attested instead by the node agent against their own
    software TPM (swtpm), stopped when the demo stops. With --tls it serves HTTPS on a
    throwaway CA's certificate (and its cookies are Secure)."""
    env_settings = load_settings()
    token = env_settings.admin_token or new_token()
    check_exposure(host, tls, insecure_http)
    settings = dataclasses.replace(
        env_settings,
        admin_token=token,
        cookie_secure=tls,
        demo_attester="simulated",
        api_docs=True,
    )
    sink_policy = load_sink_policy()
    spec, source = read_cluster(cluster)
    check_port(host, port)
    server_files, ca_file = prepare_demo_tls(demo_tls_dir(), host) if tls else (None, None)
    execution = load_execution(db or f"sqlite:///{demo_database_path()}", demo=True)
    url = db if db is not None else _fresh_demo_database()
    if db is None and "PROOFPLANE_MASTER_KEY_FILE" not in os.environ:
        # the demo's embedded KMS gets a fresh master key beside its fresh database
        key_file = Path(f"{demo_database_path()}.master.key")
        key_file.unlink(missing_ok=True)
        os.environ["PROOFPLANE_MASTER_KEY_FILE"] = str(key_file)
    if db is None and execution.backend == "local" and execution.local_state_dir:
        jobs_dir = Path(execution.local_state_dir)
        if jobs_dir == local_jobs_dir(url):  # ours, not one PROOFPLANE_LOCAL_STATE_DIR named
            _clear_jobs_dir(jobs_dir)
    store = open_store(url)
    store.sink_policy = sink_policy
    real: HttpAgents | None = None  # the swtpm nodes' agents (stopping them stops the TPMs)
    try:
        if settings.demo_attester == "simulated":
            fleet, attesting = _swtpm_nodes(spec)  # their TPMs run until the demo stops
            real = None if fleet is None else HttpAgents(fleet)
            render.print_line(attesting)
        with store_errors(f"cannot load {source}"):
            # The demo's placed workloads start as the cluster loads (and stop if it fails).
            store.backend = execution_svc.build_backend(execution)
            attester: DemoAttester | None = None
            if settings.demo_attester == "simulated":
                counts, attester = load_attested_demo(store, spec, real=real)
            else:
                counts = load_cluster(store, SYSTEM, spec)
    except BaseException as exc:
        if real is not None:
            real.stop()
        if not isinstance(exc, CliError):
            raise
        store.dispose()
        if db is not None and isinstance(exc.__cause__, Conflict):
            exc.lines.append(
                f"  `up` loads a cluster into an empty database and {shown_url(url)} is not; use "
                "a fresh --db, or `proofplane serve --db URL` to serve it as it is"
            )
        raise
    url_base = base_url(host, port, tls)
    telemetry = None
    try:
        telemetry = _demo_telemetry(store, attester is not None)
        installed = bootstrap(store, token)
        saved_in = _save_demo_token(url_base, token) if installed else None
        seeded = seed_governance(store) if installed else None
        render.console().print(
            _welcome(
                url_base,
                shown_url(url),
                counts,
                source,
                token if installed else None,
                saved_in,
                _engine_line(store),
                None if ca_file is None else str(ca_file),
                seeded,
            )
        )
    except BaseException:
        if attester is not None:
            attester.stop()
        if telemetry is not None:
            telemetry.stop()
        assert store.backend is not None
        execution_svc.stop_jobs(store.backend, execution_svc.live_job_ids(store, store.backend))
        store.dispose()
        raise
    _serve(
        store,
        host,
        port,
        settings,
        execution,
        stop_jobs=True,
        attester=attester,
        tls=server_files,
        telemetry=telemetry,
        access_log=access_log,
    )


def _demo_telemetry(store: Store, demo: bool) -> DemoTelemetry | None:
    """The demo's SIMULATED GPU telemetry (issue 15): ``PROOFPLANE_DEMO_TELEMETRY_DAYS``
    (default 14, 0..60) days of simulated hourly history and a few minutes of raw readings,
    written by its first pass (on its own thread, as the server starts), then a reading of
    every GPU every 15 s while the demo serves (PROOFPLANE_DEMO_TELEMETRY=0: none). Every row
    is marked simulated."""
    if not demo or os.environ.get("PROOFPLANE_DEMO_TELEMETRY", "1") == "0":
        return None
    raw_days = os.environ.get("PROOFPLANE_DEMO_TELEMETRY_DAYS", "14").strip()
    if not raw_days.isdigit() or int(raw_days) > 60:
        raise CliError("proofplane: PROOFPLANE_DEMO_TELEMETRY_DAYS must be 0..60")
    render.print_line(
        f"simulated GPU telemetry (marked simulated): {raw_days} days of history written in the "
        "background, then every GPU every 15 s (one idle workload, one off-hours spike, one "
        "XID error)"
    )
    return DemoTelemetry(store, backfill_days=int(raw_days))


@db_app.command("upgrade")
def db_upgrade(db: str | None = DbOpt) -> None:
    """Migrate the database schema to the latest revision."""
    url = db or default_database_url()
    store = open_store(url)
    try:
        with store_errors():
            revision = migrate.current_revision(store.engine)
    finally:
        store.dispose()
    render.print_line(f"database {shown_url(url)} is at revision {revision} (head)")


@db_app.command("current")
def db_current(db: str | None = DbOpt) -> None:
    """Show the database's schema revision and the code's head revision."""
    url = db or default_database_url()
    with store_errors():
        store = Store(url)
        try:
            current = migrate.current_revision(store.engine)
        finally:
            store.dispose()
    head = migrate.head_revision()
    render.print_line(f"database: {shown_url(url)}")
    render.print_line(f"current:  {current or '(none: not migrated)'}")
    render.print_line(f"head:     {head}")
    if current != head:
        render.print_line("run `proofplane db upgrade` to migrate", style="yellow")
    else:
        render.print_line("up to date", style="green")
