"""The pkcs11 KMS backend on a real SoftHSM2 token (tests/kms_pkcs11.py): key material made in
the token and never extractable, and each refusal (PIN, locked token, token label, PIN file,
module, settings) a clear proofplane error. The shared suite (test_kms_backends.py) covers
wrapping, signing and the key lifecycle."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kms_pkcs11
from ci import unavailable
from proofplane.errors import ProofplaneError
from proofplane.keys import ENCRYPT, SIGN, DecryptFailed, KmsError, KmsUnavailable, envelope
from proofplane.kms import backend_from_env
from proofplane.kms import pkcs11 as p11kms
from proofplane.kms.pkcs11 import Pkcs11Backend

try:  # python-pkcs11 is a dependency: missing, it skips here and fails in CI (tests/ci.py)
    import pkcs11
    from pkcs11 import Attribute
    from pkcs11 import exceptions as p11
except ImportError:
    unavailable("python-pkcs11 is not installed (pip install python-pkcs11)")

AAD = b"users/1/totp_secret"


@pytest.fixture
def token() -> str:
    return kms_pkcs11.new_token()


@pytest.fixture
def backend(tmp_path: Path, token: str) -> Iterator[Pkcs11Backend]:
    made = Pkcs11Backend(kms_pkcs11.MODULE, token, kms_pkcs11.PIN)
    yield made
    made.close()


def _objects(token: str, label: str) -> list[object]:
    # Another session of this process: it shares the backend's login (PKCS#11 logs in per
    # process and token), so it sees the private objects too.
    session = pkcs11.lib(kms_pkcs11.MODULE).get_token(token_label=token).open(rw=True)
    return list(session.get_objects({Attribute.LABEL: label}))


def test_key_material_is_made_in_the_token_and_never_extractable(
    backend: Pkcs11Backend, token: str
) -> None:
    kek = backend.generate(ENCRYPT, "secrets-v1")
    signer = backend.generate(SIGN, "audit-v1")
    assert kek.startswith(b"p11:proofplane:secrets-v1:") and len(kek) < 80
    (secret,) = _objects(token, "proofplane:secrets-v1")
    assert isinstance(secret, pkcs11.SecretKey) and secret.key_length == 256
    pair = _objects(token, "proofplane:audit-v1")
    (private,) = [o for o in pair if isinstance(o, pkcs11.PrivateKey)]
    assert len(pair) == 2
    for key in (secret, private):
        assert key[Attribute.TOKEN] and key[Attribute.SENSITIVE] and key[Attribute.PRIVATE]
        assert not key[Attribute.EXTRACTABLE]
        with pytest.raises(p11.AttributeSensitive):
            key[Attribute.VALUE]
    assert not secret[Attribute.WRAP]  # the KEK only encrypts data keys (AES-GCM with AAD)
    # the handle names the objects, it does not hold them: a wrap is 12 + 32 + 16 bytes
    assert len(backend.wrap(kek, os.urandom(32), AAD)) == 60
    assert len(backend.public_key(signer)) == 32


def test_keys_are_persistent_and_destroy_erases_them(tmp_path: Path, token: str) -> None:
    first = Pkcs11Backend(kms_pkcs11.MODULE, token, kms_pkcs11.PIN)
    handle, signer = first.generate(ENCRYPT, "secrets-v1"), first.generate(SIGN, "a-v1")
    dk = os.urandom(32)
    wrapped, public = first.wrap(handle, dk, AAD), first.public_key(signer)
    first.close()  # logs out: the next backend logs in again
    second = Pkcs11Backend(kms_pkcs11.MODULE, token, kms_pkcs11.PIN)
    try:
        assert second.unwrap(handle, wrapped, AAD) == dk
        assert second.public_key(signer) == public
        second.destroy(handle)
        second.destroy(handle)  # idempotent
        assert _objects(token, "proofplane:secrets-v1") == []
        with pytest.raises(KmsError) as gone:
            second.unwrap(handle, wrapped, AAD)
        assert gone.value.code == "kms_key_missing"
    finally:
        second.close()


def test_a_wrong_purpose_or_foreign_handle_does_not_unwrap(backend: Pkcs11Backend) -> None:
    signer = backend.generate(SIGN, "a-v1")
    kek = backend.generate(ENCRYPT, "k-v1")
    wrapped = backend.wrap(kek, os.urandom(32), AAD)
    for handle in (signer, b"ppl1" + b"x" * 40, b"p11:proofplane:k-v1:zz", b""):
        with pytest.raises(DecryptFailed):
            backend.unwrap(handle, wrapped, AAD)
    for bad in (b"", wrapped[:28], wrapped + b"x" * 600):
        with pytest.raises(DecryptFailed):
            backend.unwrap(kek, bad, AAD)
    with pytest.raises(ProofplaneError) as refused:
        backend.wrap(signer, os.urandom(32), AAD)
    assert refused.value.code == "key_wrong_purpose"
    with pytest.raises(ProofplaneError) as refused:
        backend.sign(kek, b"note")
    assert refused.value.code == "key_wrong_purpose"


def test_a_wrong_pin_is_refused(token: str) -> None:
    with pytest.raises(KmsError) as refused:
        Pkcs11Backend(kms_pkcs11.MODULE, token, "not-the-pin")
    assert refused.value.code == "kms_pin_incorrect"
    assert token in refused.value.message and "PROOFPLANE_PKCS11_PIN_FILE" in refused.value.message


def test_a_refused_pin_is_not_sent_again(backend: Pkcs11Backend, monkeypatch) -> None:
    sent: list[str] = []

    def wrong(token: object, pin: str) -> object:
        sent.append(pin)
        raise p11.PinIncorrect()

    handle = backend.generate(ENCRYPT, "k-v1")
    monkeypatch.setattr(p11kms, "login", wrong)
    pkcs11.lib(kms_pkcs11.MODULE).reinitialize()  # every session lost: the backend logs in again
    for _ in range(3):
        with pytest.raises(KmsError) as refused:
            backend.wrap(handle, os.urandom(32), AAD)
        assert refused.value.code == "kms_pin_incorrect"
    assert len(sent) == 1  # a real HSM locks the PIN after a few wrong tries
    with pytest.raises(KmsUnavailable):
        backend.check()


def test_a_locked_token_is_named(token: str, monkeypatch) -> None:
    # SoftHSM 2.6 never locks a user PIN (it only raises CKF_USER_PIN_COUNT_LOW, however many
    # wrong PINs are tried), so the one error a locked HSM answers C_Login with, CKR_PIN_LOCKED,
    # is raised at the binding's boundary (the login of the token's session).
    def locked(token: object, pin: str) -> object:
        raise p11.PinLocked()

    monkeypatch.setattr(p11kms, "login", locked)
    with pytest.raises(KmsError) as refused:
        Pkcs11Backend(kms_pkcs11.MODULE, token, kms_pkcs11.PIN)
    assert refused.value.code == "kms_token_locked"


def test_an_unknown_token_label_is_refused() -> None:
    kms_pkcs11.new_token()
    with pytest.raises(KmsError) as refused:
        Pkcs11Backend(kms_pkcs11.MODULE, "no-such-token", kms_pkcs11.PIN)
    assert refused.value.code == "kms_token_not_found"
    assert "no-such-token" in refused.value.message


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        (lambda p: (p.write_text(kms_pkcs11.PIN), p.chmod(0o640)), "kms_pin_file_insecure"),
        (lambda p: (p.write_text(kms_pkcs11.PIN), p.chmod(0o604)), "kms_pin_file_insecure"),
        (lambda p: (p.write_text("\n"), p.chmod(0o600)), "invalid_setting"),
        (lambda p: (p.write_text(" 1234 \n"), p.chmod(0o600)), "invalid_setting"),
        (lambda p: p.mkdir(mode=0o700), "invalid_setting"),
        (lambda p: None, "invalid_setting"),
    ],
)  # fmt: skip
def test_a_bad_pin_file_is_refused(tmp_path: Path, setup, code: str) -> None:
    path = tmp_path / "pin"
    setup(path)
    with pytest.raises(KmsError) as refused:
        p11kms.read_pin_file(path)
    assert refused.value.code == code
    assert (
        str(path) in refused.value.message and "PROOFPLANE_PKCS11_PIN_FILE" in refused.value.message
    )


def test_the_pin_file_is_its_first_line(tmp_path: Path) -> None:
    assert p11kms.read_pin_file(kms_pkcs11.pin_file(tmp_path, "1234")) == "1234"


def test_a_missing_or_unloadable_module_is_an_invalid_setting(tmp_path: Path) -> None:
    kms_pkcs11.require_softhsm()
    not_a_module = tmp_path / "libnot.so"
    not_a_module.write_text("not a shared object")
    for module in (str(tmp_path / "missing.so"), "libsofthsm2.so", str(not_a_module), ""):
        with pytest.raises(KmsError) as refused:
            Pkcs11Backend(module, "t", kms_pkcs11.PIN)
        assert refused.value.code == "invalid_setting"
        assert "PROOFPLANE_PKCS11_MODULE" in refused.value.message


def test_the_backend_is_chosen_by_setting(tmp_path: Path, token: str) -> None:
    env = kms_pkcs11.env_for(tmp_path, token)
    made = backend_from_env(env)
    try:
        assert isinstance(made, Pkcs11Backend) and made.kind == "pkcs11"
        handle = made.generate(ENCRYPT, "secrets-v1")
        dk = os.urandom(32)
        assert made.unwrap(handle, made.wrap(handle, dk, AAD), AAD) == dk
        made.check()
    finally:
        made.close()
    for name in list(env)[1:]:
        for value in ("", "  "):
            with pytest.raises(KmsError) as refused:
                backend_from_env({**env, name: value})
            assert refused.value.code == "invalid_setting" and name in refused.value.message
    with pytest.raises(KmsError) as refused:
        backend_from_env({**env, "PROOFPLANE_PKCS11_TOKEN_LABEL": "x" * 33})
    assert refused.value.code == "invalid_setting"


# python-pkcs11 leaves an object search whose C_FindObjectsInit failed (the library finalised)
# "active"; when it is collected its C_FindObjectsFinal fails too, ignored and reported.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_lost_session_is_opened_again(backend: Pkcs11Backend, token: str) -> None:
    handle = backend.generate(ENCRYPT, "k-v1")
    signer = backend.generate(SIGN, "s-v1")
    wrapped = backend.wrap(handle, b"k" * 32, AAD)
    pkcs11.lib(kms_pkcs11.MODULE).reinitialize()  # every session and object handle invalid
    assert backend.unwrap(handle, wrapped, AAD) == b"k" * 32
    pkcs11.lib(kms_pkcs11.MODULE).finalize()  # the library itself finalised under us
    assert len(backend.sign(signer, b"note")) == 64
    pkcs11.lib(kms_pkcs11.MODULE).reinitialize()
    assert backend.generate(ENCRYPT, "k-v2") != handle  # refused at the door, then made once
    assert len(_objects(token, "proofplane:k-v2")) == 1
    backend.check()


def test_an_unreachable_token_is_unavailable(backend: Pkcs11Backend, tmp_path: Path,
                                             monkeypatch) -> None:  # fmt: skip
    handle = backend.generate(ENCRYPT, "k-v1")
    lib = pkcs11.lib(kms_pkcs11.MODULE)
    monkeypatch.setenv("SOFTHSM2_CONF", str(tmp_path / "gone.conf"))  # the device is gone
    lib.finalize()
    with pytest.raises(KmsUnavailable) as down:
        backend.wrap(handle, os.urandom(32), AAD)
    assert down.value.code == "kms_unavailable"
    with pytest.raises(KmsUnavailable):
        backend.check()
    monkeypatch.undo()  # the device is back: the next call opens a session again
    backend.check()
    assert len(backend.wrap(handle, os.urandom(32), AAD)) == 60


def test_threads_share_one_session(backend: Pkcs11Backend) -> None:
    handle = backend.generate(ENCRYPT, "k-v1")
    signer = backend.generate(SIGN, "s-v1")
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(100):
                text = envelope.seal(b"x" * 1024, AAD, key="k", version=1,
                                     wrap=lambda dk, a: backend.wrap(handle, dk, a))  # fmt: skip
                opened = envelope.open_envelope(
                    envelope.parse(text.text()), AAD,
                    unwrap=lambda w, a: backend.unwrap(handle, w, a),
                )  # fmt: skip
                assert opened == b"x" * 1024
                assert len(backend.sign(signer, b"note")) == 64
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_a_token_removed_at_run_time_is_unavailable(backend: Pkcs11Backend, token: str) -> None:
    handle = backend.generate(ENCRYPT, "k-v1")
    util = kms_pkcs11.require_softhsm()
    subprocess.run([util, "--delete-token", "--token", token], check=True, capture_output=True)
    pkcs11.lib(kms_pkcs11.MODULE).reinitialize()  # the slot is empty now
    with pytest.raises(KmsUnavailable) as down:
        backend.wrap(handle, os.urandom(32), AAD)
    assert token in down.value.message
    with pytest.raises(KmsUnavailable):
        backend.check()
