"""The SIEM tests deliver to receivers on loopback (rsyslog over mutual TLS, HEC and OCSF HTTP
servers on 127.0.0.1) and write file sinks into the test's directory: they reach them the way a
deployment would, through the sink settings (issue 19, §5), which proves the allow-list works.
Plain ``http://`` receivers need PROOFPLANE_SINK_ALLOW_INSECURE; loopback needs
PROOFPLANE_SINK_ALLOW_HOSTS. test_sink_hardening.py checks what happens without them."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _sink_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROOFPLANE_SINK_DIR", str(tmp_path))
    monkeypatch.setenv("PROOFPLANE_SINK_TLS_DIR", "/")  # certificates live in tests' tmp dirs
    monkeypatch.setenv("PROOFPLANE_SINK_ALLOW_INSECURE", "1")
    monkeypatch.setenv("PROOFPLANE_SINK_ALLOW_HOSTS", "127.0.0.1")
