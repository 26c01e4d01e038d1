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

``--apply-network`` runs the network rounds instead (issue 14): fetch the node's desired
network state (``GET /api/v1/nodes/{name}/network``), apply it (:mod:`proofplane.agent.network`;
``--netns NAME``: inside that network namespace), and report the applied generation, the
hashes and the self-check (``POST …/network/report``). With ``--underlay-dev`` (and ``--vtep``,
default the device's first IPv4 address) the agent registers its underlay first. ``--once``
exits 0 when the self-check passed, 1 otherwise.
Telemetry (issue 15): with ``--telemetry`` the agent also posts its GPUs' and MIG instances'
readings every ``--telemetry-interval`` seconds (15) to ``POST /api/v1/nodes/{name}/telemetry``,
read through NVML (:mod:`proofplane.agent.telemetry`), or scraped from the site's
dcgm-exporter with ``--dcgm-url URL``; ``--collect-telemetry`` prints one read (JSON, the
posted form) and exits. A failed post is reported on stderr and the next interval tries again
(readings are not queued: the server stores a re-sent reading once).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import typer

from proofplane.agent import channel
from proofplane.agent import telemetry as collectors
from proofplane.agent.tpm.tpm2tools import Tpm, TpmToolError
from proofplane.attest import Evidence
from proofplane.cli.client import ApiClient, ApiError, CliError, ServerUnreachable, segment
from proofplane.cli.render import print_json, print_line
from proofplane.hardware import nvml
from proofplane.meter.samples import Sample, to_wire
from proofplane.workers.base import Worker

DEFAULT_EVENTLOG = Path("/sys/kernel/security/tpm0/binary_bios_measurements")
EK_HANDLE = "0x81010001"
AK_HANDLE = "0x81010002"
# The server's answer to a bearer agent credential once the node holds a certificate (mutual
# TLS; service/pki.py's CERTIFICATE_REQUIRED: the agent talks to the server over the API only).
CERTIFICATE_REQUIRED = "agent_certificate_required"


class TpmError(CliError):
    """A TPM tool failed during an agent round (exit code 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"proofplane agent: {message}", exit_code=1)


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
    cert_dir: Path | None = typer.Option(
        None,
        "--cert-dir",
        envvar="PROOFPLANE_AGENT_CERT_DIR",
        help="Keep a channel certificate here: after each passing round the agent asks for "
        "one (its key never leaves this directory) and then connects with it instead of the "
        "bearer credential.",
    ),
    apply_network: bool = typer.Option(
        False,
        "--apply-network",
        help="Apply this node's desired network state (segments, FDB, ruleset) and report it, "
        "instead of attesting.",
    ),
    netns: str | None = typer.Option(
        None, "--netns", help="With --apply-network: apply inside this network namespace."
    ),
    underlay_dev: str | None = typer.Option(
        None,
        "--underlay-dev",
        help="With --apply-network: register this node's underlay device (and --vtep) first.",
    ),
    vtep: str | None = typer.Option(
        None, "--vtep", help="The VTEP address (default: the underlay device's first IPv4)."
    ),
    hca_guid: list[str] = typer.Option(
        [], "--hca-guid", help="An HCA port GUID to register with the underlay (repeatable)."
    ),
    state_dir: Path = typer.Option(
        Path("/run/proofplane-agent"),
        "--state-dir",
        help="With --apply-network: where the agent keeps what it applied (the ruleset's "
        "listing hash, the generation) between runs.",
    ),
    telemetry: bool = typer.Option(
        False,
        "--telemetry",
        help="Also post GPU and MIG-instance telemetry (NVML, or --dcgm-url) every "
        "--telemetry-interval seconds.",
    ),
    dcgm_url: str | None = typer.Option(
        None,
        "--dcgm-url",
        envvar="PROOFPLANE_DCGM_URL",
        help="Scrape this dcgm-exporter (e.g. http://127.0.0.1:9400/metrics) for telemetry "
        "instead of reading NVML (implies --telemetry).",
    ),
    telemetry_interval: float = typer.Option(
        15.0, "--telemetry-interval", min=1.0, help="Seconds between telemetry posts."
    ),
    collect_telemetry: bool = typer.Option(
        False,
        "--collect-telemetry",
        help="Print one telemetry read (JSON, as posted) and exit.",
    ),
    once: bool = typer.Option(False, "--once", help="One round, then exit 0 (pass) or 1."),
    interval: float = typer.Option(60.0, "--interval", min=0.2, help="Seconds between rounds."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's answer as JSON."),
) -> None:
    """Run the node agent: attest this node's TPM, event log and GPU inventory to the server
    (or, with --apply-network, apply its desired network state)."""
    if collect_inventory:
        try:
            print_json(nvml.collect())
        except nvml.NvmlError as exc:
            raise CliError(f"proofplane agent: {exc.message}", exit_code=1) from None
        return
    if collect_telemetry:
        source = telemetry_source(dcgm_url)
        try:
            print_json(to_wire(source.read(node or "this-node", datetime.now(UTC))))
        except (nvml.NvmlError, httpx.HTTPError, ValueError) as exc:
            raise CliError(f"proofplane agent: cannot read telemetry: {exc}", exit_code=1) from None
        finally:
            source.close()
        return
    missing = [f"--{n}" for n, v in (("server", server), ("token", token), ("node", node)) if not v]
    if missing:
        raise CliError(f"proofplane agent: missing {', '.join(missing)}", exit_code=2)
    assert server is not None and token is not None and node is not None
    if apply_network:
        underlay = None
        if underlay_dev is not None:
            underlay = {"underlay_dev": underlay_dev, "vtep": vtep, "hca_guids": hca_guid}
        run_network(
            server, token, node, cert_dir,
            netns=netns, state_dir=state_dir, underlay=underlay,
            once=once, interval=interval, as_json=as_json,
        )  # fmt: skip
        return
    recorded = _read_inventory(inventory)
    poster = None
    if telemetry or dcgm_url:
        poster = TelemetryPoster(
            server, token, node, cert_dir, telemetry_source(dcgm_url), telemetry_interval
        )
        if not once:
            poster.start()
    with tempfile.TemporaryDirectory(prefix="proofplane-agent-") as tmp, _stopping(poster):
        tpm = Tpm(tcti, Path(tmp))
        while True:
            inv = recorded if inventory is not None else gpu_inventory(None)
            try:
                log = _read_eventlog(eventlog)
                attest = functools.partial(
                    attest_once, node=node, tpm=tpm, ak=ak, ek=ek, eventlog=log, inventory=inv
                )
                result = attest_round(server, token, node, cert_dir, attest)
            except (TpmToolError, ServerUnreachable, ApiError) as exc:
                error = TpmError(exc.message) if isinstance(exc, TpmToolError) else exc
                if once or not _transient(exc):
                    raise error from None
                typer.echo(f"{error.message}; next round in {interval:g} s", err=True)
                time.sleep(interval)
                continue
            verdict = result["verdict"]
            if as_json:
                print_json(result)
            else:
                status = "accepted" if verdict["ok"] else "REJECTED " + ",".join(verdict["reasons"])
                print_line(f"node {node}: attestation {status}; state {result['state']}")
            if once:
                if poster is not None:
                    poster.tick()
                    if poster.last_error:
                        typer.echo(f"proofplane agent: telemetry: {poster.last_error}", err=True)
                if not verdict["ok"]:
                    raise typer.Exit(1)
                return
            time.sleep(interval)


def attest_round(
    server: str,
    token: str,
    node: str,
    cert_dir: Path | None,
    attest: Callable[[ApiClient], dict[str, Any]],
) -> dict[str, Any]:
    """One round (``attest`` on a connection) over the channel the agent should use now, and a
    certificate renewal after a passing one (with ``cert_dir``). It falls back once, at once:
    a certificate the server refuses (revoked, or the node's latest attestation failed) is set
    aside and the round runs on the bearer credential; a bearer credential the server refuses
    because the node holds a certificate (``agent_certificate_required``: a mutual-TLS server,
    and this agent lost its certificate) asks for a new certificate with the credential, the
    one thing it may still do, and the round runs on that."""
    for last in (False, True):
        with_cert = channel.current(cert_dir) is not None
        try:
            with _client(server, token, cert_dir) as api:
                result = attest(api)
                if cert_dir is not None and result["verdict"]["ok"]:
                    renew_certificate(api, node, cert_dir)
                return result
        except ApiError as exc:
            if last:
                raise
            if with_cert and exc.status == 401:
                continue  # set aside by _CertClient: the credential now
            if with_cert or exc.code != CERTIFICATE_REQUIRED:
                raise
            if cert_dir is None:
                raise CliError(
                    f"proofplane agent: node {node} holds an agent certificate and this server "
                    "takes the agent credential only to enroll and to issue certificates: run "
                    "the agent with --cert-dir",
                    exit_code=1,
                ) from None
            with ApiClient(server, token=token) as api:
                renew_certificate(api, node, cert_dir)
    raise AssertionError("unreachable")  # pragma: no cover


def _client(server: str, token: str, cert_dir: Path | None) -> ApiClient:
    """The connection for a round: with a valid channel certificate, that certificate (no
    bearer credential); else the agent credential. A certificate the server refuses
    (revoked: the node was quarantined) is set aside, so the next round uses the credential."""
    cert = channel.current(cert_dir)
    if cert is None:
        return ApiClient(server, token=token)
    return _CertClient(server, cert, cert_dir)


class _CertClient(ApiClient):
    def __init__(self, server: str, cert: tuple[str, str], cert_dir: Path | None) -> None:
        super().__init__(server, client_cert=cert)
        self.cert_dir = cert_dir

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        try:
            return super().request(method, path, params=params, body=body)
        except ApiError as exc:
            if exc.status == 401 and self.cert_dir is not None:
                (self.cert_dir / channel.CERT_FILE).unlink(missing_ok=True)
            raise


def renew_certificate(api: ApiClient, node: str, cert_dir: Path) -> dict[str, Any]:
    """Ask for a channel certificate after a passing round (a CSR with the agent's own key)."""
    issued = api.post(
        f"/api/v1/nodes/{segment(node)}/agent-certificate",
        {"csr": channel.make_csr(cert_dir, node)},
    )
    channel.store_certificate(cert_dir, issued["certificate"], issued["ca"])
    return issued  # type: ignore[no-any-return]


def _transient(exc: Exception) -> bool:
    """Whether a long-running agent should try the round again later: the TPM or the server
    may come back (a tool failure, no connection, a server error, rate limiting). Any other
    API error (a revoked credential, an unknown node) needs an operator: the agent exits."""
    if isinstance(exc, ApiError):
        return exc.status >= 500 or exc.status == 429
    return True


# --------------------------------------------------------------------------- network (issue 14)

NETWORK_UNKNOWN = "network_underlay_unknown"


def network_round(api: ApiClient, node: str, net: Any) -> dict[str, Any]:
    """One network round on ``api``: fetch, apply (``net``: an agent.network.NetworkAgent),
    report. What it did, with the server's answer (the node's network status)."""
    from proofplane.agent.network import NOTHING_APPLIED, report_body

    base = f"/api/v1/nodes/{segment(node)}/network"
    doc = api.get(base, params={"format": "json"})
    generation, result = net.apply_document(doc)
    if generation is not None and result.desired_sha256 is not None:
        net.remember(generation, result)
        applied = (generation, result.desired_sha256)
    else:  # nothing applied: say what the node last applied
        last_gen, last_sha = net.applied
        applied = (last_gen or 0, last_sha or NOTHING_APPLIED)
    status = api.post(f"{base}/report", report_body(applied[0], applied[1], result))
    return {
        "node": node,
        "generation": applied[0],
        "applied_sha256": applied[1],
        "changes": result.changes,
        "seconds": round(result.seconds, 4),
        "self_check": result.self_check,
        "status": status,
    }


def register_underlay(
    api: ApiClient, node: str, netns: str | None, underlay: dict[str, Any]
) -> Any:
    """``PUT /nodes/{name}/network/underlay`` with the device, its VTEP (read from the device
    when not given) and the HCA GUIDs."""
    from proofplane.agent.network import Host

    body = dict(underlay)
    if not body.get("vtep"):
        body["vtep"] = Host(netns).first_ipv4(str(body["underlay_dev"]))
        if body["vtep"] is None:
            raise CliError(
                f"proofplane agent: {body['underlay_dev']} has no IPv4 address: pass --vtep",
                exit_code=2,
            )
    return api.request("PUT", f"/api/v1/nodes/{segment(node)}/network/underlay", body=body)


def run_network(
    server: str,
    token: str,
    node: str,
    cert_dir: Path | None,
    *,
    netns: str | None,
    state_dir: Path | None,
    underlay: dict[str, Any] | None,
    once: bool,
    interval: float,
    as_json: bool,
) -> None:
    """The network rounds: one with ``once`` (exit 1 when the self-check failed), else one
    every ``interval`` seconds, riding out a server that is away or busy and a node whose
    underlay is not registered yet."""
    from proofplane.agent.network import NetworkAgent

    net = NetworkAgent(netns, state_dir=state_dir)
    registered = underlay is None
    while True:
        try:
            with _client(server, token, cert_dir) as api:
                if not registered:
                    assert underlay is not None
                    register_underlay(api, node, netns, underlay)
                    registered = True
                out = network_round(api, node, net)
        except (ServerUnreachable, ApiError) as exc:
            if isinstance(exc, ApiError) and exc.code == NETWORK_UNKNOWN and underlay:
                registered = False
            waiting = isinstance(exc, ApiError) and exc.code == NETWORK_UNKNOWN
            if once or not (waiting or _transient(exc)):
                raise
            typer.echo(f"{exc.message}; next round in {interval:g} s", err=True)
            time.sleep(interval)
            continue
        if as_json:
            print_json(out)
        else:
            print_line(_network_line(out))
        if once:
            if not out["self_check"].get("ok"):
                raise typer.Exit(1)
            return
        time.sleep(interval)


def _network_line(out: dict[str, Any]) -> str:
    changed = ", ".join(f"{k} {v}" for k, v in out["changes"].items() if v) or "no change"
    check = out["self_check"]
    verdict = "ok" if check.get("ok") else "FAILED " + ",".join(check.get("reasons", []))
    return (
        f"node {out['node']}: network generation {out['generation']} "
        f"({changed}; {out['seconds']:.2f} s); self-check {verdict}"
    )


# --- telemetry (issue 15) ---------------------------------------------------------------------

#: readings per post: well under the server's 20,000 and its 1 MiB body
POST_READINGS = 5000


class _Source:
    """A collector with ``read(node, now)`` and ``close()``."""

    def __init__(self, read: Any, close: Any) -> None:
        self.read = read
        self.close = close


def telemetry_source(dcgm_url: str | None, nvml_module: Any = None) -> _Source:
    """The node's telemetry: a dcgm-exporter scrape (MIG instances named by their start where
    NVML can say it), else NVML."""
    if dcgm_url:
        try:
            starts = collectors.mig_starts(nvml.collect(nvml_module))
        except nvml.NvmlError:
            starts = {}
        scrape = collectors.DcgmScrape(dcgm_url, starts=starts)
        return _Source(scrape.read, lambda: None)
    reader = collectors.NvmlTelemetry(nvml_module)
    return _Source(reader.read, reader.close)


def post_telemetry(
    api: ApiClient, node: str, samples: list[Sample], *, chunk: int = POST_READINGS
) -> dict[str, Any]:
    """Post ``samples`` in batches of at most ``chunk`` readings; the answers summed."""
    total: dict[str, Any] = {"node": node, "accepted": 0, "stored": 0, "ignored": {},
                             "drained": []}  # fmt: skip
    for i in range(0, len(samples), chunk):
        out = api.post(f"/api/v1/nodes/{segment(node)}/telemetry", to_wire(samples[i : i + chunk]))
        total["accepted"] += out["accepted"]
        total["stored"] += out["stored"]
        for reason, n in out["ignored"].items():
            total["ignored"][reason] = total["ignored"].get(reason, 0) + n
        total["drained"] += out["drained"]
    return total


class TelemetryPoster(Worker):
    """Reads the node's telemetry and posts it, every ``interval_s``, on its own thread (the
    attestation rounds keep their own pace). A failed pass is reported on stderr."""

    leader_only = False

    def __init__(
        self,
        server: str,
        token: str,
        node: str,
        cert_dir: Path | None,
        source: _Source,
        interval_s: float,
    ) -> None:
        super().__init__("agent-telemetry", interval_s, run_at_start=True,
                         backoff_cap_s=max(interval_s, 300.0))  # fmt: skip
        self.server, self.token, self.node, self.cert_dir = server, token, node, cert_dir
        self.source = source
        self.last: dict[str, Any] | None = None

    def run_once(self) -> dict[str, Any]:
        samples = self.source.read(self.node, datetime.now(UTC))
        with _client(self.server, self.token, self.cert_dir) as api:
            self.last = post_telemetry(api, self.node, samples)
        for d in self.last["drained"]:
            typer.echo(f"proofplane agent: GPU {d['gpu_uuid']} drained: {d['message']}", err=True)
        return self.last

    def on_error(self, exc: Exception) -> None:
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        typer.echo(f"proofplane agent: telemetry post failed: {message}", err=True)

    def stop(self, timeout_s: float | None = None) -> None:
        try:
            super().stop(timeout_s)
        finally:
            self.source.close()


@contextlib.contextmanager
def _stopping(poster: TelemetryPoster | None) -> Iterator[None]:
    try:
        yield
    finally:
        if poster is not None:
            poster.stop()
