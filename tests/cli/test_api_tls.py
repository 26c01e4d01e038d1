"""TLS on the API, end to end on loopback with real handshakes: uvicorn serving the API with
``proofplane.pki.tls``'s policy (in a thread, and the real ``serve``/``up`` commands in a
subprocess), httpx and raw ``ssl`` clients, and the CLI's ``--ca-file``.

Every test gets its own config and data directories and no PROOFPLANE_* variables from the
environment it runs in."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from typer.testing import CliRunner

from live_server import free_port, serve
from proofplane.access import SYSTEM
from proofplane.cli import credentials as cli_credentials
from proofplane.cli import server as server_cli
from proofplane.cli.main import app
from proofplane.errors import ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.pki import tls
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

runner = CliRunner()
ADMIN_TOKEN = "ppt_tls-test-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CLUSTER = """
cluster: tls
tenants:
  - name: acme
nodes:
  - name: n1
    region: eu
    zone: eu-1a
    gpus:
      - {model: H100-80GB, count: 8}
"""


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in list(os.environ):
        if var.startswith("PROOFPLANE_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    where = tmp_path / "xdg-config" / "proofplane"
    monkeypatch.setattr(cli_credentials, "config_dir", lambda: where)
    return where


@dataclass(frozen=True)
class Pki:
    ca: Path
    ca_key: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path  # a client certificate from other_ca
    stranger_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = tls.make_ca(d, "ca")
    cert, key = tls.make_server_cert(ca, ca_key, ["127.0.0.1", "localhost", "::1"], d)
    client_cert, client_key = tls.make_client_cert(ca, ca_key, "alice", d)
    other_ca, other_key = tls.make_ca(d, "other-ca")
    stranger_cert, stranger_key = tls.make_client_cert(other_ca, other_key, "mallory", d, name="x")
    return Pki(
        ca, ca_key, cert, key, client_cert, client_key, other_ca, stranger_cert, stranger_key
    )


def _store(path: Path) -> Store:
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    load_cluster(store, SYSTEM, parse_cluster(CLUSTER))
    assert bootstrap_admin(store, ADMIN_TOKEN)
    return store


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = _store(tmp_path_factory.mktemp("tls") / "tls.db")
    with serve(store, tls=tls.ServerTls(pki.cert, pki.key)) as url:
        yield url


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = _store(tmp_path_factory.mktemp("mtls") / "mtls.db")
    with serve(store, tls=tls.ServerTls(pki.cert, pki.key, pki.ca)) as url:
        yield url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def handshake(url: str, setup: Callable[[ssl.SSLContext], None]) -> tuple[str, str, str]:
    """A raw TLS client that does not verify the server (the test is about what the server
    accepts), configured by ``setup``; one GET /healthz. (version, cipher, status line), or
    ssl.SSLError / ConnectionError."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ssl.TLSVersion.TLSv1_1
        setup(ctx)
    with (
        socket.create_connection(("127.0.0.1", _port(url)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        version, cipher = conn.version() or "", conn.cipher()[0]  # type: ignore[index]
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = conn.recv(4096)  # TLS 1.3: a refused client certificate shows here
        if not data:
            raise ConnectionError("closed without an answer")
        return version, cipher, data.split(b"\r\n", 1)[0].decode()


def no_traceback(result: Any) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# --- the certificates --------------------------------------------------------------------------


def test_issued_certificates(pki: Pki) -> None:
    for key in (pki.ca_key, pki.key, pki.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    server = x509.load_pem_x509_certificate(pki.cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert server.not_valid_after_utc - server.not_valid_before_utc <= timedelta(days=31)
    client = x509.load_pem_x509_certificate(pki.client_cert.read_bytes())
    eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_check_pair(pki: Pki, tmp_path: Path) -> None:
    tls.check_pair(pki.cert, pki.key)
    cases = {
        "does not belong to the certificate": (pki.cert, pki.client_key),
        "does not exist": (pki.cert, tmp_path / "missing.key"),
        "holds no PEM certificate": (pki.key, pki.key),
        "holds no usable PEM private key": (pki.cert, pki.cert),
        "is a directory": (tmp_path, pki.key),
    }
    key = serialization.load_pem_private_key(pki.key.read_bytes(), password=None)
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cases["is encrypted"] = (pki.cert, encrypted)
    for message, (cert, key_path) in cases.items():
        with pytest.raises(ValidationFailed) as caught:
            tls.check_pair(cert, key_path)
        assert caught.value.code == "tls_files_invalid"
        assert message in caught.value.message
        assert "PRIVATE KEY-----\n" not in caught.value.message
    with pytest.raises(ValidationFailed, match="expired on"):
        tls.check_pair(pki.cert, pki.key, now=datetime.now(UTC) + timedelta(days=60))


# --- the server's TLS policy, over real handshakes ---------------------------------------------


def test_https_with_the_ca_and_without(tls_server: str, pki: Pki) -> None:
    assert tls_server.startswith("https://127.0.0.1:")
    with httpx.Client(verify=tls.client_context(pki.ca)) as client:
        assert client.get(f"{tls_server}/healthz").status_code == 200
        nodes = client.get(f"{tls_server}/api/v1/nodes", headers=AUTH)
        assert nodes.status_code == 200 and nodes.json()["items"][0]["name"] == "n1"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_server}/healthz")  # the public CAs do not know ours
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_server}/healthz", verify=tls.client_context(pki.other_ca))
    with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
        httpx.get(tls_server.replace("https://", "http://") + "/healthz")


SERVER_REFUSALS = {
    "TLSV1_ALERT_PROTOCOL_VERSION",
    "SSLV3_ALERT_HANDSHAKE_FAILURE",
    "UNEXPECTED_EOF_WHILE_READING",
}


def _only(version: ssl.TLSVersion) -> Callable[[ssl.SSLContext], None]:
    def setup(ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = version
        ctx.maximum_version = version
        ctx.set_ciphers("ALL:@SECLEVEL=0")  # let the client offer what it has: the server says no

    return setup


def _tls12_ciphers(ciphers: str) -> Callable[[ssl.SSLContext], None]:
    def setup(ctx: ssl.SSLContext) -> None:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(f"{ciphers}:@SECLEVEL=0")

    return setup


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(_only(ssl.TLSVersion.TLSv1_1), id="tls1.1"),
        pytest.param(_only(ssl.TLSVersion.TLSv1), id="tls1.0"),
        pytest.param(_tls12_ciphers("AES128-SHA"), id="rsa-kx-aes128-sha"),
        pytest.param(_tls12_ciphers("AES128-GCM-SHA256"), id="no-forward-secrecy"),
        pytest.param(_tls12_ciphers("ECDHE-ECDSA-AES128-SHA"), id="ecdhe-cbc-sha1"),
    ],
)
def test_old_protocols_and_weak_ciphers_are_refused(
    tls_server: str, setup: Callable[[ssl.SSLContext], None]
) -> None:
    with pytest.raises(ssl.SSLError) as caught:
        handshake(tls_server, setup)
    # the server says no: an alert, or (asyncio's TLS) closing the connection mid-handshake;
    # never a client that could not offer anything (NO_PROTOCOLS_AVAILABLE, NO_CIPHER_MATCH)
    assert caught.value.reason in SERVER_REFUSALS, caught.value


@pytest.mark.parametrize(
    ("setup", "version", "cipher"),
    [
        (_only(ssl.TLSVersion.TLSv1_2), "TLSv1.2", "ECDHE-ECDSA-"),
        (_tls12_ciphers("ECDHE-ECDSA-CHACHA20-POLY1305"), "TLSv1.2", "ECDHE-ECDSA-CHACHA20"),
        (_tls12_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256"), "TLSv1.2", "ECDHE-ECDSA-AES128-GCM"),
        (_only(ssl.TLSVersion.TLSv1_3), "TLSv1.3", "TLS_"),
    ],
)
def test_tls12_and_tls13_clients_work(
    tls_server: str, setup: Callable[[ssl.SSLContext], None], version: str, cipher: str
) -> None:
    got_version, got_cipher, status = handshake(tls_server, setup)
    assert (got_version, status) == (version, "HTTP/1.1 200 OK")
    assert got_cipher.startswith(cipher)


# --- client certificates -----------------------------------------------------------------------


def _with_cert(cert: Path | None, key: Path | None, version: ssl.TLSVersion):
    def setup(ctx: ssl.SSLContext) -> None:
        ctx.maximum_version = version
        if cert is not None:
            ctx.load_cert_chain(cert, key)

    return setup


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_client_certificates_are_required(
    mtls_server: str, pki: Pki, version: ssl.TLSVersion
) -> None:
    for cert, key in ((None, None), (pki.stranger_cert, pki.stranger_key)):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            handshake(mtls_server, _with_cert(cert, key, version))
    _, _, status = handshake(mtls_server, _with_cert(pki.client_cert, pki.client_key, version))
    assert status == "HTTP/1.1 200 OK"


def test_client_certificates_with_httpx(mtls_server: str, pki: Pki) -> None:
    good = tls.client_context(pki.ca, pki.client_cert, pki.client_key)
    with httpx.Client(verify=good) as client:
        assert client.get(f"{mtls_server}/api/v1/nodes", headers=AUTH).status_code == 200
    for ctx in (
        tls.client_context(pki.ca),
        tls.client_context(pki.ca, pki.stranger_cert, pki.stranger_key),
    ):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{mtls_server}/healthz", verify=ctx)


# --- the CLI's --ca-file -----------------------------------------------------------------------


def test_cli_ca_file(tls_server: str, pki: Pki) -> None:
    base = ["--server", tls_server, "--token", ADMIN_TOKEN]
    result = runner.invoke(app, [*base, "--ca-file", str(pki.ca), "nodes", "list"])
    assert result.exit_code == 0, result.output
    assert "n1" in result.stdout
    result = runner.invoke(app, [*base, "nodes", "list"], env={"PROOFPLANE_CA_FILE": str(pki.ca)})
    assert result.exit_code == 0, result.output

    result = runner.invoke(app, [*base, "nodes", "list"])
    assert result.exit_code == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "certificate verify failed" in lines[0] and "--ca-file" in lines[0]
    no_traceback(result)
    result = runner.invoke(app, [*base, "--ca-file", str(pki.other_ca), "whoami"])
    assert result.exit_code == 3 and "certificate verify failed" in result.stderr
    no_traceback(result)


def test_cli_ca_file_applies_to_login_and_whoami(tls_server: str, pki: Pki) -> None:
    base = ["--server", tls_server, "--ca-file", str(pki.ca)]
    result = runner.invoke(app, [*base, "--token", ADMIN_TOKEN, "whoami"])
    assert result.exit_code == 0, result.output
    assert "admin" in result.stdout


def test_cli_bad_ca_file(tls_server: str, pki: Pki, tmp_path: Path) -> None:
    for path, message in ((tmp_path / "none.pem", "does not exist"), (pki.key, "no PEM")):
        result = runner.invoke(
            app, ["--server", tls_server, "--ca-file", str(path), "--token", ADMIN_TOKEN, "whoami"]
        )
        assert result.exit_code == 2
        assert result.stderr.startswith("proofplane: --ca-file: ") and message in result.stderr
        no_traceback(result)


def test_cli_https_to_a_plain_server(tmp_path: Path, pki: Pki) -> None:
    with serve(_store(tmp_path / "plain.db")) as url:
        https = url.replace("http://", "https://")
        result = runner.invoke(
            app, ["--server", https, "--ca-file", str(pki.ca), "--token", ADMIN_TOKEN, "whoami"]
        )
    assert result.exit_code == 3
    assert "does not speak TLS" in result.stderr and "http://" in result.stderr
    no_traceback(result)


# --- serve: checks before anything starts ------------------------------------------------------


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace uvicorn.run: record the call instead of serving forever."""
    calls: list[dict[str, Any]] = []

    def fake_run(app_: Any, **kwargs: Any) -> None:
        calls.append({"app": app_, **kwargs})

    monkeypatch.setattr(server_cli.uvicorn, "run", fake_run)
    return calls


def _serve_cmd(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    db = f"sqlite:///{tmp_path / 'serve.db'}"
    return runner.invoke(app, ["serve", "--db", db, "--port", str(free_port()), *args], env=env)


def test_serve_with_tls(tmp_path: Path, pki: Pki, no_serving: list[dict[str, Any]]) -> None:
    result = _serve_cmd(tmp_path, "--tls-cert", str(pki.cert), "--tls-key", str(pki.key))
    assert result.exit_code == 0, result.output
    assert "proofplane serving on https://127.0.0.1:" in result.stdout
    factory = no_serving[0]["ssl_context_factory"]
    ctx = factory(None, None)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE
    tls12 = {c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12 and all(n.startswith("ECDHE-") and ("GCM" in n or "CHACHA" in n) for n in tls12)


def test_serve_tls_from_env(tmp_path: Path, pki: Pki, no_serving: list[dict[str, Any]]) -> None:
    env = {
        "PROOFPLANE_TLS_CERT": str(pki.cert),
        "PROOFPLANE_TLS_KEY": str(pki.key),
        "PROOFPLANE_TLS_CLIENT_CA": str(pki.ca),
    }
    result = _serve_cmd(tmp_path, "--host", "0.0.0.0", env=env)
    assert result.exit_code == 0, result.output
    assert "https://127.0.0.1:" in result.stdout
    assert f"signed by {pki.ca}" in result.stdout
    assert no_serving[0]["host"] == "0.0.0.0"
    assert no_serving[0]["ssl_context_factory"](None, None).verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-key", "KEY"], "--tls-key needs --tls-cert too"),
        (["--tls-cert", "CERT"], "--tls-cert needs --tls-key too"),
        (["--tls-client-ca", "CA"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "CERT", "--tls-key", "CLIENT_KEY"], "does not belong to the certificate"),
        (["--tls-cert", "CERT", "--tls-key", "MISSING"], "does not exist"),
        (["--tls-cert", "KEY", "--tls-key", "KEY"], "holds no PEM certificate"),
        (["--tls-cert", "CERT", "--tls-key", "KEY", "--tls-client-ca", "KEY"], "client CA file"),
    ],
)
def test_serve_bad_tls_files(
    tmp_path: Path,
    pki: Pki,
    no_serving: list[dict[str, Any]],
    args: list[str],
    message: str,
) -> None:
    files = {
        "CERT": pki.cert,
        "KEY": pki.key,
        "CLIENT_KEY": pki.client_key,
        "CA": pki.ca,
        "MISSING": tmp_path / "missing.key",
    }
    result = _serve_cmd(tmp_path, *[str(files.get(a, a)) for a in args])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("proofplane: ")
    assert message in lines[0]
    key_body = pki.key.read_text().splitlines()[1]
    assert key_body not in result.output
    no_traceback(result)
    assert no_serving == []
    assert not (tmp_path / "serve.db").exists()  # checked before the store opens


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("fe80::1", False),
        ("api.example.com", False),
    ],
)
def test_exposure_check(host: str, loopback: bool) -> None:
    assert server_cli.is_loopback(host) is loopback
    server_cli.check_exposure(host, tls=True, insecure_http=False)
    server_cli.check_exposure(host, tls=False, insecure_http=True)
    if loopback:
        server_cli.check_exposure(host, tls=False, insecure_http=False)
    else:
        with pytest.raises(server_cli.CliError, match="--insecure-http"):
            server_cli.check_exposure(host, tls=False, insecure_http=False)


def test_serve_refuses_plain_http_off_loopback(
    tmp_path: Path, no_serving: list[dict[str, Any]]
) -> None:
    result = _serve_cmd(tmp_path, "--host", "0.0.0.0")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "plain HTTP on 0.0.0.0" in lines[0]
    assert "--insecure-http" in lines[0] and "--tls-cert" in lines[0]
    no_traceback(result)
    assert no_serving == []
    result = _serve_cmd(tmp_path, "--host", "0.0.0.0", "--insecure-http")
    assert result.exit_code == 0, result.output
    assert no_serving[0]["host"] == "0.0.0.0" and "ssl_context_factory" not in no_serving[0]
    assert "http://127.0.0.1:" in result.stdout


def test_up_refuses_plain_http_off_loopback(
    tmp_path: Path, no_serving: list[dict[str, Any]]
) -> None:
    result = runner.invoke(
        app,
        [
            "up",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
            "--db",
            f"sqlite:///{tmp_path}/x.db",
        ],
    )
    assert result.exit_code == 1 and "--insecure-http" in result.stderr
    no_traceback(result)
    assert no_serving == []


# --- up --tls ----------------------------------------------------------------------------------


def test_prepare_demo_tls(tmp_path: Path) -> None:
    where = tmp_path / "demo-tls"
    files, ca = server_cli.prepare_demo_tls(where, "127.0.0.1")
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert files.client_ca is None and ca.parent == where
    for key in (files.key, where / "demo-ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    tls.check_pair(files.cert, files.key)
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    first = ca.read_bytes()
    _, ca_again = server_cli.prepare_demo_tls(where, "pp.example")
    assert ca_again == ca and ca.read_bytes() != first  # a fresh throwaway CA every time
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "pp.example" in san.get_values_for_type(x509.DNSName)


def _wait_for(proc: subprocess.Popen[str], probe: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if probe():
                return
        except (httpx.HTTPError, OSError):
            pass
        assert time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.2)


def _cli_process(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "proofplane.cli.main", *args],
        env={**os.environ, "HOME": str(tmp_path), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def test_up_tls_serves_https(tmp_path: Path) -> None:
    """The real `up --tls`: a throwaway CA in the demo's data directory, HTTPS on loopback,
    the CA's path and a curl line printed, the demo token stored for the https URL."""
    port = free_port()
    db = tmp_path / "demo.db"
    proc = _cli_process(
        tmp_path,
        "up",
        "--tls",
        "--port",
        str(port),
        "--db",
        f"sqlite:///{db}",
        env={"PROOFPLANE_DEMO_SWTPM": "0", "COLUMNS": "300"},
    )
    ca = tmp_path / "xdg-data" / "proofplane" / "demo-tls" / "demo-ca.crt"
    url = f"https://127.0.0.1:{port}"
    try:
        _wait_for(
            proc,
            lambda: httpx.get(f"{url}/healthz", verify=tls.client_context(ca)).status_code == 200,
            "up --tls",
        )
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")
        assert stat.S_IMODE((ca.parent / "server.key").stat().st_mode) == 0o600
        assert stat.S_IMODE((ca.parent / "demo-ca.key").stat().st_mode) == 0o600
        cli = subprocess.run(
            [sys.executable, "-m", "proofplane.cli.main", "--server", url, "nodes", "list"],
            env={**os.environ, "HOME": str(tmp_path), "PROOFPLANE_CA_FILE": str(ca)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr  # the stored demo token, over TLS
        assert "fra-h100-01" in cli.stdout
    finally:
        out = _stop(proc)
    assert f"{url}/api/v1" in out
    assert f"curl --cacert {ca} {url}/healthz" in out
    assert f"export PROOFPLANE_CA_FILE={ca}" in out
    assert "Uvicorn running on https://" in out


def test_serve_tls_subprocess_with_client_certificates(tmp_path: Path, pki: Pki) -> None:
    """The real `serve` with PROOFPLANE_TLS_* (and a client CA): what the wiring into uvicorn
    gives on the wire."""
    port = free_port()
    db = tmp_path / "serve.db"
    _store(db).dispose()
    proc = _cli_process(
        tmp_path,
        "serve",
        "--port",
        str(port),
        "--db",
        f"sqlite:///{db}",
        env={
            "PROOFPLANE_TLS_CERT": str(pki.cert),
            "PROOFPLANE_TLS_KEY": str(pki.key),
            "PROOFPLANE_TLS_CLIENT_CA": str(pki.ca),
        },
    )
    url = f"https://127.0.0.1:{port}"
    good = tls.client_context(pki.ca, pki.client_cert, pki.client_key)
    try:
        _wait_for(
            proc, lambda: httpx.get(f"{url}/healthz", verify=good).status_code == 200, "serve"
        )
        with httpx.Client(verify=good) as client:
            assert client.get(f"{url}/api/v1/nodes", headers=AUTH).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/healthz", verify=tls.client_context(pki.ca))
        with pytest.raises(ssl.SSLError):
            handshake(url, _only(ssl.TLSVersion.TLSv1_1))
        version, _, status = handshake(
            url, _with_cert(pki.client_cert, pki.client_key, ssl.TLSVersion.TLSv1_3)
        )
        assert (version, status) == ("TLSv1.3", "HTTP/1.1 200 OK")
    finally:
        out = _stop(proc)
    assert f"proofplane serving on {url}" in out
