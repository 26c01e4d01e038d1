"""The error tree (proofplane/errors.py) and its one HTTP status table (api/errors.py).

Every error proofplane raises on purpose is a ProofplaneError with a stable snake_case code;
the status an API answer carries is decided at the edge, along the class's MRO, and is what it
was before the table moved there.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import proofplane
from proofplane.api import errors as api_errors
from proofplane.api.errors import NOT_ANSWERS, status_for
from proofplane.errors import ProofplaneError


def _import_everything() -> None:
    for mod in pkgutil.walk_packages(proofplane.__path__, "proofplane."):
        # alembic's env runs only under alembic; __main__ runs the CLI
        if mod.name.startswith("proofplane.store.migrations") or mod.name.endswith("__main__"):
            continue
        importlib.import_module(mod.name)


def _subclasses(cls: type[ProofplaneError]) -> set[type[ProofplaneError]]:
    out: set[type[ProofplaneError]] = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _subclasses(sub)
    return out


_import_everything()
TREE = sorted(
    (c for c in _subclasses(ProofplaneError) if c.__module__.startswith("proofplane.")),
    key=lambda c: (c.__module__, c.__qualname__),
)
SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")


def _cls(name: str) -> type[ProofplaneError]:
    found = [c for c in (ProofplaneError, *TREE) if c.__name__ == name]
    assert len(found) == 1, (name, found)
    return found[0]


def test_the_tree_is_found() -> None:
    # the attestation, audit, trace, SIEM, NVML and TPM-tool errors all joined it
    names = {c.__name__ for c in TREE}
    assert {
        "AttestError",
        "EventLogError",
        "PolicyError",
        "CredentialError",
        "NoteError",
        "BundleError",
        "TraceError",
        "MigSimError",
        "NvmlError",
        "NvmlUnavailable",
        "TpmToolError",
        "DeliveryError",
        "ProofRangeError",
        "Unverifiable",
        "BackendError",
        "AccountLocked",
    } <= names


def test_no_exception_of_the_package_is_outside_the_tree() -> None:
    def walk(cls: type[BaseException]) -> set[type[BaseException]]:
        out: set[type[BaseException]] = set()
        for sub in cls.__subclasses__():
            out |= {sub, *walk(sub)}
        return out

    outside = {
        f"{c.__module__}.{c.__qualname__}"
        for c in walk(BaseException)
        if c.__module__.startswith("proofplane.") and not issubclass(c, ProofplaneError)
    }
    # the CLI's own errors are the edge's business: they carry an exit code, not a status
    assert {n for n in outside if not n.startswith("proofplane.cli.")} == set()


@pytest.mark.parametrize("cls", TREE, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_error_has_a_snake_case_code_and_an_http_status(cls: type[ProofplaneError]) -> None:
    assert isinstance(cls.code, str) and SNAKE.fullmatch(cls.code), cls.code
    assert 400 <= status_for(cls) <= 599
    # the status is the edge's business (api/errors.py), not the error's
    assert not hasattr(cls, "status")


# (class, code, status): what the API answered before the table moved to api/errors.py
KNOWN = [
    ("ProofplaneError", "bad_request", 400),
    ("NotFound", "not_found", 404),
    ("Conflict", "conflict", 409),
    ("InvalidState", "invalid_state", 409),
    ("ValidationFailed", "validation_failed", 422),
    ("Unavailable", "unavailable", 503),
    ("Unauthenticated", "unauthenticated", 401),
    ("Forbidden", "forbidden", 403),
    ("AccountLocked", "account_locked", 423),
    ("OidcFailed", "oidc_failed", 401),
    ("UnknownSigningKey", "oidc_failed", 401),
    ("OidcUnavailable", "oidc_provider_unavailable", 502),
    ("OidcMisconfigured", "invalid_setting", 500),
    ("InvalidOidcState", "invalid_oidc_state", 400),
    ("OidcProviderError", "oidc_error", 400),
    ("ProofOutOfRange", "proof_out_of_range", 400),
    ("LogCorrupted", "audit_log_inconsistent", 500),
    ("DeliveryFailed", "delivery_failed", 502),
    ("BackendError", "backend_error", 502),
    ("BackendUnavailable", "backend_unavailable", 503),
    ("JobRejected", "job_rejected", 422),
    ("DrainFailed", "drain_failed", 502),
]


@pytest.mark.parametrize(("name", "code", "status"), KNOWN)
def test_known_codes_and_statuses_are_unchanged(name: str, code: str, status: int) -> None:
    cls = _cls(name)
    assert cls.code == code
    assert status_for(cls) == status


def test_the_attestation_reasons_are_the_codes() -> None:
    from proofplane.attest import errors as ae
    from proofplane.attest.credential import CredentialError
    from proofplane.attest.policy import PolicyError

    assert [c.code for c in (ae.AttestError, ae.ParseError, ae.EventLogError)] == [
        "attest_error",
        "malformed",
        "eventlog_malformed",
    ]
    assert ae.TpmStructError.code == "tpm_struct_malformed"
    assert ae.CertificateError.code == "ek_cert_invalid"
    assert CredentialError.code == "credential_error"
    assert PolicyError.code == "policy_invalid"
    err = ae.EventLogError("event 3: PCR 99", reason="eventlog_bad_pcr")
    assert (err.reason, err.code, err.message, str(err)) == (
        "eventlog_bad_pcr",
        "eventlog_bad_pcr",
        "event 3: PCR 99",
        "event 3: PCR 99",
    )
    assert ae.ParseError("x").reason == "malformed"  # the class's, when none is given


def test_errors_that_were_value_or_runtime_errors_still_are() -> None:
    # callers (and their tests) catch these as ValueError / RuntimeError
    for name in ("NoteError", "BundleError", "TraceError", "MigSimError", "ProofRangeError"):
        assert issubclass(_cls(name), ValueError), name
    assert issubclass(_cls("TpmToolError"), RuntimeError)


@pytest.mark.parametrize("name", ["AttestError", "EventLogError", "Unverifiable", "NoteError"])
def test_errors_survive_pickling(name: str) -> None:
    # the parallel audit verification hands errors back from worker processes
    cls = _cls(name)
    err = cls("what went wrong", code="some_reason")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.message, back.code, str(back)) == ("what went wrong", "some_reason", str(err))


def test_the_not_answers_are_branches_of_the_tree() -> None:
    assert all(issubclass(c, ProofplaneError) for c in NOT_ANSWERS)
    assert not any(issubclass(c, NOT_ANSWERS) for c in api_errors.STATUS)
    assert all(status_for(c) == 500 for c in NOT_ANSWERS)


def _app(exc: Exception) -> TestClient:
    app = FastAPI()
    api_errors.install(app)

    @app.get("/boom")
    def boom() -> None:
        raise exc

    return TestClient(app, raise_server_exceptions=False)


def test_an_answer_keeps_its_status_and_body() -> None:
    from proofplane.backends.base import JobRejected

    r = _app(JobRejected("no such partition", details={"partition": "gpu"})).get("/boom")
    assert r.status_code == 422
    assert r.json() == {
        "error": {
            "code": "job_rejected",
            "message": "no such partition",
            "details": {"partition": "gpu"},
        }
    }
    r = _app(_cls("NotFound")("node 'x' not found", code="node_not_found")).get("/boom")
    assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found"


def test_a_401_says_how_to_authenticate() -> None:
    r = _app(_cls("Unauthenticated")("no token")).get("/boom")
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == 'Bearer realm="proofplane"'
    r = _app(_cls("Forbidden")("not yours")).get("/boom")
    assert r.status_code == 403 and "WWW-Authenticate" not in r.headers


@pytest.mark.parametrize("name", ["NoteError", "EventLogError", "TpmToolError", "DeliveryError"])
def test_an_error_that_is_not_an_answer_is_an_internal_error(name: str) -> None:
    # as before these errors joined the tree: a bug, answered 500 without the core's message
    r = _app(_cls(name)("a secret detail of the core")).get("/boom")
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "code": "internal_error",
            "message": "internal error; the server log has the details",
            "details": None,
        }
    }
    # and it still reaches the server (its log, a test client that raises)
    app = _app(_cls(name)("x")).app
    with pytest.raises(_cls(name)):
        TestClient(app).get("/boom")
