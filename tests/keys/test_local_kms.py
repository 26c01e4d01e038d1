"""The embedded backend's master key file: created 0600, refused when others can read it,
malformed or the wrong one, each a clear error."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from proofplane.keys import ENCRYPT, KmsError
from proofplane.kms import backend_from_env
from proofplane.kms.local import LocalBackend, read_master_key


def test_the_master_key_is_created_0600_once(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "master.key"
    key = read_master_key(path, create=True)
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_master_key(path, create=True) == key  # never overwritten


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        (lambda p: (p.write_text(base64.b64encode(os.urandom(32)).decode()), p.chmod(0o644)),
         "master_key_insecure"),
        (lambda p: (p.write_text("not base64!"), p.chmod(0o600)), "master_key_invalid"),
        (lambda p: (p.write_text(base64.b64encode(b"short").decode()), p.chmod(0o600)),
         "master_key_invalid"),
        (lambda p: p.mkdir(), "master_key_invalid"),
        (lambda p: None, "master_key_missing"),
    ],
)  # fmt: skip
def test_a_bad_master_key_file_is_refused(tmp_path: Path, setup, code: str) -> None:
    path = tmp_path / "master.key"
    setup(path)
    with pytest.raises(KmsError) as refused:
        read_master_key(path)
    assert refused.value.code == code
    assert str(path) in refused.value.message


def test_another_master_key_does_not_open_the_keyring(tmp_path: Path) -> None:
    a = LocalBackend.from_file(tmp_path / "a.key", create=True)
    b = LocalBackend.from_file(tmp_path / "b.key", create=True)
    handle = a.generate(ENCRYPT, "secrets-v1")
    with pytest.raises(KmsError) as refused:
        b.wrap(handle, os.urandom(32), b"x")
    assert refused.value.code == "master_key_mismatch"


def test_the_backend_is_chosen_by_setting(tmp_path: Path) -> None:
    env = {"PROOFPLANE_MASTER_KEY_FILE": str(tmp_path / "m.key")}
    assert backend_from_env(env).kind == "local"
    with pytest.raises(KmsError) as bad:
        backend_from_env({**env, "PROOFPLANE_KMS": "aws"})
    assert bad.value.code == "invalid_setting"
