"""``proofplane agent``: the node agent. One round: enroll if the AK is not bound yet
(MakeCredential challenge answered with ``tpm2_activatecredential``), take a nonce, quote the
PCRs the policy wants with the AK, attach the measured-boot event log and the GPU inventory,
and submit. ``--once`` runs one round and exits 0 (accepted) or 1 (rejected).

TPM access goes through tpm2-tools with a configurable TCTI (``device:/dev/tpmrm0`` on real
nodes, ``swtpm:host=127.0.0.1,port=P`` in tests). Transient objects and sessions are flushed
after every tool call: the swtpm TCTI has no resource manager.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
import yaml

from proofplane.attest import Evidence
from proofplane.cli.client import ApiClient, ApiError, CliError, segment
from proofplane.cli.render import print_json, print_line

DEFAULT_EVENTLOG = Path("/sys/kernel/security/tpm0/binary_bios_measurements")
EK_HANDLE = "0x81010001"
AK_HANDLE = "0x81010002"
EK_CERT_NV_INDEX = "0x01c00002"
BANK_SIZES = {"sha1": 20, "sha256": 32, "sha384": 48, "sha512": 64}


class TpmError(CliError):
    def __init__(self, message: str) -> None:
        super().__init__(f"proofplane agent: {message}", exit_code=1)


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

    def ek_certificate(self) -> bytes | None:
        """The EK certificate from its NV index, cut to its DER length; None if absent."""
        out = self.workdir / "ekcert.der"
        try:
            self.run("tpm2_nvread", EK_CERT_NV_INDEX, "-o", str(out))
        except TpmError:
            return None
        blob = out.read_bytes()
        if len(blob) < 4 or blob[0] != 0x30 or blob[1] < 0x80:
            return blob
        n = blob[1] & 0x7F
        return blob[: 2 + n + int.from_bytes(blob[2 : 2 + n], "big")]

    def activate(self, credential_file: bytes, ak: str, ek: str) -> bytes:
        cred, out = self.workdir / "cred.in", self.workdir / "cred.out"
        session = self.workdir / "session.ctx"
        cred.write_bytes(credential_file)
        script = (
            f"set -e; tpm2_startauthsession --policy-session -S {session}; "
            f"tpm2_policysecret -S {session} -c e >/dev/null; "
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
    cert = tpm.ek_certificate()
    challenge = api.post(
        f"{base}/enroll",
        {
            "ek_public": _b64(tpm.read_public(ek)),
            "ak_public": _b64(tpm.read_public(ak)),
            "ek_certificate": None if cert is None else _b64(cert),
        },
    )
    secret = tpm.activate(base64.b64decode(challenge["credential"]), ak, ek)
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
    server: str = typer.Option(..., "--server", envvar="PROOFPLANE_SERVER", help="API URL."),
    token: str = typer.Option(
        ..., "--token", envvar="PROOFPLANE_AGENT_TOKEN", help="The node's agent credential."
    ),
    node: str = typer.Option(..., "--node", envvar="PROOFPLANE_NODE", help="This node's name."),
    tcti: str = typer.Option("device:/dev/tpmrm0", "--tcti", help="tpm2-tools TCTI."),
    eventlog: Path | None = typer.Option(
        None, "--eventlog", help=f"Binary event log (default {DEFAULT_EVENTLOG} if present)."
    ),
    inventory: Path | None = typer.Option(
        None, "--inventory", help="Recorded NVML inventory (JSON) to send."
    ),
    ak: str = typer.Option(AK_HANDLE, "--ak-handle", help="Persistent handle of the AK."),
    ek: str = typer.Option(EK_HANDLE, "--ek-handle", help="Persistent handle of the RSA EK."),
    once: bool = typer.Option(False, "--once", help="One round, then exit 0 (pass) or 1."),
    interval: float = typer.Option(60.0, "--interval", min=1.0, help="Seconds between rounds."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's answer as JSON."),
) -> None:
    """Run the node agent: attest this node's TPM, event log and GPU inventory to the server."""
    inv = _read_inventory(inventory)
    with tempfile.TemporaryDirectory(prefix="proofplane-agent-") as tmp, ApiClient(
        server, token=token
    ) as api:  # fmt: skip
        tpm = Tpm(tcti, Path(tmp))
        while True:
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
