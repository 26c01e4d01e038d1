"""Quote verification against a real TPM 2.0 (swtpm + tpm2-tools), good and bad evidence.

Without swtpm/tpm2-tools these tests are skipped locally and FAIL in CI (CI=true).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from ci import unavailable
from proofplane.attest import Evidence, Expected, Policy, verify
from proofplane.attest import eventlog as el
from proofplane.attest.tpm import ClockInfo, marshal_public_from_key, parse_attest
from swtpm import AK_HANDLES, EK_HANDLE, SwtpmNode, boot_log, manufacture, measure, missing_tools

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
PCRS = list(range(10))
INVENTORY = {
    "driver_version": "550.54.15",
    "gpus": [
        {"index": 0, "uuid": "GPU-0a", "name": "NVIDIA H100 80GB HBM3",
         "vbios_version": "96.00.99.00.01", "driver_version": "550.54.15"},
        {"index": 1, "uuid": "GPU-0b", "name": "NVIDIA H100 80GB HBM3",
         "vbios_version": "96.00.99.00.01", "driver_version": "550.54.15"},
    ],
}  # fmt: skip


@pytest.fixture(scope="session")
def tpm_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = missing_tools()
    if missing:
        msg = f"swtpm/tpm2-tools missing: {', '.join(missing)} (scripts/test-deps.sh installs them)"
        unavailable(msg)
    return manufacture(tmp_path_factory.mktemp("tpm-template"))


class Node:
    """A running swtpm node with a measured boot, and helpers to make evidence from it."""

    def __init__(self, tpm: SwtpmNode, log: bytes) -> None:
        self.tpm = tpm
        self.log = log
        self.ak = {k: tpm.read_public(h) for k, h in AK_HANDLES.items()}
        self.ek = tpm.read_public(EK_HANDLE)

    def attest(self, nonce: bytes | None = None, *, ak: str = "ecc") -> tuple[Evidence, Expected]:
        nonce = nonce or secrets.token_bytes(32)
        quote, sig, pcrs = self.tpm.quote(nonce, PCRS, ak=ak)
        ev = Evidence(quote, sig, pcrs, self.log, INVENTORY)
        exp = Expected(nonce, T0, self.ak["ecc"], self.ek)
        return ev, exp

    def policy(self, **kw) -> Policy:
        """The golden policy for this node's boot: PCR values from the log, boot apps, GPUs."""
        log = el.parse_eventlog(self.log)
        golden = el.replay(log, ["sha256"])["sha256"]
        apps = {
            e.digests["sha256"] for e in log.events if e.type == el.EV_EFI_BOOT_SERVICES_APPLICATION
        }
        kernels = {e.digests["sha256"] for e in log.events if e.pcr == 9 and e.type == el.EV_IPL}
        base = dict(
            id="h100-test", node_class="h100",
            golden_pcrs={i: frozenset({v}) for i, v in golden.items()},
            allowed_boot_apps=frozenset(apps), allowed_kernels=frozenset(kernels),
            allowed_vbios=frozenset({"96.00.99.00.01"}), min_driver="550.54.0",
            max_quote_age_s=60,
        )  # fmt: skip
        base.update(kw)
        return Policy(**base)


@pytest.fixture(scope="module")
def node(tpm_template: Path, tmp_path_factory: pytest.TempPathFactory):
    tpm = SwtpmNode.start(tpm_template, tmp_path_factory.mktemp("node"))
    try:
        log = boot_log()
        measure(tpm, log)
        yield Node(tpm, log)
    finally:
        tpm.stop()


@pytest.fixture(scope="module")
def good(node: Node):
    """One good round: evidence, expectation, policy."""
    ev, exp = node.attest()
    return ev, exp, node.policy()


def reasons(v) -> set[str]:
    return set(v.reasons)


