"""A TPM 2.0 driven through tpm2-tools: the one place proofplane runs ``tpm2_*`` commands.

The node agent (:mod:`proofplane.cli.agent`) uses it against the node's TPM
(``device:/dev/tpmrm0``), the software-TPM harness (:mod:`proofplane.agent.tpm.swtpm`) against a
swtpm (``swtpm:host=…,port=…``). Transient objects and sessions are flushed after every tool
call: the swtpm TCTI has no resource manager. The EK may be RSA or ECC, from a low-range
(PolicySecret) or high-range (PolicyOR) TCG template.

The module runs processes: it is an edge of ``attest``, not part of its pure core.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
from pathlib import Path

import yaml
from cryptography import x509

from proofplane.attest import tpm as tpms
from proofplane.errors import ProofplaneError

#: NV index of the RSA 2048 EK certificate (TCG EK Credential Profile 2.x, low range)
EK_CERT_NV_INDEX = "0x01c00002"
#: NV indexes of EK certificates per EK type: low range first, then high
EK_CERT_NV_INDEXES = {
    tpms.TPM_ALG_RSA: ("0x01c00002", "0x01c00012", "0x01c0001c", "0x01c0001e"),
    tpms.TPM_ALG_ECC: ("0x01c0000a", "0x01c00014", "0x01c00016", "0x01c00018"),
}
BANK_SIZES = {"sha1": 20, "sha256": 32, "sha384": 48, "sha512": 64}
TPM_CC_POLICY_SECRET = 0x151
TPM_CC_POLICY_OR = 0x171
#: PolicyC of the high-range EK templates (PolicyAuthorizeNV, TCG EK Credential Profile 2.x)
EK_POLICY_C = {
    tpms.TPM_ALG_SHA256: "3767e2edd43ff45a3a7e1eaefcef78643dca964632e7aad82c673a30d8633fde",
    tpms.TPM_ALG_SHA384: "d6032ce61f2fb3c240eb3cf6a33237ef2b6a16f4293c22b455e261cffd217ad5"
    "b4947c2d73e63005eed2dc2b3593d165",
}
TOOL_TIMEOUT_S = 60


class TpmToolError(ProofplaneError, RuntimeError):
    """A tpm2-tools command (or the TPM behind it) failed; ``message`` says which and why."""

    code = "tpm_tool_failed"


def ek_policy_branches(ek_public: bytes) -> tuple[str, list[bytes]]:
    """How to satisfy the EK's authPolicy: (session hash, PolicyOR branches after the
    PolicySecret(endorsement)). Low-range EKs need PolicySecret alone (no branches); high-range
    ones PolicyOR(PolicyA, PolicyC). An unknown policy gets PolicySecret: the TPM judges."""
    ek = tpms.parse_public(ek_public)
    alg = ek.name_alg
    size = tpms.HASH_ALGS[alg][1]
    secret = struct.pack(">II", TPM_CC_POLICY_SECRET, tpms.TPM_RH_ENDORSEMENT)
    policy_a = tpms.digest(alg, tpms.digest(alg, bytes(size) + secret))
    name = tpms.HASH_ALGS[alg][0]
    if ek.auth_policy == policy_a or alg not in EK_POLICY_C:
        return name, []
    policy_c = bytes.fromhex(EK_POLICY_C[alg])
    policy_or = struct.pack(">I", TPM_CC_POLICY_OR)
    policy_b = tpms.digest(alg, bytes(size) + policy_or + policy_a + policy_c)
    return name, ([policy_a, policy_c] if ek.auth_policy == policy_b else [])


def certifies(der: bytes, ek_public: bytes) -> bool:
    """Whether the DER certificate ``der`` certifies the key in ``ek_public``."""
    try:
        cert_key = x509.load_der_x509_certificate(der).public_key()
        ek_key = tpms.parse_public(ek_public).public_key()
        return bool(cert_key.public_numbers() == ek_key.public_numbers())  # type: ignore[union-attr]
    except Exception:
        return False


def strip_der_padding(blob: bytes) -> bytes:
    """NV indexes are fixed-size: cut a DER SEQUENCE to its encoded length."""
    if len(blob) < 4 or blob[0] != 0x30:
        return blob
    if blob[1] < 0x80:
        return blob[: 2 + blob[1]]
    n = blob[1] & 0x7F
    return blob[: 2 + n + int.from_bytes(blob[2 : 2 + n], "big")]


class Tpm:
    """tpm2-tools against one TCTI, with scratch files in ``workdir``."""

    def __init__(self, tcti: str, workdir: Path) -> None:
        self.tcti = tcti
        self.env = {**os.environ, "TPM2TOOLS_TCTI": tcti}
        self.workdir = workdir

    def run(self, *args: str) -> bytes:
        """Run one tool (or ``bash -c`` script) against this TPM; its stdout. Transient
        objects and sessions are flushed afterwards, whatever happened."""
        try:
            proc = subprocess.run(
                list(args), env=self.env, cwd=self.workdir, capture_output=True,
                timeout=TOOL_TIMEOUT_S, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TpmToolError(f"{args[0]}: {exc}") from None
        finally:
            for flag in ("-t", "-s"):
                # when this fails too, the tool's own error is the one worth reporting
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    subprocess.run(
                        ["tpm2_flushcontext", flag], env=self.env, capture_output=True,
                        timeout=TOOL_TIMEOUT_S, check=False,
                    )  # fmt: skip
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            raise TpmToolError(f"{' '.join(args[:2])} failed ({proc.returncode}): {err}")
        return proc.stdout

    def read_public(self, handle: str) -> bytes:
        """TPM2B_PUBLIC of a persistent object."""
        out = self.workdir / f"pub-{handle}.bin"
        self.run("tpm2_readpublic", "-c", handle, "-o", str(out), "-f", "tss")
        return out.read_bytes()

    def ek_certificate(self, ek_public: bytes | None = None) -> bytes | None:
        """The EK certificate from its NV index, cut to its DER length; None if absent.

        With ``ek_public``: the first certificate among the standard indexes for the EK's type
        that certifies this EK (else the first one found: the server reports the mismatch)."""
        indexes: tuple[str, ...] = (EK_CERT_NV_INDEX,)
        if ek_public is not None:
            indexes = EK_CERT_NV_INDEXES.get(tpms.parse_public(ek_public).type, indexes)
        first = None
        for index in indexes:
            blob = self.nv_certificate(index)
            if blob is None:
                continue
            if ek_public is None or certifies(blob, ek_public):
                return blob
            first = first or blob
        return first

    def nv_certificate(self, index: str) -> bytes | None:
        """The DER certificate stored in NV ``index``; None when the index cannot be read."""
        out = self.workdir / "ekcert.der"
        try:
            self.run("tpm2_nvread", index, "-o", str(out))
        except TpmToolError:
            return None
        return strip_der_padding(out.read_bytes())

    def extend(self, events: list[tuple[int, dict[str, bytes]]]) -> None:
        """Extend PCRs: ``[(pcr, {bank: digest, …}), …]`` in order, in one tool call per 64."""
        for i in range(0, len(events), 64):
            args = [
                f"{pcr}:" + ",".join(f"{b}={d.hex()}" for b, d in sorted(dg.items()))
                for pcr, dg in events[i : i + 64]
            ]
            self.run("tpm2_pcrextend", *args)

    def activate(
        self, credential_file: bytes, ak: str, ek: str, ek_public: bytes | None = None
    ) -> bytes:
        """TPM2_ActivateCredential (tpm2-tools credential file format) with the AK and EK at
        the given handles, in a policy session that satisfies the EK's authPolicy."""
        cred, out = self.workdir / "cred.in", self.workdir / "cred.out"
        session = self.workdir / "session.ctx"
        cred.write_bytes(credential_file)
        bank, branches = ek_policy_branches(ek_public or self.read_public(ek))
        policy_or = ""
        if branches:
            files = []
            for i, branch in enumerate(branches):
                path = self.workdir / f"ek-policy-{i}.bin"
                path.write_bytes(branch)
                files.append(str(path))
            policy_or = f"tpm2_policyor -S {session} -l {bank}:{','.join(files)} >/dev/null; "
        script = (
            f"set -e; tpm2_startauthsession --policy-session -S {session} -g {bank}; "
            f"tpm2_policysecret -S {session} -c e >/dev/null; {policy_or}"
            f"tpm2_activatecredential -c {ak} -C {ek} -i {cred} -o {out} -P session:{session}; "
            f"tpm2_flushcontext {session}"
        )
        self.run("bash", "-c", script)
        return out.read_bytes()

    def quote(
        self, nonce: bytes, bank: str, pcrs: list[int], ak: str
    ) -> tuple[bytes, bytes, dict[str, dict[int, bytes]]]:
        """(TPMS_ATTEST, TPMT_SIGNATURE, {bank: {pcr: value}}) of ``tpm2_quote`` with the AK
        at handle ``ak`` over ``pcrs`` of ``bank``, qualified by ``nonce``."""
        msg, sig = self.workdir / "quote.msg", self.workdir / "quote.sig"
        out = self.run(
            "tpm2_quote", "-c", ak, "-l", f"{bank}:" + ",".join(map(str, pcrs)),
            "-q", nonce.hex(), "-m", str(msg), "-s", str(sig), "-g", "sha256",
            "-o", str(self.workdir / "quote.pcrs"), "-F", "serialized",
        )  # fmt: skip
        try:
            doc = yaml.safe_load(out.decode("utf-8", "replace")) or {}
            values = {
                str(b): {int(i): int(v).to_bytes(BANK_SIZES[str(b)], "big")
                         for i, v in vals.items()}
                for b, vals in (doc.get("pcrs") or {}).items()
            }  # fmt: skip
        except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError, OverflowError):
            raise TpmToolError(
                f"tpm2_quote printed PCR values that cannot be read: {out[:200]!r}"
            ) from None
        return msg.read_bytes(), sig.read_bytes(), values
