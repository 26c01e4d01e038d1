"""A real SoftHSM2 token for the pkcs11 KMS backend's tests (Debian ``softhsm2``).

One token directory per test process (pytest-xdist workers are processes), named by
``SOFTHSM2_CONF``, which is set when this module is imported, before the process loads the
PKCS#11 module. Each test gets a fresh token with a label of its own (tokens are found by
label: SoftHSM gives each one a random slot id).

SoftHSM reads its token directory when the library initialises: a token made afterwards by
``softhsm2-util`` is invisible to the running process until ``C_Finalize``/``C_Initialize``.
``new_token`` therefore initialises the library again, which closes every PKCS#11 session of
the process: the backends of earlier tests are finished by then (a fixture closes each)."""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ci import unavailable

MODULE = os.environ.get("PROOFPLANE_TEST_PKCS11_MODULE", "/usr/lib/softhsm/libsofthsm2.so")
SO_PIN = "so-secret-1234"
PIN = "user-secret-5678"

_DIR = Path(tempfile.mkdtemp(prefix="proofplane-softhsm-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
(_DIR / "tokens").mkdir(mode=0o700)
(_DIR / "softhsm2.conf").write_text(
    f"directories.tokendir = {_DIR / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n"
)
os.environ["SOFTHSM2_CONF"] = str(_DIR / "softhsm2.conf")
_COUNTER = itertools.count(1)


def require_softhsm() -> str:
    """The path of softhsm2-util (skips locally, fails in CI when SoftHSM2 is missing)."""
    util = shutil.which("softhsm2-util")
    if util is None or not Path(MODULE).is_file():
        unavailable(f"SoftHSM2 is not installed (softhsm2-util and {MODULE}: apt install softhsm2)")
    return util


def new_token(pin: str = PIN) -> str:
    """A freshly initialised token's label, visible to this process's PKCS#11 library."""
    util = require_softhsm()
    label = f"pp{os.getpid()}-{next(_COUNTER)}"
    done = subprocess.run(
        [util, "--init-token", "--free", "--label", label, "--so-pin", SO_PIN, "--pin", pin],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SOFTHSM2_CONF": str(_DIR / "softhsm2.conf")},
    )
    if done.returncode != 0:
        raise RuntimeError(f"softhsm2-util --init-token failed: {done.stderr or done.stdout}")
    import pkcs11

    pkcs11.lib(MODULE).reinitialize()  # see the module's docstring
    return label


def pin_file(directory: Path, pin: str = PIN, mode: int = 0o600) -> Path:
    path = directory / "pkcs11.pin"
    path.write_text(pin + "\n")
    path.chmod(mode)
    return path


def env_for(directory: Path, label: str, pin: str = PIN) -> dict[str, str]:
    """The settings of a backend on the token ``label`` (the PIN file written in ``directory``)."""
    return {
        "PROOFPLANE_KMS": "pkcs11",
        "PROOFPLANE_PKCS11_MODULE": MODULE,
        "PROOFPLANE_PKCS11_TOKEN_LABEL": label,
        "PROOFPLANE_PKCS11_PIN_FILE": str(pin_file(directory, pin)),
    }


def make_backend(tmp_path: Path) -> Iterator[object]:
    """A backend on a fresh token, built from its settings; closed afterwards."""
    from proofplane.kms.pkcs11 import backend_from_env

    backend = backend_from_env(env_for(tmp_path, new_token()))
    try:
        yield backend
    finally:
        backend.close()
