"""The verifier fails closed: random or mutated evidence never raises and never passes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from ci import REPO
from proofplane.attest import REASONS, Evidence, Expected, Policy, Verdict, VerifierCache, verify
from proofplane.attest import eventlog as el
from proofplane.attest.simulate import SoftTpm

T0 = datetime(2026, 5, 1, tzinfo=UTC)
EMPTY = Policy(required_pcrs=(), require_eventlog=False, require_secure_boot=False)
SOFT = SoftTpm(ec.derive_private_key(99, ec.SECP256R1()))
NONCE = b"\x11" * 32
QUOTE, SIG, PCRS = SOFT.quote(NONCE, [0, 1, 2, 3, 4, 5, 6, 7])
GOOD = Evidence(QUOTE, SIG, PCRS)
EXPECTED = Expected(NONCE, T0, SOFT.ak_public)


def _check(v: Verdict) -> None:
    assert not v.ok and v.reasons and all(r in REASONS for r in v.reasons)


def test_the_good_evidence_passes_and_the_policy_is_hashed():
    v = verify(GOOD, EXPECTED, EMPTY, T0)
    assert v.ok and v.policy_hash == EMPTY.hash and len(v.evidence_hash) == 64
    assert verify(GOOD, EXPECTED, EMPTY, T0, cache=VerifierCache()).to_json() == v.to_json()


def test_a_shared_cache_never_lends_one_ak_to_another_quote():
    """The memo keys a parsed AK by its exact bytes: after a node re-enrolls with a new AK,
    a quote by the old one is refused, and the new AK's quotes are judged by the new key."""
    cache = VerifierCache()
    assert verify(GOOD, EXPECTED, EMPTY, T0, cache=cache).ok
    new = SoftTpm(ec.derive_private_key(7, ec.SECP256R1()))
    q, s, p = new.quote(NONCE, [0, 1, 2, 3, 4, 5, 6, 7])
    by_new = Evidence(q, s, p)
    re_enrolled = Expected(NONCE, T0, new.ak_public)
    assert verify(by_new, re_enrolled, EMPTY, T0, cache=cache).ok
    old_quote = verify(GOOD, re_enrolled, EMPTY, T0, cache=cache)
    assert not old_quote.ok and old_quote.reasons == ("quote_signature_invalid",)
    new_quote = verify(by_new, EXPECTED, EMPTY, T0, cache=cache)
    assert not new_quote.ok and new_quote.reasons == ("quote_signature_invalid",)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=120))
def test_random_quote_and_signature_never_pass(quote: bytes, sig: bytes):
    _check(verify(Evidence(quote, sig, PCRS), EXPECTED, EMPTY, T0))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["quote", "signature"]), st.data())
def test_any_bit_flip_in_quote_or_signature_is_rejected(field: str, data: st.DataObject):
    blob = bytearray(getattr(GOOD, field))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= 1 << data.draw(st.integers(0, 7))
    v = verify(replace(GOOD, **{field: bytes(blob)}), EXPECTED, EMPTY, T0)
    _check(v)
    assert v.reasons[0] in ("quote_signature_invalid", "signature_malformed")


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_random_ak_public_is_rejected(ak: bytes):
    _check(verify(GOOD, replace(EXPECTED, ak_public=ak), EMPTY, T0))


def test_rsa_and_pss_aks():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    soft = SoftTpm(key)
    q, s, p = soft.quote(NONCE, [0])
    assert verify(Evidence(q, s, p), Expected(NONCE, T0, soft.ak_public), EMPTY, T0).ok


def test_an_unexpected_error_is_a_rejection(monkeypatch: pytest.MonkeyPatch):
    import proofplane.attest.verifier as mod

    def boom(*a, **k):
        raise RuntimeError("bug in a check")

    monkeypatch.setattr(mod, "_check_inventory", boom)
    v = verify(GOOD, EXPECTED, EMPTY, T0)
    assert (
        not v.ok
        and v.reasons == ("verification_error",)
        and "bug" in v.messages["verification_error"]
    )


def test_evidence_hash_commits_to_everything():
    base = verify(GOOD, EXPECTED, EMPTY, T0).evidence_hash
    log = el.build_eventlog([(0, el.EV_S_CRTM_VERSION, b"x")])
    changed = [
        replace(GOOD, eventlog=log),
        replace(GOOD, inventory={"gpus": []}),
        replace(GOOD, pcrs={"sha256": {**PCRS["sha256"], 0: b"\1" * 32}}),
    ]
    hashes = {verify(e, EXPECTED, EMPTY, T0).evidence_hash for e in changed}
    hashes.add(verify(GOOD, replace(EXPECTED, nonce=b"\2" * 32), EMPTY, T0).evidence_hash)
    assert base not in hashes and len(hashes) == 4


def test_policy_json_round_trip_and_typos():
    from proofplane.attest import PolicyError

    p = Policy(id="x", golden_pcrs={0: frozenset({b"\0" * 32})}, allowed_vbios=frozenset({"A"}),
               min_driver="550.1")  # fmt: skip
    again = Policy.from_json(json.loads(json.dumps(p.to_json())))
    assert again.hash == p.hash
    with pytest.raises(PolicyError):
        Policy.from_json({"golden_pcr": {}})  # typo: a silently dropped rule would be worse
    with pytest.raises(PolicyError):
        Policy.from_json({"min_driver": "five"})


def test_bench_quick_runs():
    root = REPO
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "attest.py"), "--quick", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    res = json.loads(out.stdout)
    assert res["verdicts_per_s"] > 0 and res["evidence"] in ("swtpm", "software-key")
    assert res["machine"]["cores"] >= 1 and res["cached_eventlog"]["verdicts_per_s"] > 0
