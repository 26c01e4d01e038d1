"""``proofplane agent``: the node agent. One round: enroll if the AK is not bound yet
(MakeCredential challenge answered with ``tpm2_activatecredential``), take a nonce, quote the
PCRs the policy wants with the AK, attach the measured-boot event log and the GPU inventory,
and submit. ``--once`` runs one round and exits 0 (accepted) or 1 (rejected).

TPM access goes through tpm2-tools with a configurable TCTI (``device:/dev/tpmrm0`` on real
nodes, ``swtpm:host=127.0.0.1,port=P`` in tests). Transient objects and sessions are flushed
after every tool call: the swtpm TCTI has no resource manager. The EK may be RSA or ECC, from a
low-range (PolicySecret) or high-range (PolicyOR) TCG template.

The GPU inventory is read through NVML every round (:mod:`proofplane.hardware.nvml`), or
replayed from a recording with ``--inventory FILE``; ``--collect-inventory`` prints what NVML
reads, to record one. Without NVML the agent sends no inventory and says why on stderr: the
server then rejects the round if its policy needs one (``inventory_missing``).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
import yaml
from cryptography import x509

from proofplane.attest import Evidence
from proofplane.attest import tpm as tpms
from proofplane.cli.client import ApiClient, ApiError, CliError, segment
from proofplane.cli.render import print_json, print_line
from proofplane.hardware import nvml

DEFAULT_EVENTLOG = Path("/sys/kernel/security/tpm0/binary_bios_measurements")
EK_HANDLE = "0x81010001"
AK_HANDLE = "0x81010002"
EK_CERT_NV_INDEX = "0x01c00002"
#: NV indexes of EK certificates (TCG EK Credential Profile 2.x): low range first, then high
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


class TpmError(CliError):
    def __init__(self, message: str) -> None:
        super().__init__(f"proofplane agent: {message}", exit_code=1)


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


def _certifies(blob: bytes, ek_public: bytes) -> bool:
    """Whether the DER certificate ``blob`` certifies the key in ``ek_public``."""
    try:
        cert_key = x509.load_der_x509_certificate(blob).public_key()
        ek_key = tpms.parse_public(ek_public).public_key()
        return bool(cert_key.public_numbers() == ek_key.public_numbers())  # type: ignore[union-attr]
    except Exception:
        return False


class Tpm:
    """tpm2-tools against one TCTI, with scratch files in ``workdir``."""

    def __init__(self, tcti: str, workdir: Path) -> None:
        self.env = {**os.environ, "TPM2TOOLS_TCTI": tcti}
        self.workdir = workdir

    def run(self, *args: str) -> bytes:
        try:
            proc = subprocess.run(
                list(args), env=self.env, cwd=self.workdir, capture_output=True, timeout=60,
                check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TpmError(f"{args[0]}: {exc}") from None
        finally:
            for flag in ("-t", "-s"):
                subprocess.run(["tpm2_flushcontext", flag], env=self.env,
                               capture_output=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            raise TpmError(f"{args[0]} failed ({proc.returncode}): {err}")
        return proc.stdout

    def read_public(self, handle: str) -> bytes:
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
            blob = self._nv_der(index)
            if blob is None:
                continue
            if ek_public is None or _certifies(blob, ek_public):
                return blob
            first = first or blob
        return first

    def _nv_der(self, index: str) -> bytes | None:
        out = self.workdir / "ekcert.der"
        try:
            self.run("tpm2_nvread", index, "-o", str(out))
        except TpmError:
            return None
        blob = out.read_bytes()
        if len(blob) < 4 or blob[0] != 0x30 or blob[1] < 0x80:
            return blob
        n = blob[1] & 0x7F
        return blob[: 2 + n + int.from_bytes(blob[2 : 2 + n], "big")]

    def activate(
        self, credential_file: bytes, ak: str, ek: str, ek_public: bytes | None = None
    ) -> bytes:
        """TPM2_ActivateCredential in a policy session that satisfies the EK's authPolicy."""
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
        msg, sig = self.workdir / "quote.msg", self.workdir / "quote.sig"
        out = self.run(
            "tpm2_quote", "-c", ak, "-l", f"{bank}:" + ",".join(map(str, pcrs)),
            "-q", nonce.hex(), "-m", str(msg), "-s", str(sig), "-g", "sha256",
            "-o", str(self.workdir / "quote.pcrs"), "-F", "serialized",
        )  # fmt: skip
        doc = yaml.safe_load(out.decode("utf-8", "replace")) or {}
        values = {
            str(b): {int(i): int(v).to_bytes(BANK_SIZES[str(b)], "big") for i, v in vals.items()}
            for b, vals in (doc.get("pcrs") or {}).items()
        }
        return msg.read_bytes(), sig.read_bytes(), values


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def enroll(api: ApiClient, node: str, tpm: Tpm, *, ak: str, ek: str) -> dict[str, Any]:
    """Bind the AK: send EK and AK, answer the MakeCredential challenge."""
    base = f"/api/v1/nodes/{segment(node)}/attestation"
    ek_public = tpm.read_public(ek)
    cert = tpm.ek_certificate(ek_public)
    challenge = api.post(
        f"{base}/enroll",
        {
            "ek_public": _b64(ek_public),
            "ak_public": _b64(tpm.read_public(ak)),
            "ek_certificate": None if cert is None else _b64(cert),
        },
    )
    secret = tpm.activate(base64.b64decode(challenge["credential"]), ak, ek, ek_public)
    return api.post(f"{base}/activate", {"secret": _b64(secret)})  # type: ignore[no-any-return]


