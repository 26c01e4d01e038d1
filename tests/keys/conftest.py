"""The KMS backends every test in tests/keys runs against: ``local`` (the embedded keyring),
``pkcs11`` (a real SoftHSM2 token, tests/kms_pkcs11.py) and ``openbao`` (a real OpenBao dev
server, tests/kms_openbao.py). Each helper module exposes ``make_backend(tmp_path)``; a backend
whose program is missing skips locally and fails in CI."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ci import unavailable
from proofplane.kms import Backend
from proofplane.kms.local import LocalBackend

KINDS = ["local", "pkcs11", "openbao"]


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    kind = request.param
    if kind == "local":
        yield LocalBackend.from_file(tmp_path / "master.key", create=True)
        return
    try:
        module = importlib.import_module(f"kms_{kind}")
    except ModuleNotFoundError:
        unavailable(f"no test harness for the {kind} KMS backend (tests/kms_{kind}.py)")
    made = module.make_backend(tmp_path)
    if hasattr(made, "__next__"):  # a generator: it starts and stops its server
        yield next(made)
        next(made, None)
    else:
        yield made