def test_good_quote_is_accepted(good, node: Node):
    ev, exp, policy = good
    v = verify(ev, exp, policy, T0 + timedelta(seconds=2))
    assert v.ok, v.messages
    assert v.reasons == ()
    assert v.details["secure_boot"] is True
    assert v.clock == parse_attest(ev.quote).clock_info
    assert len(v.evidence_hash) == 64 and v.policy_hash == policy.hash
    # the RSA AK works too (RSASSA-SHA256)
    ev2, exp2 = node.attest(ak="rsa")
    v2 = verify(ev2, replace(exp2, ak_public=node.ak["rsa"]), policy, T0)
    assert v2.ok, v2.messages


def test_replayed_or_other_nonce_is_rejected(good, node: Node):
    ev, exp, policy = good
    fresh = replace(exp, nonce=secrets.token_bytes(32))  # the server issued a new nonce
    v = verify(ev, fresh, policy, T0)
    assert not v.ok and reasons(v) == {"nonce_mismatch"}


def test_quote_signed_by_another_key_is_rejected(node: Node):
    ev, exp = node.attest(ak="rogue")  # a genuine TPM quote, but not by the bound AK
    v = verify(ev, exp, node.policy(), T0)
    assert not v.ok and v.reasons == ("quote_signature_invalid",)


def test_bad_signature_is_rejected_even_with_an_empty_policy(good, node: Node):
    ev, exp, _ = good
    empty = Policy(required_pcrs=(), golden_pcrs={}, require_eventlog=False,
                   require_secure_boot=False, require_inventory=False)  # fmt: skip
    assert verify(ev, exp, empty, T0).ok  # the empty policy itself passes a good quote
    sig = bytearray(ev.signature)
    sig[-1] ^= 1
    for bad in (
        replace(ev, signature=bytes(sig)),
        replace(ev, signature=b""),
        replace(ev, quote=ev.quote[:-1] + bytes([ev.quote[-1] ^ 1])),
        node.attest(exp.nonce, ak="rogue")[0],
    ):
        v = verify(bad, exp, empty, T0)
        assert not v.ok
        assert v.reasons[0] in ("quote_signature_invalid", "signature_malformed")
        assert v.clock is None  # nothing from an unverified quote is reported as fact


def test_doctored_pcr_values_are_rejected(good):
    ev, exp, policy = good
    pcrs = {b: dict(v) for b, v in ev.pcrs.items()}
    pcrs["sha256"][4] = hashlib.sha256(b"evil").digest()
    v = verify(replace(ev, pcrs=pcrs), exp, policy, T0)
    assert not v.ok and "pcr_digest_mismatch" in reasons(v)
    del pcrs["sha256"][4]
    v = verify(replace(ev, pcrs=pcrs), exp, policy, T0)
    assert "pcr_values_incomplete" in reasons(v)


def test_doctored_event_log_is_rejected(good):
    ev, exp, policy = good
    # 1. a measured digest replaced: replay no longer gives the quoted PCRs
    log = el.parse_eventlog(ev.eventlog)
    grub = [e for e in log.events if e.type == el.EV_EFI_BOOT_SERVICES_APPLICATION][1]
    blob = ev.eventlog.replace(grub.digests["sha256"], hashlib.sha256(b"evil grub").digest())
    v = verify(replace(ev, eventlog=blob), exp, policy, T0)
    assert not v.ok and reasons(v) == {"eventlog_replay_mismatch"}
    # 2. SecureBoot=1 rewritten from a SecureBoot=0 boot: the digest still replays, the data lies
    off_var = el.encode_efi_variable(el.EFI_GLOBAL_VARIABLE, "SecureBoot", b"\0")
    on_var = el.encode_efi_variable(el.EFI_GLOBAL_VARIABLE, "SecureBoot", b"\1")
    blob = ev.eventlog.replace(on_var, off_var)
    assert blob != ev.eventlog
    v = verify(replace(ev, eventlog=blob), exp, policy, T0)
    assert reasons(v) == {"eventlog_event_digest_mismatch"}
    # 3. truncated log, and no log at all
    v = verify(replace(ev, eventlog=ev.eventlog[:-7]), exp, policy, T0)
    assert reasons(v) == {"eventlog_malformed"}
    v = verify(replace(ev, eventlog=None), exp, policy, T0)
    assert reasons(v) == {"eventlog_missing"}