def attest_once(
    api: ApiClient,
    node: str,
    tpm: Tpm,
    *,
    ak: str = AK_HANDLE,
    ek: str = EK_HANDLE,
    eventlog: bytes | None = None,
    inventory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One attestation round (enrolling first when the AK is not bound); the server's answer."""
    base = f"/api/v1/nodes/{segment(node)}/attestation"
    try:
        issued = api.post(f"{base}/nonce")
    except ApiError as exc:
        if exc.code != "not_enrolled":
            raise
        enroll(api, node, tpm, ak=ak, ek=ek)
        issued = api.post(f"{base}/nonce")
    nonce = bytes.fromhex(issued["nonce"])
    quote, sig, pcrs = tpm.quote(nonce, issued["pcr_bank"], list(issued["pcrs"]), ak)
    evidence = Evidence(quote, sig, pcrs, eventlog, inventory)
    return api.post(  # type: ignore[no-any-return]
        f"{base}/evidence", {"nonce": nonce.hex(), "evidence": evidence.to_json()}
    )


def _read_inventory(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CliError(
            f"proofplane agent: cannot read inventory {path}: {exc}", exit_code=2
        ) from None
    if not isinstance(data, dict):
        raise CliError(f"proofplane agent: {path} is not a JSON object", exit_code=2)
    return data


def gpu_inventory(path: Path | None, nvml_module: Any = None) -> dict[str, Any] | None:
    """This round's GPU inventory: the recording at ``path``, else what NVML reads now (through
    ``nvml_module``, default ``pynvml``). None, with the reason on stderr, when NVML cannot be
    read: the server's policy decides whether a round without inventory passes."""
    if path is not None:
        return _read_inventory(path)
    try:
        return nvml.collect(nvml_module)
    except nvml.NvmlError as exc:
        typer.echo(f"proofplane agent: sending no GPU inventory: {exc.message}", err=True)
        return None


def _read_eventlog(path: Path | None) -> bytes | None:
    if path is None:
        return DEFAULT_EVENTLOG.read_bytes() if DEFAULT_EVENTLOG.exists() else None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CliError(
            f"proofplane agent: cannot read event log {path}: {exc}", exit_code=2
        ) from None


def agent(
    server: str | None = typer.Option(
        None, "--server", envvar="PROOFPLANE_SERVER", help="API URL (required to attest)."
    ),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar="PROOFPLANE_AGENT_TOKEN",
        help="The node's agent credential (required to attest).",
    ),
    node: str | None = typer.Option(
        None, "--node", envvar="PROOFPLANE_NODE", help="This node's name (required to attest)."
    ),
    tcti: str = typer.Option("device:/dev/tpmrm0", "--tcti", help="tpm2-tools TCTI."),
    eventlog: Path | None = typer.Option(
        None, "--eventlog", help=f"Binary event log (default {DEFAULT_EVENTLOG} if present)."
    ),
    inventory: Path | None = typer.Option(
        None,
        "--inventory",
        help="Recorded NVML inventory (JSON) to send instead of reading NVML each round.",
    ),
    collect_inventory: bool = typer.Option(
        False,
        "--collect-inventory",
        help="Print the GPU inventory NVML reads now (JSON; to record one) and exit.",
    ),
    ak: str = typer.Option(AK_HANDLE, "--ak-handle", help="Persistent handle of the AK."),
    ek: str = typer.Option(EK_HANDLE, "--ek-handle", help="Persistent handle of the EK."),
    once: bool = typer.Option(False, "--once", help="One round, then exit 0 (pass) or 1."),
    interval: float = typer.Option(60.0, "--interval", min=1.0, help="Seconds between rounds."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's answer as JSON."),
) -> None:
    """Run the node agent: attest this node's TPM, event log and GPU inventory to the server."""
    if collect_inventory:
        try:
            print_json(nvml.collect())
        except nvml.NvmlError as exc:
            raise CliError(f"proofplane agent: {exc.message}", exit_code=1) from None
        return
    missing = [f"--{n}" for n, v in (("server", server), ("token", token), ("node", node)) if not v]
    if missing:
        raise CliError(f"proofplane agent: missing {', '.join(missing)}", exit_code=2)
    assert server is not None and token is not None and node is not None
    recorded = _read_inventory(inventory)
    with tempfile.TemporaryDirectory(prefix="proofplane-agent-") as tmp, ApiClient(
        server, token=token
    ) as api:  # fmt: skip
        tpm = Tpm(tcti, Path(tmp))
        while True:
            inv = recorded if inventory is not None else gpu_inventory(None)
            result = attest_once(api, node, tpm, ak=ak, ek=ek, eventlog=_read_eventlog(eventlog),
                                 inventory=inv)  # fmt: skip
            verdict = result["verdict"]
            if as_json:
                print_json(result)
            else:
                status = "accepted" if verdict["ok"] else "REJECTED " + ",".join(verdict["reasons"])
                print_line(f"node {node}: attestation {status}; state {result['state']}")
            if once:
                if not verdict["ok"]:
                    raise typer.Exit(1)
                return
            time.sleep(interval)
