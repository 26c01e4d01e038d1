"""Quote verification: evidence + what the server expects + policy + now → Verdict. Fail closed.

Order matters. Nothing inside TPMS_ATTEST is believed before the signature over its exact bytes
verifies with the AK bound at enrollment (never a key the node sends along). A restricted AK
only signs data the TPM produced itself, which is what makes the TPM_GENERATED magic mean
something. After that the checks collect every failure they can see, skipping only the checks
whose input a failure made untrustworthy (PCR policy needs PCR values that match the quoted
digest; event policy needs a log whose replay matches the quoted PCRs).

Any exception anywhere turns into the reason ``verification_error``: an error is never a pass.

The values judged and returned (:class:`Evidence`, :class:`Expected`, :class:`Verdict`) and
their JSON codecs live in :mod:`proofplane.attest.evidence`; they are re-exported here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from proofplane.attest import tpm
from proofplane.attest.errors import AttestError
from proofplane.attest.evidence import Evidence, Expected, Verdict, evidence_hash
from proofplane.attest.facts import LogFacts, VerifierCache, analyze_eventlog
from proofplane.attest.policy import Policy, parse_version

__all__ = [
    "AK_REQUIRED_ATTRIBUTES",
    "REASONS",
    "Evidence",
    "Expected",
    "Verdict",
    "check_ak",
    "evidence_hash",
    "verify",
    "verify_signature",
]

AK_REQUIRED_ATTRIBUTES = (
    tpm.FIXED_TPM | tpm.FIXED_PARENT | tpm.SENSITIVE_DATA_ORIGIN | tpm.RESTRICTED | tpm.SIGN_ENCRYPT
)
_AK_SCHEMES = (tpm.TPM_ALG_RSASSA, tpm.TPM_ALG_RSAPSS, tpm.TPM_ALG_ECDSA)

#: Every reason code a verdict can carry, with what it means for a human.
REASONS: dict[str, str] = {
    "evidence_malformed": "the evidence is missing a field or a field is not what it claims to be",
    "ak_public_malformed": "the bound AK public key cannot be parsed",
    "ak_attributes_invalid": "the AK is not a restricted, fixedTPM, fixedParent signing key "
    "generated in the TPM",
    "signature_malformed": "the quote signature cannot be parsed",
    "quote_signature_invalid": "the quote is not signed by the bound AK",
    "quote_malformed": "the signed quote is not a TPM-generated TPMS_ATTEST quote",
    "qualified_signer_mismatch": "the quote names another signer than the bound AK under the EK",
    "nonce_mismatch": "the quote does not carry the nonce the server issued",
    "quote_stale": "the nonce was issued too long ago (or in the future)",
    "clock_rollback": "the TPM clock went backwards since the last accepted quote",
    "reset_count_rollback": "the TPM reset/restart counters went backwards",
    "pcr_selection_incomplete": "the quote does not cover the PCRs the policy requires",
    "pcr_values_incomplete": "the evidence does not give a value for every quoted PCR",
    "pcr_digest_mismatch": "the PCR values do not hash to the quoted PCR digest",
    "pcr_policy_violation": "a PCR value is not one of the policy's golden values",
    "eventlog_missing": "the policy needs an event log and none was sent",
    "eventlog_malformed": "the event log cannot be parsed",
    "eventlog_replay_mismatch": "replaying the event log does not give the quoted PCR values",
    "eventlog_event_digest_mismatch": "an event's data does not hash to its measured digest",
    "secure_boot_disabled": "Secure Boot is not enabled (or not measured)",
    "boot_app_not_allowed": "a boot application (bootloader, EFI kernel) is not on the allow-list",
    "kernel_not_allowed": "a kernel measured by the bootloader is not on the allow-list",
    "inventory_missing": "the policy needs a GPU inventory and none was sent",
    "inventory_malformed": "the GPU inventory is not NVML-shaped",
    "vbios_not_allowed": "a GPU runs a VBIOS that is not on the allow-list",
    "driver_too_old": "the GPU driver is older than the policy's minimum",
    "verification_error": "verification failed with an unexpected error (fail closed)",
}


@dataclass(slots=True)
class _Run:
    reasons: list[str] = field(default_factory=list)
    messages: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def fail(self, reason: str, message: str) -> None:
        if reason not in self.messages:
            self.reasons.append(reason)
            self.messages[reason] = message
        else:
            self.messages[reason] += f"; {message}"


def _load_ak(blob: bytes) -> tuple[Any, ...]:
    """(Public, key) of an AK that is fit to attest, or (None, reason, message)."""
    try:
        ak = tpm.parse_public(blob)
        key = ak.public_key()
    except AttestError as exc:
        return None, "ak_public_malformed", exc.message
    problem = check_ak(ak)
    if problem:
        return None, "ak_attributes_invalid", problem
    return ak, key


def verify_signature(
    key: tpm.Public | rsa.RSAPublicKey | ec.EllipticCurvePublicKey,
    message: bytes,
    sig: tpm.Signature,
) -> bool:
    """Whether ``sig`` over ``message`` verifies with the key; the scheme must fit the key."""
    if isinstance(key, tpm.Public):
        key = key.public_key()
    h = tpm.crypto_hash(sig.hash_alg)
    try:
        if isinstance(key, rsa.RSAPublicKey):
            if sig.sig_alg == tpm.TPM_ALG_RSASSA:
                key.verify(sig.sig, message, padding.PKCS1v15(), h)
            elif sig.sig_alg == tpm.TPM_ALG_RSAPSS:
                key.verify(sig.sig, message, padding.PSS(padding.MGF1(h), padding.PSS.AUTO), h)
            else:
                return False
        elif isinstance(key, ec.EllipticCurvePublicKey):
            if sig.sig_alg != tpm.TPM_ALG_ECDSA:
                return False
            key.verify(encode_dss_signature(sig.r, sig.s), message, ec.ECDSA(h))
        else:  # pragma: no cover - parse_public only makes RSA and ECC keys
            return False
    except InvalidSignature:
        return False
    return True


def check_ak(ak: tpm.Public) -> str | None:
    """None when the AK's attributes make it an attestation key; else what is wrong."""
    attrs = ak.object_attributes
    if (
        attrs & AK_REQUIRED_ATTRIBUTES == AK_REQUIRED_ATTRIBUTES
        and not attrs & tpm.DECRYPT
        and ak.scheme in _AK_SCHEMES
    ):
        return None
    missing = [
        name
        for bit, name in tpm.OBJECT_ATTRIBUTE_NAMES.items()
        if bit & AK_REQUIRED_ATTRIBUTES and not ak.object_attributes & bit
    ]
    problems = []
    if missing:
        problems.append("missing " + ", ".join(missing))
    if ak.object_attributes & tpm.DECRYPT:
        problems.append("has decrypt")
    if ak.scheme not in _AK_SCHEMES:
        problems.append(f"signing scheme 0x{ak.scheme:04x} is not RSASSA, RSAPSS or ECDSA")
    return "; ".join(problems) or None


