"""Software TPMs for the demo, tests and benchmarks: swtpm (socket mode) driven by tpm2-tools.

Unlike :mod:`proofplane.attest.simulate`, this is a real TPM 2.0 implementation (libtpms) in
its own process: its EK lives in the TPM, quotes come from ``tpm2_quote`` and enrollment needs
``tpm2_activatecredential``. It still proves nothing about a machine's firmware: the PCRs are
extended by us, from an event log (``measure``), as firmware would extend them.

``manufacture`` makes a TPM state (EK + EK certificate from a throwaway local CA, persistent
AKs); ``SwtpmNode.start`` runs a swtpm process on a copy of that state on a free port pair, so
each node starts with PCRs reset. The process is owned (no --daemon): ``stop`` ends it, and a
failing caller cannot leave it holding its ports. Every tool call flushes transient objects and
sessions afterwards (there is no resource manager on the swtpm TCTI).

The module runs processes: it is an edge of ``attest``, not part of its pure core.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proofplane.agent.tpm.tpm2tools import EK_CERT_NV_INDEX, Tpm, TpmToolError
from proofplane.attest import eventlog as el
from proofplane.attest.facts import analyze_eventlog

TOOLS = (
    "swtpm",
    "swtpm_setup",
    "swtpm_localca",
    "tpm2_createak",
    "tpm2_quote",
    "tpm2_pcrextend",
    "tpm2_readpublic",
    "tpm2_evictcontrol",
    "tpm2_flushcontext",
    "tpm2_nvread",
    "tpm2_eventlog",
)
#: what a node agent on a swtpm needs besides manufacturing it (``proofplane.cli.agent``)
AGENT_TOOLS = (
    *[t for t in TOOLS if t != "tpm2_eventlog"],
    "tpm2_startauthsession",
    "tpm2_policysecret",
    "tpm2_activatecredential",
)
EK_HANDLE = "0x81010001"
AK_HANDLES = {"ecc": "0x81010002", "rsa": "0x81010003", "rogue": "0x81010004"}
_AK_KINDS = {"ecc": ("ecc", "ecdsa"), "rsa": ("rsa", "rsassa"), "rogue": ("ecc", "ecdsa")}


def missing_tools(tools: tuple[str, ...] = TOOLS) -> list[str]:
    """The programs of ``tools`` that are not on PATH."""
    return [t for t in tools if shutil.which(t) is None]


def _free_port_pair() -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise TpmToolError("no free port pair for swtpm")


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> bytes:
    proc = subprocess.run(args, capture_output=True, env=env, cwd=cwd, timeout=60, check=False)
    if proc.returncode != 0:
        raise TpmToolError(
            f"{' '.join(args)} failed ({proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout


@dataclass
class SwtpmNode:
    """One running swtpm with the manufactured keys; ``workdir`` holds its files."""

    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    tpm: Tpm | None = None  # tpm2-tools against this swtpm, once it runs

    # --- lifecycle --------------------------------------------------------------------------
    @classmethod
    def start(cls, template: Path, workdir: Path) -> SwtpmNode:
        """Start a swtpm on a copy of the manufactured ``template`` state."""
        workdir.mkdir(parents=True, exist_ok=True)
        state = workdir / "state"
        if state.exists():
            shutil.rmtree(state)
        shutil.copytree(template / "state", state)
        node = cls(workdir)
        node._launch()
        return node

    @property
    def tcti(self) -> str:
        """The tpm2-tools TCTI of this TPM (``TPM2TOOLS_TCTI``, the agent's ``--tcti``)."""
        return f"swtpm:host=127.0.0.1,port={self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _launch(self) -> None:
        for _attempt in range(5):
            port = _free_port_pair()
            proc = subprocess.Popen(
                [
                    "swtpm", "socket", "--tpm2",
                    "--tpmstate", f"dir={self.workdir / 'state'}",
                    "--server", f"type=tcp,port={port},bindaddr=127.0.0.1",
                    "--ctrl", f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
                    "--flags", "not-need-init,startup-clear",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.02)
            if proc.poll() is None:
                self.port, self.proc = port, proc
                self.tpm = Tpm(self.tcti, self.workdir)
                return
            proc.wait()  # lost the port race: try another pair
            if proc.stderr is not None:
                proc.stderr.close()
        raise TpmToolError("swtpm did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        """Stop and start the same state (a TPM reboot: PCRs reset, resetCount + 1)."""
        self.stop()
        self._launch()

    # --- tools (tpm2-tools through :class:`proofplane.agent.tpm.tpm2tools.Tpm`) ------------------
    def _tools(self) -> Tpm:
        if self.tpm is None:
            raise TpmToolError("swtpm is not running")
        return self.tpm

    def tool(self, *args: str) -> bytes:
        """Run one tpm2-tools command against this TPM; its stdout."""
        return self._tools().run(*args)

    def read_public(self, handle: str) -> bytes:
        """TPM2B_PUBLIC of a persistent object."""
        return self._tools().read_public(handle)

    def ek_certificate(self) -> bytes:
        """The RSA EK certificate (DER) that swtpm_setup stored in NV index 0x01c00002."""
        der = self._tools().nv_certificate(EK_CERT_NV_INDEX)
        if der is None:
            raise TpmToolError(f"no EK certificate in NV index {EK_CERT_NV_INDEX}")
        return der

    def extend(self, events: list[tuple[int, dict[str, bytes]]]) -> None:
        """Extend PCRs: ``[(pcr, {bank: digest, …}), …]`` in order."""
        self._tools().extend(events)

    def activate_credential(self, credential_file: bytes, ak: str = "ecc") -> bytes:
        """TPM2_ActivateCredential with the AK (``AK_HANDLES`` kind) and the EK."""
        return self._tools().activate(credential_file, AK_HANDLES[ak], EK_HANDLE)

    def quote(
        self, nonce: bytes, pcrs: list[int], *, ak: str = "ecc", bank: str = "sha256"
    ) -> tuple[bytes, bytes, dict[str, dict[int, bytes]]]:
        """(TPMS_ATTEST, TPMT_SIGNATURE, {bank: {pcr: value}}) from tpm2_quote."""
        return self._tools().quote(nonce, bank, pcrs, AK_HANDLES[ak])


def manufacture(template: Path, aks: tuple[str, ...] = ("ecc", "rsa", "rogue")) -> Path:
    """Make a TPM state under ``template``: EK (+ cert signed by a local CA in template/ca) and
    the persistent AKs named in ``aks`` (``AK_HANDLES``: an ECC AK, an RSA AK, a second "rogue"
    ECC AK). Returns ``template``."""
    template.mkdir(parents=True, exist_ok=True)
    ca, state = template / "ca", template / "state"
    ca.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    (template / "localca.conf").write_text(
        f"statedir = {ca}\nsigningkey = {ca}/signkey.pem\n"
        f"issuercert = {ca}/issuercert.pem\ncertserial = {ca}/certserial\n"
    )
    (template / "localca.options").write_text(
        "--platform-manufacturer proofplane\n--platform-version 2.1\n--platform-model test\n"
    )
    localca = shutil.which("swtpm_localca") or "/usr/bin/swtpm_localca"
    (template / "setup.conf").write_text(
        f"create_certs_tool = {localca}\n"
        f"create_certs_tool_config = {template}/localca.conf\n"
        f"create_certs_tool_options = {template}/localca.options\n"
        "active_pcr_banks = sha1,sha256\n"
    )
    _run([
        "swtpm_setup", "--tpm2", "--tpmstate", str(state), "--config",
        str(template / "setup.conf"), "--create-ek-cert", "--create-platform-cert",
        "--lock-nvram", "--overwrite", "--pcr-banks", "sha1,sha256",
    ])  # fmt: skip
    node = SwtpmNode(template)
    node._launch()
    try:
        for kind in aks:
            alg, scheme = _AK_KINDS[kind]
            ctx = template / f"ak-{kind}.ctx"
            node.tool("tpm2_createak", "-C", EK_HANDLE, "-c", str(ctx), "-G", alg,
                      "-g", "sha256", "-s", scheme)  # fmt: skip
            node.tool("tpm2_evictcontrol", "-C", "o", "-c", str(ctx), AK_HANDLES[kind])
    finally:
        node.stop()
    return template


# --- a measured boot to replay into a TPM -----------------------------------------------------


def measure(node: SwtpmNode, log_blob: bytes) -> None:
    """Extend the node's PCRs with every extended event of a log (what firmware would do)."""
    log = el.parse_eventlog(log_blob)
    node.extend([
        (ev.pcr, {b: d for b, d in ev.digests.items() if b in ("sha1", "sha256")})
        for ev in log.events if ev.extended
    ])  # fmt: skip


def boot_log(kernel: bytes = b"vmlinuz-6.1.0-proofplane", secure_boot: bool = True) -> bytes:
    """A synthetic crypto-agile (sha1+sha256) log of a plausible UEFI + shim + grub boot."""

    def var(name: str, data: bytes, guid: Any = el.EFI_GLOBAL_VARIABLE) -> bytes:
        return el.encode_efi_variable(guid, name, data)

    def app(tag: bytes) -> tuple[bytes, dict[str, bytes]]:
        # a boot application's digest is its Authenticode hash, not H(event data)
        data = struct.pack("<QQQQ", 0x7E000000, 0x100000, 0, 4) + b"\x7f\xff\x04\x00"
        return data, {"sha1": hashlib.sha1(tag).digest(), "sha256": hashlib.sha256(tag).digest()}

    shim, shim_d = app(b"shimx64.efi 15.7")
    grub, grub_d = app(b"grubx64.efi 2.06")
    kern_d = {"sha1": hashlib.sha1(kernel).digest(), "sha256": hashlib.sha256(kernel).digest()}
    events: list[tuple[Any, ...]] = [
        (0, el.EV_S_CRTM_VERSION, "1.0".encode("utf-16-le") + b"\0\0"),
        (0, el.EV_EFI_PLATFORM_FIRMWARE_BLOB, struct.pack("<QQ", 0xFFC00000, 0x400000)),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("SecureBoot", bytes([int(secure_boot)]))),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("PK", b"pk-cert")),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("KEK", b"kek-cert")),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("db", b"db", el.EFI_IMAGE_SECURITY_DATABASE)),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("dbx", b"dbx", el.EFI_IMAGE_SECURITY_DATABASE)),
        *[(pcr, el.EV_SEPARATOR, b"\0\0\0\0") for pcr in range(8)],
        (1, el.EV_EFI_VARIABLE_BOOT, var("BootOrder", b"\x01\x00")),
        (4, el.EV_EFI_ACTION, b"Calling EFI Application from Boot Option"),
        (4, el.EV_EFI_BOOT_SERVICES_APPLICATION, shim, shim_d),
        (7, el.EV_EFI_VARIABLE_AUTHORITY, var("db", b"signer", el.EFI_IMAGE_SECURITY_DATABASE)),
        (4, el.EV_EFI_BOOT_SERVICES_APPLICATION, grub, grub_d),
        (8, el.EV_IPL, b"grub_cmd: linux /vmlinuz root=/dev/sda1\0"),
        (9, el.EV_IPL, b"/boot/" + kernel + b"\0", kern_d),
        (8, el.EV_IPL, b"kernel_cmdline: /vmlinuz root=/dev/sda1\0"),
        (5, el.EV_EFI_ACTION, b"Exit Boot Services Invocation"),
        (5, el.EV_EFI_ACTION, b"Exit Boot Services Returned with Success"),
    ]
    return el.build_eventlog(events, banks=("sha1", "sha256"))


def measured_boot_policy(
    log_blob: bytes,
    node_class: str,
    *,
    policy_id: str | None = None,
    pcrs: tuple[int, ...] = tuple(range(10)),
    bank: str = "sha256",
) -> dict[str, Any]:
    """The policy (JSON form) that a node booting exactly ``log_blob`` satisfies: Secure Boot
    on, its boot applications and kernels allowed, golden values of ``pcrs`` from the log's
    replay. GPU rules are the caller's to add."""
    log = el.parse_eventlog(log_blob)
    golden = el.replay(log, [bank])[bank]
    apps = {e.digests[bank].hex() for e in log.events
            if e.type == el.EV_EFI_BOOT_SERVICES_APPLICATION and e.pcr == 4}  # fmt: skip
    kernels = {d.hex() for _n, _path, d in analyze_eventlog(log_blob, bank).kernels}
    return {
        "id": policy_id or f"{node_class}-measured-boot",
        "node_class": node_class,
        "pcr_bank": bank,
        "golden_pcrs": {str(i): [golden[i].hex()] for i in pcrs if i in golden},
        "require_eventlog": True,
        "require_secure_boot": True,
        "allowed_boot_apps": sorted(apps),
        "allowed_kernels": sorted(kernels),
    }
