"""The local KMS's master key file, end to end through the real commands (issue 13): ``serve``
refuses to start on a master key file others can read (one line naming the file and the fix,
exit 1, no traceback, nothing listening), and the master keys ``up`` and ``serve`` make are
0600 whatever the umask."""

from __future__ import annotations

import base64
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from live_server import free_port


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    return {**env, "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "xdg-data"),
            "XDG_CONFIG_HOME": str(tmp_path / "xdg-config"), "COLUMNS": "300", **extra}  # fmt: skip


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "proofplane.cli.main", *args]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("mode", [0o644, 0o640], ids=["0644", "0640"])
def test_serve_refuses_a_master_key_others_can_read(tmp_path: Path, mode: int) -> None:
    key = tmp_path / "master.key"
    key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    key.chmod(mode)
    port = free_port()
    done = subprocess.run(
        _cli("serve", "--db", f"sqlite:///{tmp_path / 'pp.db'}", "--port", str(port)),
        env=_env(tmp_path, PROOFPLANE_MASTER_KEY_FILE=str(key)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 1, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert f"the master key file {key} can be read by other users" in out
    assert f"chmod 600 {key}" in out
    assert not _listening(port)
    assert stat.S_IMODE(key.stat().st_mode) == mode  # left as it was: the operator decides


def _start(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _cli(*args),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: os.umask(0),  # umask 0: a key that is 0600 only by the umask fails
    )


def _until_healthy(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[str]) -> str:
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def test_up_makes_a_fresh_master_key_0600(tmp_path: Path) -> None:
    port = free_port()
    proc = _start(tmp_path, "up", "--port", str(port),
                  env=_env(tmp_path, PROOFPLANE_DEMO_SWTPM="0"))  # fmt: skip
    key = tmp_path / "xdg-data" / "proofplane" / "demo.db.master.key"
    try:
        _until_healthy(proc, port)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert len(base64.b64decode(key.read_text().strip())) == 32
    finally:
        out = _stop(proc)
    assert "Traceback" not in out


def test_serve_makes_its_default_master_key_0600(tmp_path: Path) -> None:
    port = free_port()
    proc = _start(tmp_path, "serve", "--db", f"sqlite:///{tmp_path / 'pp.db'}", "--port",
                  str(port), env=_env(tmp_path))  # fmt: skip
    key = tmp_path / "xdg-data" / "proofplane" / "master.key"
    try:
        _until_healthy(proc, port)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    finally:
        _stop(proc)