def _pcr_order(selection: tuple[tpm.PcrSelection, ...]) -> list[tuple[str, int]]:
    return [(bank, i) for sel in selection for bank in (sel.bank,) for i in sel.pcrs]


def verify(
    evidence: Evidence,
    expected: Expected,
    policy: Policy,
    now: datetime,
    *,
    cache: VerifierCache | None = None,
) -> Verdict:
    """Judge one attestation round. Never raises; never passes on an error.

    ``cache`` (optional, owned by the caller) memoizes event-log facts by the log's SHA-256;
    the verdict is the same with or without it.
    """
    log_sha256 = None
    try:
        if evidence.eventlog is not None:
            log_sha256 = hashlib.sha256(evidence.eventlog).hexdigest()
        ehash = evidence_hash(evidence, expected, log_sha256)
    except Exception as exc:
        ehash = ""
        err: Exception | None = exc
    else:
        err = None
    run = _Run()
    clock: tpm.ClockInfo | None = None
    if err is not None:
        run.fail("evidence_malformed", f"cannot hash the evidence: {err}")
    else:
        try:
            clock = _verify(evidence, expected, policy, now, run, cache, log_sha256)
        except AttestError as exc:
            run.fail(exc.reason if exc.reason in REASONS else "verification_error", exc.message)
        except Exception as exc:
            run.fail("verification_error", f"{type(exc).__name__}: {exc}")
    if not run.reasons and clock is None:  # defence in depth: no verified quote, no pass
        run.fail("verification_error", "no verified quote")
    return Verdict(
        ok=not run.reasons,
        reasons=tuple(run.reasons),
        messages=run.messages,
        details=run.details,
        evidence_hash=ehash,
        policy_id=policy.id,
        policy_hash=policy.hash,
        clock=clock,
    )