def test_stale_quote_is_rejected(good):
    ev, exp, policy = good
    v = verify(ev, exp, policy, T0 + timedelta(seconds=61))
    assert reasons(v) == {"quote_stale"}
    v = verify(ev, exp, policy, T0 - timedelta(minutes=5))  # nonce "issued" in the future
    assert reasons(v) == {"quote_stale"}


def test_clock_and_reset_rollback(good):
    ev, exp, policy = good
    c = parse_attest(ev.quote).clock_info
    later = ClockInfo(c.clock + 10_000, c.reset_count, c.restart_count, True)
    v = verify(ev, replace(exp, previous_clock=later), policy, T0)
    assert reasons(v) == {"clock_rollback"}
    rebooted_later = ClockInfo(0, c.reset_count + 1, 0, True)
    v = verify(ev, replace(exp, previous_clock=rebooted_later), policy, T0)
    assert reasons(v) == {"reset_count_rollback"}
    earlier = ClockInfo(c.clock - 1, c.reset_count, c.restart_count, True)
    assert verify(ev, replace(exp, previous_clock=earlier), policy, T0).ok


def test_gpu_allow_list(good, node: Node):
    ev, exp, policy = good
    v = verify(ev, exp, replace(policy, allowed_vbios=frozenset({"96.00.5E.00.01"})), T0)
    assert reasons(v) == {"vbios_not_allowed"}
    v = verify(ev, exp, replace(policy, min_driver="560.1"), T0)
    assert reasons(v) == {"driver_too_old"}
    v = verify(replace(ev, inventory=None), exp, policy, T0)
    assert reasons(v) == {"inventory_missing"}
    inv = {"gpus": [{"uuid": "GPU-x", "vbios_version": "96.00.99.00.01", "driver_version": "x"}]}
    v = verify(replace(ev, inventory=inv), exp, policy, T0)
    assert reasons(v) == {"driver_too_old"}


def test_ak_and_signer_binding(good, node: Node):
    ev, exp, policy = good
    # the EK is restricted *decrypt*: not an attestation key
    v = verify(ev, replace(exp, ak_public=node.ek), policy, T0)
    assert reasons(v) == {"ak_attributes_invalid"}
    # a quote whose qualifiedSigner is not the bound AK under the bound EK
    other_ek = marshal_public_from_key(ec.generate_private_key(ec.SECP256R1()).public_key())
    v = verify(ev, replace(exp, ek_public=other_ek), policy, T0)
    assert reasons(v) == {"qualified_signer_mismatch"}


def test_policy_checks_bootloader_kernel_and_golden_pcrs(good, node: Node):
    ev, exp, policy = good
    v = verify(ev, exp, replace(policy, allowed_boot_apps=frozenset()), T0)
    assert reasons(v) == {"boot_app_not_allowed"}
    v = verify(ev, exp, replace(policy, allowed_kernels=frozenset({bytes(32)})), T0)
    assert reasons(v) == {"kernel_not_allowed"}
    golden = dict(policy.golden_pcrs)
    golden[0] = frozenset({bytes(32)})
    v = verify(ev, exp, replace(policy, golden_pcrs=golden), T0)
    assert reasons(v) == {"pcr_policy_violation"}
    v = verify(ev, exp, replace(policy, required_pcrs=(0, 1, 2, 3, 4, 5, 6, 7, 10)), T0)
    assert reasons(v) == {"pcr_selection_incomplete"}
    # an allow-list is never skipped because its PCR was left out of the quote
    ev4, exp4 = node.attest()
    q, sig, pcrs = node.tpm.quote(exp4.nonce, [0, 1, 2, 3, 5, 6, 7])
    lax = replace(policy, required_pcrs=(), golden_pcrs={})
    v = verify(replace(ev4, quote=q, signature=sig, pcrs=pcrs), exp4, lax, T0)
    assert reasons(v) == {"boot_app_not_allowed", "kernel_not_allowed"}


