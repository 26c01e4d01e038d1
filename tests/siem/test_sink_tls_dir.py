"""A sink cannot be used to learn which files exist on the server (issue 19, §5): its CA,
certificate and key files must live in the sinks' TLS directory (``PROOFPLANE_SINK_TLS_DIR``),
and a path outside it is refused before anything is looked up — the same answer for a file
that exists, one that does not, and one reached through ``..``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from proofplane import config
from proofplane.api.app import create_app
from proofplane.audit.export.config import SinkPolicy, validate
from proofplane.errors import ValidationFailed
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate

ADMIN_TOKEN = "ppt_sink-tls-dir-admin-0123456789abcdef"


def syslog(ca: str, cert: str, key: str) -> dict[str, Any]:
    return {"url": "tls://siem.example.com:6514", "ca_file": ca, "cert_file": cert, "key_file": key}


@pytest.fixture
def tls_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tls"
    path.mkdir()
    for name in ("ca.pem", "client.pem", "client.key"):
        (path / name).write_text("x")
    return path


@pytest.fixture
def api(tmp_path: Path, tls_dir: Path) -> Iterator[TestClient]:
    store = Store(f"sqlite:///{tmp_path / 'pp.db'}")
    migrate.upgrade(store.engine)
    store.sink_policy = SinkPolicy(sink_dir=str(tmp_path / "sinks"), tls_dir=str(tls_dir))
    bootstrap_admin(store, ADMIN_TOKEN)
    with TestClient(
        create_app(store),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as c:
        yield c
    store.dispose()


def test_files_in_the_tls_directory_are_accepted(api: TestClient, tls_dir: Path) -> None:
    cfg = syslog(str(tls_dir / "ca.pem"), str(tls_dir / "client.pem"), str(tls_dir / "client.key"))
    r = api.post("/api/v1/sinks", json={"name": "s", "type": "syslog", "config": cfg})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    "probe",
    ["/etc/passwd", "/etc/no-such-file", "{tls}/../../../etc/passwd", "{tls}/../pp.db", "ca.pem"],
)
def test_a_path_outside_the_tls_directory_gets_one_answer_whether_it_exists_or_not(
    api: TestClient, tls_dir: Path, probe: str
) -> None:
    path = probe.format(tls=tls_dir)
    cfg = syslog(path, str(tls_dir / "client.pem"), str(tls_dir / "client.key"))
    r = api.post("/api/v1/sinks", json={"name": "s", "type": "syslog", "config": cfg})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "tls_file_outside_dir"
    assert error["details"] == {"field": "ca_file"}
    assert "PROOFPLANE_SINK_TLS_DIR" in error["message"]
    assert api.get("/api/v1/sinks/s").status_code == 404  # nothing stored


def test_a_missing_file_inside_the_directory_is_still_named(tls_dir: Path) -> None:
    policy = SinkPolicy(tls_dir=str(tls_dir))
    cfg = syslog(
        str(tls_dir / "gone.pem"), str(tls_dir / "client.pem"), str(tls_dir / "client.key")
    )
    with pytest.raises(ValidationFailed) as exc:
        validate("syslog", cfg, policy=policy, is_file=os.path.isfile)  # as the service asks
    assert exc.value.code == "tls_file_missing"


def test_the_key_path_outside_is_refused_without_echoing_it(tls_dir: Path) -> None:
    policy = SinkPolicy(tls_dir=str(tls_dir))
    cfg = syslog(str(tls_dir / "ca.pem"), str(tls_dir / "client.pem"), "/root/.ssh/id_ed25519")
    with pytest.raises(ValidationFailed) as exc:
        validate("syslog", cfg, policy=policy)
    assert exc.value.code == "tls_file_outside_dir"
    assert "id_ed25519" not in exc.value.message and "id_ed25519" not in str(exc.value.details)


def test_the_setting_defaults_below_the_sink_directory_and_must_be_absolute() -> None:
    got = config.sink_settings_from_env({"PROOFPLANE_SINK_DIR": "/srv/pp/sinks"})
    assert got.tls_dir == "/srv/pp/sinks/tls"
    env = {"PROOFPLANE_SINK_DIR": "/srv/pp/sinks", "PROOFPLANE_SINK_TLS_DIR": "/etc/pp/tls/"}
    assert config.sink_settings_from_env(env).tls_dir == "/etc/pp/tls"
    with pytest.raises(ValidationFailed, match="PROOFPLANE_SINK_TLS_DIR must be an absolute"):
        config.sink_settings_from_env({**env, "PROOFPLANE_SINK_TLS_DIR": "tls"})


def test_the_pure_validation_looks_nothing_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # rule 2: the core takes values; whether a file exists is asked by the edge (is_file)
    def no_io(_path: str) -> bool:
        raise AssertionError("the pure sink validation touched the file system")

    monkeypatch.setattr("os.path.isfile", no_io)
    monkeypatch.setattr("os.path.exists", no_io)
    files = syslog("/tls/ca.pem", "/tls/c.pem", "/tls/k.pem")
    out = validate("syslog", files, policy=SinkPolicy(tls_dir="/tls"))
    assert out["key_file"] == "/tls/k.pem"
    with pytest.raises(ValidationFailed) as raised:
        validate("syslog", files, policy=SinkPolicy(tls_dir="/tls"), is_file=lambda _p: False)
    assert raised.value.code == "tls_file_missing"


def test_the_insecure_flag_reads_like_every_other_flag() -> None:
    base = {"PROOFPLANE_SINK_DIR": "/srv/pp/sinks"}
    for raw, want in (("on", True), ("yes", True), ("1", True), ("off", False), ("", False)):
        env = {**base, "PROOFPLANE_SINK_ALLOW_INSECURE": raw}
        assert config.sink_settings_from_env(env).allow_insecure is want
    with pytest.raises(ValidationFailed) as raised:
        config.sink_settings_from_env({**base, "PROOFPLANE_SINK_ALLOW_INSECURE": "maybe"})
    assert raised.value.code == "invalid_setting"