def _verify(
    evidence: Evidence,
    expected: Expected,
    policy: Policy,
    now: datetime,
    run: _Run,
    cache: VerifierCache | None,
    log_sha256: str | None,
) -> tpm.ClockInfo | None:
    # 1. The bound AK and the signature: nothing else is trusted before this passes.
    loaded = (
        _load_ak(expected.ak_public) if cache is None else cache.ak(expected.ak_public, _load_ak)
    )
    if loaded[0] is None:
        run.fail(loaded[1], loaded[2])
        return None
    ak, key = loaded[0], loaded[1]
    try:
        sig = tpm.parse_signature(evidence.signature)
    except AttestError as exc:
        run.fail("signature_malformed", exc.message)
        return None
    if (sig.sig_alg, sig.hash_alg) != (ak.scheme, ak.scheme_hash):
        # a restricted AK signs only with its own scheme; anything else is not this AK's quote
        run.fail(
            "quote_signature_invalid",
            f"signature scheme 0x{sig.sig_alg:04x}/0x{sig.hash_alg:04x} is not the AK's "
            f"0x{ak.scheme:04x}/0x{ak.scheme_hash:04x}",
        )
        return None
    if not verify_signature(key, evidence.quote, sig):
        run.fail("quote_signature_invalid", "the quote signature does not verify with the bound AK")
        return None
    try:
        att = tpm.parse_attest(evidence.quote)
    except AttestError as exc:
        run.fail("quote_malformed", exc.message)
        return None
    run.details["clock"] = att.clock_info.to_json()
    run.details["firmware_version"] = f"0x{att.firmware_version:016x}"

    # 2. The quote's own fields.
    if expected.ek_public is not None:
        try:
            want = tpm.ak_qualified_name(tpm.parse_public(expected.ek_public), ak)
        except AttestError as exc:
            raise AttestError(
                f"expected.ek_public: {exc.message}", reason="evidence_malformed"
            ) from None
        if att.qualified_signer != want:
            run.fail(
                "qualified_signer_mismatch",
                f"qualifiedSigner {att.qualified_signer.hex()} is not {want.hex()}",
            )
    if att.extra_data != expected.nonce:
        run.fail("nonce_mismatch", "the quote's extraData is not the issued nonce")
    age = (now - expected.nonce_issued_at).total_seconds()
    run.details["quote_age_s"] = round(age, 3)
    if age > policy.max_quote_age_s:
        run.fail(
            "quote_stale",
            f"nonce issued {age:.1f} s ago, policy allows {policy.max_quote_age_s:g} s",
        )
    elif age < -1.0:
        run.fail("quote_stale", f"nonce issued {-age:.1f} s in the future")
    prev = expected.previous_clock
    c = att.clock_info
    if prev is not None:
        if c.reset_count < prev.reset_count or (
            c.reset_count == prev.reset_count and c.restart_count < prev.restart_count
        ):
            run.fail(
                "reset_count_rollback",
                f"resetCount/restartCount {c.reset_count}/{c.restart_count} < "
                f"{prev.reset_count}/{prev.restart_count}",
            )
        elif c.reset_count == prev.reset_count and c.restart_count == prev.restart_count:
            if c.clock < prev.clock:
                run.fail("clock_rollback", f"clock {c.clock} < previous {prev.clock}")
        else:
            run.details["rebooted"] = True

    # 3. The PCR values against the quoted digest.
    order = _pcr_order(att.pcr_select)
    quoted_in_bank = {i for b, i in order if b == policy.pcr_bank}
    needed = set(policy.required_pcrs) | set(policy.golden_pcrs)
    missing = sorted(needed - quoted_in_bank)
    if missing:
        run.fail(
            "pcr_selection_incomplete", f"{policy.pcr_bank} PCRs {missing} are not in the quote"
        )
    values: list[bytes] = []
    absent = []
    for bank, i in order:
        v = evidence.pcrs.get(bank, {}).get(i)
        if v is None:
            absent.append(f"{bank}:{i}")
        else:
            values.append(v)
    if absent:
        run.fail("pcr_values_incomplete", f"no value for quoted PCRs {', '.join(absent)}")
        return c
    hash_alg = sig.hash_alg  # TPM2_Quote digests the PCRs with the signing scheme's hash
    if tpm.digest(hash_alg, b"".join(values)) != att.pcr_digest:
        run.fail("pcr_digest_mismatch", "the PCR values do not hash to the quoted pcrDigest")
        return c
    quoted = {i: evidence.pcrs[policy.pcr_bank][i] for i in quoted_in_bank}

    # 4. PCR policy (golden values per node class).
    bad = sorted(
        i for i, allowed in policy.golden_pcrs.items() if i in quoted and quoted[i] not in allowed
    )
    if bad:
        run.fail("pcr_policy_violation", f"{policy.pcr_bank} PCRs {bad} are not golden values")

    # 5. Event log: replay must equal the quoted PCRs, then the event policy.
    if evidence.eventlog is None:
        if policy.require_eventlog:
            run.fail("eventlog_missing", "no event log in the evidence")
    else:
        if cache is not None:
            facts = cache.facts(evidence.eventlog, policy.pcr_bank, log_sha256 or "")
        else:
            facts = analyze_eventlog(evidence.eventlog, policy.pcr_bank, log_sha256)
        _check_eventlog(facts, quoted, policy, run)

    # 6. GPU firmware and driver.
    _check_inventory(evidence.inventory, policy, run)
    return c