def test_secure_boot_disabled_node(tpm_template: Path, tmp_path: Path):
    tpm = SwtpmNode.start(tpm_template, tmp_path / "sb-off")
    try:
        log = boot_log(secure_boot=False)
        measure(tpm, log)
        n = Node(tpm, log)
        ev, exp = n.attest()
        v = verify(ev, exp, n.policy(), T0)
        assert reasons(v) == {"secure_boot_disabled"}
        assert v.details["secure_boot"] is False
        # the same node after one extra extend past its baseline (e.g. an unapproved module)
        good_policy = n.policy(require_secure_boot=False)
        assert verify(ev, exp, good_policy, T0).ok
        tpm.extend([(4, {"sha1": hashlib.sha1(b"x").digest(),
                         "sha256": hashlib.sha256(b"x").digest()})])  # fmt: skip
        ev2, exp2 = n.attest()
        v = verify(ev2, replace(exp2, previous_clock=parse_attest(ev.quote).clock_info),
                   good_policy, T0)  # fmt: skip
        assert not v.ok
        assert reasons(v) == {"pcr_policy_violation", "eventlog_replay_mismatch"}
    finally:
        tpm.stop()


def test_make_credential_is_activated_by_the_real_tpm(node: Node):
    from proofplane.attest.credential import make_credential, tpm2_tools_credential_file
    from proofplane.attest.tpm import parse_public
    from swtpm import TpmToolError

    secret = secrets.token_bytes(32)
    ak_name = parse_public(node.ak["ecc"]).name
    blob, enc = make_credential(node.ek, ak_name, secret)
    assert node.tpm.activate_credential(tpm2_tools_credential_file(blob, enc)) == secret
    # a credential made for another AK's name cannot be activated with this AK
    rogue_name = parse_public(node.ak["rogue"]).name
    blob, enc = make_credential(node.ek, rogue_name, secret)
    with pytest.raises(TpmToolError):
        node.tpm.activate_credential(tpm2_tools_credential_file(blob, enc))