def _check_eventlog(
    facts: LogFacts, quoted: Mapping[int, bytes], policy: Policy, run: _Run
) -> None:
    if facts.error is not None:
        run.fail(*facts.error)
        return
    replayed = facts.replayed
    run.details["eventlog_events"] = facts.events
    size = tpm.HASH_ALGS[tpm.BANK_ALGS[policy.pcr_bank]][1]
    zero = bytes(size)
    mismatched = sorted(
        i for i in quoted if i in policy.eventlog_pcrs and replayed.get(i, zero) != quoted[i]
    )
    if mismatched:
        run.fail(
            "eventlog_replay_mismatch",
            f"replayed {policy.pcr_bank} PCRs {mismatched} differ from the quote",
        )
        return  # an event log that does not match the quote says nothing trustworthy
    unquoted = sorted(i for i in replayed if i in policy.eventlog_pcrs and i not in quoted)
    if unquoted:
        run.details["eventlog_pcrs_not_quoted"] = unquoted
    covered = set(quoted) & set(policy.eventlog_pcrs)

    if policy.require_secure_boot:
        if 7 not in covered:
            run.fail("secure_boot_disabled", "PCR 7 is not quoted, Secure Boot cannot be shown")
        elif facts.secure_boot_error is not None:
            run.fail("eventlog_event_digest_mismatch", facts.secure_boot_error)
            return
        else:
            run.details["secure_boot"] = facts.secure_boot
            if not facts.secure_boot:
                run.fail(
                    "secure_boot_disabled",
                    "SecureBoot is not measured"
                    if facts.secure_boot is None
                    else "SecureBoot is 0",
                )

    bank = policy.pcr_bank
    if policy.allowed_boot_apps is not None and 4 not in covered:
        run.fail("boot_app_not_allowed", "PCR 4 is not quoted: boot applications cannot be shown")
    elif policy.allowed_boot_apps is not None:
        bad = [(i, d) for i, d in facts.boot_apps if d not in policy.allowed_boot_apps]
        if bad:
            run.fail(
                "boot_app_not_allowed",
                "; ".join(f"event {i} {bank}:{d.hex()}" for i, d in bad[:5]),
            )
    if policy.allowed_kernels is not None and 9 not in covered:
        run.fail("kernel_not_allowed", "PCR 9 is not quoted: the kernel cannot be shown")
    elif policy.allowed_kernels is not None:
        bad_k = [(i, p, d) for i, p, d in facts.kernels if d not in policy.allowed_kernels]
        if bad_k:
            run.fail(
                "kernel_not_allowed",
                "; ".join(f"event {i} {p} {bank}:{d.hex()}" for i, p, d in bad_k[:5]),
            )


def _check_inventory(inv: Mapping[str, Any] | None, policy: Policy, run: _Run) -> None:
    if policy.allowed_vbios is None and policy.min_driver is None:
        return
    if inv is None:
        if policy.require_inventory:
            run.fail("inventory_missing", "no GPU inventory in the evidence")
        return
    gpus = inv.get("gpus")
    if not isinstance(gpus, list) or not all(
        type(g) is dict or isinstance(g, Mapping) for g in gpus
    ):
        run.fail("inventory_malformed", "inventory.gpus must be a list of objects")
        return
    if policy.require_inventory and not gpus:
        run.fail("inventory_missing", "the inventory lists no GPUs")
        return
    allowed = policy._vbios
    minimum = policy._min_driver
    for g in gpus:
        who = str(g.get("uuid") or g.get("index") or "?")
        if allowed is not None:
            vb = g.get("vbios_version")
            if not isinstance(vb, str) or vb.strip().upper() not in allowed:
                run.fail("vbios_not_allowed", f"GPU {who}: VBIOS {vb!r}")
        if minimum is not None:
            drv = g.get("driver_version", inv.get("driver_version"))
            try:
                ok = isinstance(drv, str) and parse_version(drv) >= minimum
            except AttestError:
                ok = False
            if not ok:
                run.fail("driver_too_old", f"GPU {who}: driver {drv!r} < {policy.min_driver}")