def test_ek_certificate_chain(node: Node, tpm_template: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    from proofplane.attest import CertificateError
    from proofplane.attest.ekcert import verify_ek_certificate

    root = (tpm_template / "ca" / "swtpm-localca-rootca-cert.pem").read_bytes()
    inter = (tpm_template / "ca" / "issuercert.pem").read_bytes()
    cert = node.tpm.ek_certificate()
    now = datetime.now(UTC)
    ok = verify_ek_certificate(cert, root, now, intermediates=[inter], ek_public=node.ek)
    assert ok.has_ek_eku and len(ok.chain) == 3 and ok.issuer == "CN=swtpm-localca"

    def reason(**kw) -> str:
        args = {"cert": cert, "ca_bundle": root, "now": now, "intermediates": [inter]} | kw
        with pytest.raises(CertificateError) as exc:
            verify_ek_certificate(**args)
        return exc.value.reason

    assert reason(intermediates=[]) == "ek_cert_untrusted"
    assert reason(now=datetime(2000, 1, 1, tzinfo=UTC)) == "ek_cert_untrusted"
    assert reason(ek_public=node.ak["ecc"]) == "ek_cert_key_mismatch"
    assert reason(cert=b"junk") == "ek_cert_malformed"
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "other root")])
    other = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(datetime(2020, 1, 1, tzinfo=UTC))
        .not_valid_after(datetime(2099, 1, 1, tzinfo=UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    assert reason(ca_bundle=other.public_bytes(serialization.Encoding.PEM)) == "ek_cert_untrusted"


# --- MakeCredential to an ECC EK ----------------------------------------------------------------
ECC_EK_P256 = "0x81010010"  # tpm2_createek -G ecc: the low-range P-256 template (L-2)
ECC_EK_P384 = "0x81010016"  # swtpm_setup's own ECC EK: the high-range P-384 template (H-3)


@pytest.fixture(scope="module")
def ecc_node(tpm_template: Path, tmp_path_factory: pytest.TempPathFactory):
    """A TPM with two ECC EKs (P-256 made here, swtpm's P-384) and an ECC AK under each."""
    tpm = SwtpmNode.start(tpm_template, tmp_path_factory.mktemp("ecc-node"))
    try:
        tpm.tool("tpm2_createek", "-G", "ecc", "-c", ECC_EK_P256)
        for ek, ak in ((ECC_EK_P256, "0x81010011"), (ECC_EK_P384, "0x81010012")):
            ctx = str(tpm.workdir / f"ak-{ak}.ctx")
            tpm.tool("tpm2_createak", "-C", ek, "-c", ctx, "-G", "ecc", "-g", "sha256",
                     "-s", "ecdsa")  # fmt: skip
            tpm.tool("tpm2_evictcontrol", "-C", "o", "-c", ctx, ak)
        yield tpm
    finally:
        tpm.stop()


@pytest.mark.parametrize(
    ("ek", "ak", "curve", "name_alg"),
    [(ECC_EK_P256, "0x81010011", 0x0003, 0x000B), (ECC_EK_P384, "0x81010012", 0x0004, 0x000C)],
)
def test_make_credential_to_an_ecc_ek_is_activated_by_the_real_tpm(
    ecc_node: SwtpmNode, ek: str, ak: str, curve: int, name_alg: int
):
    from proofplane.agent.tpm.tpm2tools import Tpm, TpmToolError
    from proofplane.attest.credential import make_credential, tpm2_tools_credential_file
    from proofplane.attest.tpm import TPM_ALG_ECC, parse_public

    ek_public = ecc_node.read_public(ek)
    parsed = parse_public(ek_public)
    assert (parsed.type, parsed.curve, parsed.name_alg) == (TPM_ALG_ECC, curve, name_alg)
    agent_tpm = Tpm(ecc_node.tcti, ecc_node.workdir)
    secret = secrets.token_bytes(32)
    blob, enc = make_credential(ek_public, parse_public(ecc_node.read_public(ak)).name, secret)
    # the encrypted secret is the ephemeral public point: TPM2B(TPMS_ECC_POINT) on the curve
    size = len(parsed.x)
    assert len(enc) == 2 + 2 + size + 2 + size
    # the agent's activation satisfies both the low-range (PolicySecret) and the high-range
    # (PolicyOR of PolicySecret and PolicyAuthorizeNV) EK policy
    assert agent_tpm.activate(tpm2_tools_credential_file(blob, enc), ak, ek) == secret
    # a credential made for another AK's name cannot be activated with this AK
    rogue = parse_public(ecc_node.read_public(AK_HANDLES["rogue"])).name
    blob, enc = make_credential(ek_public, rogue, secret)
    with pytest.raises(TpmToolError):
        agent_tpm.activate(tpm2_tools_credential_file(blob, enc), ak, ek)


def test_the_agent_sends_the_ecc_ek_certificate(ecc_node: SwtpmNode, tpm_template: Path):
    from proofplane.agent.tpm.tpm2tools import Tpm
    from proofplane.attest.ekcert import verify_ek_certificate

    agent_tpm = Tpm(ecc_node.tcti, ecc_node.workdir)
    ek_public = ecc_node.read_public(ECC_EK_P384)
    cert = agent_tpm.ek_certificate(ek_public)  # NV 0x01c00016, not the RSA one at 0x01c00002
    assert cert is not None and cert != ecc_node.ek_certificate()
    root = (tpm_template / "ca" / "swtpm-localca-rootca-cert.pem").read_bytes()
    inter = (tpm_template / "ca" / "issuercert.pem").read_bytes()
    verify_ek_certificate(cert, root, datetime.now(UTC), intermediates=[inter],
                          ek_public=ek_public)  # fmt: skip
    # the P-256 EK made by tpm2_createek has no certificate: the first one found is sent, and
    # the server reports the mismatch (ek_cert_key_mismatch) when it checks certificates
    assert agent_tpm.ek_certificate(ecc_node.read_public(ECC_EK_P256)) == cert


def test_make_credential_ecc_is_deterministic_given_rng():
    import random

    from proofplane.attest.credential import make_credential
    from proofplane.attest.tpm import parse_public

    ek = _ecc_ek(ec.generate_private_key(ec.SECP256R1()).public_key())
    name = parse_public(marshal_public_from_key(ec.generate_private_key(ec.SECP256R1())
                                                .public_key())).name  # fmt: skip

    def rng(seed: int):
        r = random.Random(seed)
        return lambda n: r.randbytes(n)

    assert make_credential(ek, name, b"s" * 32, rng=rng(1)) == make_credential(
        ek, name, b"s" * 32, rng=rng(1)
    )
    assert make_credential(ek, name, b"s" * 32, rng=rng(1)) != make_credential(
        ek, name, b"s" * 32, rng=rng(2)
    )


def _ecc_ek(key: ec.EllipticCurvePublicKey, *, curve: int | None = None,
            x: bytes | None = None) -> bytes:  # fmt: skip
    """TPMT_PUBLIC of an ECC EK (default L-2 template attributes, AES-128-CFB)."""
    import struct

    from proofplane.attest import tpm

    size = (key.curve.key_size + 7) // 8
    nums = key.public_numbers()
    attrs = (tpm.FIXED_TPM | tpm.FIXED_PARENT | tpm.SENSITIVE_DATA_ORIGIN | tpm.ADMIN_WITH_POLICY
             | tpm.RESTRICTED | tpm.DECRYPT)  # fmt: skip
    curve_id = curve if curve is not None else {256: 3, 384: 4, 521: 5}[key.curve.key_size]
    px = x if x is not None else nums.x.to_bytes(size, "big")
    return (
        struct.pack(">HHI", tpm.TPM_ALG_ECC, tpm.TPM_ALG_SHA256, attrs)
        + struct.pack(">H", 0)
        + struct.pack(">HHH", tpm.TPM_ALG_AES, 128, tpm.TPM_ALG_CFB)
        + struct.pack(">HHH", tpm.TPM_ALG_NULL, curve_id, tpm.TPM_ALG_NULL)
        + struct.pack(">H", len(px)) + px
        + struct.pack(">H", size) + nums.y.to_bytes(size, "big")
    )  # fmt: skip


def test_make_credential_refuses_bad_ecc_eks():
    from proofplane.attest.credential import CredentialError, make_credential

    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    name = b"\x00\x0b" + bytes(32)

    def reason(ek: bytes) -> str:
        with pytest.raises(CredentialError) as exc:
            make_credential(ek, name, b"s" * 32)
        return exc.value.reason

    make_credential(_ecc_ek(key), name, b"s" * 32)  # the good one works
    assert reason(_ecc_ek(key, curve=0x0010)) == "ek_unsupported"  # BN P-256
    assert reason(_ecc_ek(key, curve=0x0020)) == "ek_unsupported"  # SM2 P-256
    # x moved by one: (x + 1, y) is not on the curve
    x = (key.public_numbers().x + 1).to_bytes(32, "big")
    assert reason(_ecc_ek(key, x=x)) == "ek_invalid"
    assert reason(_ecc_ek(key)[:-5]) == "ek_invalid"  # truncated public area
