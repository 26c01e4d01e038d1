"""Benchmark: a fleet of node agents attesting against a real ``proofplane serve`` on
PostgreSQL (issue 20), with console reads and a trickle of workload submissions beside them.

Setup (not timed; ``setup_s``): a throwaway PostgreSQL database (on ``--db``, default the test
server) with ``--agents`` registered nodes (one H100 each) loaded in bulk through the cluster
loader (``service.cluster.load_cluster``, what ``proofplane cluster load`` runs), the demo's
enforcing measured-boot policy, an admin token and, for each node, the agent credential its
agent presents (``service.access.issue_agent_credential``, what ``proofplane nodes
agent-credential`` runs; all in one transaction). Each agent is a software TPM (ECC P-256 EK
and AK, PCRs from the demo's synthetic boot log): ECC keys take microseconds to make, where
10,000 RSA-2048 EKs would take minutes; the server's work per enrollment is one ECDH instead of
one RSA encryption. Each agent authenticates with its own node's credential, as a real agent
does, so the server's per-client fairness (a client: a credential) sees a fleet of clients and
its token cache a fleet of tokens; ``--auth operator`` sends every agent's requests with the
one admin token instead (one client for the whole fleet, held to its share of the attestation
slots). One ``proofplane serve`` (``--workers`` when serve takes it), access logs to
/dev/null, the staleness check every ``--stale-check`` s with a grace of ``--grace`` s.

Timed, over HTTP with the server's real verifier:

1. **enrollment** — every agent enrolls once (``enroll`` → MakeCredential answered by the
   software EK → ``activate`` → ``nonce`` → ``evidence``; a passing round admits the node),
   ``--enroll-concurrency`` at a time: nodes/s and per-request latency.
2. **steady** — for ``--duration`` s each agent attests every ``--interval`` s ± ``--jitter``
   (its first round at a random offset: a fleet, not a thundering herd), each round ``nonce`` +
   ``evidence``, a request refused for overload sent again as ``proofplane agent``'s API client
   does (Retry-After, doubling, jitter, within its retry budget; ``rounds_given_up``: rounds
   still refused when it ran out); beside it ``--console-rate`` req/s of console reads (nodes, a
   node, workloads, events) and ``--submit-rate`` workload submissions/s, open loop. Rounds
   answered vs due, evidence submissions/s, per request type p50/p95/p99, errors and 429s, the
   generator's lateness, nodes quarantined (for staleness: their rounds came too late), and CPU
   seconds of each server process (/proc/<pid>/stat) and of this load generator
   (``generator_cpu_s``: it shares the machine, so what it spends the server does not have)
   during each phase; ``write_lock``: the database's one write lock over the steady phase,
   sampled from ``pg_locks`` (the share of samples it was held or waited for, backends waiting
   on average) and from the server's ``/metrics`` (write transactions per answered round, their
   mean ms from the write path's start to the commit, the wait for the lock included, and how
   many were in progress on average); ``postgres_cpu_s``: every ``postgres`` process's CPU
   over the steady phase, and ``cpu_bound_evidence_per_s``: the machine's usable cores over the
   CPU (server + PostgreSQL + generator) the phase spent per answered round, the rate past
   which the cores, not a lock, would bound the rounds.

    .venv/bin/python bench/fleet.py --json [--quick] [--agents 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import json
import random
import struct
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import (
    LockSampler,
    RawConn,
    Server,
    cpu_delta,
    gc_pauses,
    gc_pauses_delta,
    http_head,
    metrics_text,
    own_cpu_seconds,
    pct,
    process_cpu_seconds,
    serve_supports_workers,
    throwaway_postgres,
    usable_cores,
    write_lock,
    write_lock_delta,
)
from proofplane.access import SYSTEM
from proofplane.attest import eventlog as el
from proofplane.attest import tpm
from proofplane.attest.credential import CFB, TOOLS_MAGIC, kdfa, kdfe
from proofplane.attest.simulate import SoftTpm, demo_boot_log
from proofplane.cli.client import RETRY_BUDGET_S, RETRY_TRIES, backoff_s, retry_after_s
from proofplane.demo.attester import BOOTLOADERS, DEMO_POLICY, GOOD_KERNEL
from proofplane.hardware.cluster_file import ClusterSpec, NodeSpec, gpu_uuid
from proofplane.machine import machine
from proofplane.model import Gpu, Node, NodeState, Tenant
from proofplane.service.access import bootstrap_admin, issue_agent_credential
from proofplane.service.attestation import set_policy
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import NodeRow

TOKEN = "ppt_bench-fleet-token-0123456789abcdef0123"
TENANT = "fleet"
ENROLL_TRIES = 20
LATE_S = 30.0  # a round (or console request) this late is not sent: the run must end
API = "/api/v1"
# Issue 20's fleet figure: 10,000 agents every 60 s (~170 evidence submissions/s) beside 50
# console reads/s, every round answered, no node quarantined for staleness, evidence p99.
TARGETS: dict[str, float] = {
    "agents": 10000,
    "interval_s": 60.0,
    "console_rate_rps": 50.0,
    "rounds_unanswered": 0,
    "quarantined": 0,
    "evidence_p99_ms": 200.0,
}
CONSOLE = (
    ("console_nodes", f"{API}/nodes?limit=100"),
    ("console_node", None),  # a random node
    ("console_workloads", f"{API}/workloads"),
    ("console_events", f"{API}/events?limit=50"),
)


def node_name(i: int) -> str:
    return f"fleet-{i:05d}"


# --- the software agent --------------------------------------------------------------------


class EccAgent:
    """One node's attester in software: ECC P-256 EK (L-2 template attributes, AES-128-CFB)
    and AK, PCRs extended from the demo boot log (computed once, shared)."""

    def __init__(
        self, name: str, pcrs: dict[str, list[bytes]], eventlog: bytes, token: str | None
    ) -> None:
        self.name = name
        self.token = token  # what this agent presents: its credential (None: the admin token)
        self.ek = ec.generate_private_key(ec.SECP256R1())
        self.soft = SoftTpm(ec.generate_private_key(ec.SECP256R1()))
        self.soft.pcrs = {b: list(v) for b, v in pcrs.items()}
        self.eventlog = eventlog
        nums = self.ek.public_key().public_numbers()
        self.ek_x = nums.x.to_bytes(32, "big")
        attrs = (tpm.FIXED_TPM | tpm.FIXED_PARENT | tpm.SENSITIVE_DATA_ORIGIN
                 | tpm.ADMIN_WITH_POLICY | tpm.RESTRICTED | tpm.DECRYPT)  # fmt: skip
        self.ek_public = (
            struct.pack(">HHI", tpm.TPM_ALG_ECC, tpm.TPM_ALG_SHA256, attrs)
            + struct.pack(">H", 0)
            + struct.pack(">HHH", tpm.TPM_ALG_AES, 128, tpm.TPM_ALG_CFB)
            + struct.pack(">HHH", tpm.TPM_ALG_NULL, 3, tpm.TPM_ALG_NULL)  # NIST P-256
            + struct.pack(">H", 32) + self.ek_x
            + struct.pack(">H", 32) + nums.y.to_bytes(32, "big")
        )  # fmt: skip
        self.ak_public = self.soft.ak_public
        self.ak_name = tpm.parse_public(self.ak_public).name
        self.soft.signer_name = tpm.ak_qualified_name(
            tpm.parse_public(self.ek_public), tpm.parse_public(self.ak_public)
        )

    def activate(self, credential_file: bytes) -> bytes:
        """TPM2_ActivateCredential for an ECC EK: the seed from ECDH with the ephemeral point
        and KDFe, then the outer HMAC and the inner AES-CFB as for any EK."""
        rest = credential_file[8:]
        assert struct.unpack(">I", credential_file[:4])[0] == TOOLS_MAGIC
        size = int.from_bytes(rest[:2], "big")
        id_object, rest = rest[2 : 2 + size], rest[2 + size :]
        point = rest[2 : 2 + int.from_bytes(rest[:2], "big")]
        xl = int.from_bytes(point[:2], "big")
        qx = point[2 : 2 + xl]
        qy = point[4 + xl : 4 + xl + int.from_bytes(point[2 + xl : 4 + xl], "big")]
        eph = ec.EllipticCurvePublicNumbers(
            int.from_bytes(qx, "big"), int.from_bytes(qy, "big"), ec.SECP256R1()
        ).public_key()
        z = self.ek.exchange(ec.ECDH(), eph)
        seed = kdfe(tpm.TPM_ALG_SHA256, z, b"IDENTITY", qx, self.ek_x, 256)
        hmac_size = int.from_bytes(id_object[:2], "big")
        outer, enc_identity = id_object[2 : 2 + hmac_size], id_object[2 + hmac_size :]
        hmac_key = kdfa(tpm.TPM_ALG_SHA256, seed, b"INTEGRITY", b"", b"", 256)
        want = hmac.new(hmac_key, enc_identity + self.ak_name, "sha256").digest()
        assert hmac.compare_digest(want, outer), "credential not for this EK/AK"
        key = kdfa(tpm.TPM_ALG_SHA256, seed, b"STORAGE", self.ak_name, b"", 128)
        dec = Cipher(algorithms.AES(key), CFB(bytes(16))).decryptor()
        plain = dec.update(enc_identity) + dec.finalize()
        return plain[2 : 2 + int.from_bytes(plain[:2], "big")]

    def evidence(self, nonce: bytes, pcrs: list[int], bank: str) -> dict[str, Any]:
        quote, sig, values = self.soft.quote(nonce, pcrs, bank)
        b64 = base64.b64encode
        return {
            "quote": b64(quote).decode(),
            "signature": b64(sig).decode(),
            "pcrs": {b: {str(i): v.hex() for i, v in sorted(p.items())} for b, p in values.items()},
            "eventlog": b64(self.eventlog).decode(),
            "inventory": None,
        }


def boot_state() -> tuple[dict[str, list[bytes]], bytes]:
    """The PCRs after the demo's good boot (every agent boots the same image)."""
    log = demo_boot_log(GOOD_KERNEL, bootloaders=BOOTLOADERS)
    soft = SoftTpm(ec.generate_private_key(ec.SECP256R1()))
    soft.reboot()
    for ev in el.parse_eventlog(log).events:
        if ev.extended:
            soft.extend(ev.pcr, {b: d for b, d in ev.digests.items() if b in soft.pcrs})
    return soft.pcrs, log


# --- setup ---------------------------------------------------------------------------------


def prepare(url: str, agents: int) -> list[str]:
    """The cluster, the policy, the admin token; each node's agent credential, in order."""
    store = Store(url)
    try:
        migrate.upgrade(store.engine)
        nodes = tuple(
            NodeSpec(
                Node(
                    node_name(i),
                    "r1",
                    f"z{i % 8}",
                    rack=f"rack-{i // 40:04d}",
                    gpus=(Gpu(0, gpu_uuid(node_name(i), 0), "H100-80GB", 81920),),
                ),
                NodeState.REGISTERED,
                {},
            )  # fmt: skip
            for i in range(agents)
        )
        load_cluster(store, SYSTEM, ClusterSpec("fleet", (Tenant(TENANT),), nodes, ()))
        set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
        bootstrap_admin(store, TOKEN)
        with store.write(SYSTEM) as tx, store.joined(tx):  # the service call, one transaction
            return [
                issue_agent_credential(store, SYSTEM, node_name(i), ttl_days=1).token
                for i in range(agents)
            ]
    finally:
        store.dispose()


def node_states(url: str) -> dict[str, Any]:
    from sqlalchemy import func, select

    store = Store(url)
    try:
        with store.read() as s:
            rows = s.execute(select(NodeRow.state, func.count()).group_by(NodeRow.state))
            states = {state: int(n) for state, n in rows}
            reasons = list(
                s.scalars(
                    select(NodeRow.state_reason)
                    .where(NodeRow.state == NodeState.QUARANTINED.value)
                    .limit(3)
                )
            )
    finally:
        store.dispose()
    return {"states": states, "quarantined_reasons_sample": reasons}


# --- the load ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """A status, its body and its ``Retry-After`` (seconds, None: none)."""

    status_code: int
    body: bytes
    retry_after: float | None

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """Keep-alive connections to the server (``RawConn``: prebuilt bytes, answers read by
    length), opened as needed and reused; the caller bounds how many requests run at once
    (``Recorder.sem``), so that bounds the connections too. The load generator shares the
    machine with the server: httpx's client spent about 15 ms of CPU a round here (nonce +
    evidence), more than the server did, and the generator, not the server, was saturated."""

    def __init__(self, base: str) -> None:
        url = urlsplit(base)
        self.host, self.port, self.netloc = url.hostname or "127.0.0.1", url.port or 80, url.netloc
        self.idle: list[RawConn] = []

    async def request(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> Answer:
        data = json.dumps(body).encode() if body is not None else None
        head = http_head(method, path, self.netloc, token or TOKEN, data)
        while True:
            reused = bool(self.idle)
            conn = self.idle.pop() if reused else None
            if conn is None:
                conn = await asyncio.wait_for(RawConn.open(self.host, self.port), 10)
            try:
                status, raw, close = await asyncio.wait_for(conn.request(head, data or b""), 30)
                break
            except (ConnectionResetError, BrokenPipeError):  # no answer began: nothing was done
                conn.close()
                if not reused:
                    raise
                # the server closed a connection left idle past its keep-alive timeout before
                # this request reached it (as httpx does: send it again, on another connection)
            except BaseException:
                conn.close()  # in an unknown state: never reused
                raise
        if close:
            conn.close()
        else:
            self.idle.append(conn)
        return Answer(status, raw, conn.retry_after)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class Recorder:
    def __init__(self, connections: int) -> None:
        # requests wait here (FIFO, cheap) for one of the connections
        self.sem = asyncio.Semaphore(connections)
        self.stop_at = float("inf")  # time.monotonic() after which queued requests are dropped
        self.lat: dict[str, list[float]] = {}
        self.status: dict[str, dict[str, int]] = {}
        self.late: list[float] = []

    def add(self, kind: str, code: int | str, ms: float) -> None:
        st = self.status.setdefault(kind, {})
        st[str(code)] = st.get(str(code), 0) + 1
        if isinstance(code, int) and 200 <= code < 300:
            self.lat.setdefault(kind, []).append(ms)

    def summary(self) -> dict[str, Any]:
        out = {}
        for kind, st in sorted(self.status.items()):
            lat = self.lat.get(kind, [])
            out[kind] = {
                "requests": sum(st.values()),
                "p50_ms": round(pct(lat, 0.5), 2),
                "p95_ms": round(pct(lat, 0.95), 2),
                "p99_ms": round(pct(lat, 0.99), 2),
                "status": st,
            }
        return out


async def call(c: Client, rec: Recorder, kind: str, method: str, path: str,
               body: Any = None,
               agent: EccAgent | None = None) -> Answer | None:  # fmt: skip
    """One request, as ``agent`` (its credential) or as the admin (the client's default)."""
    async with rec.sem:
        if time.monotonic() > rec.stop_at:  # queued past the run's end: not sent
            rec.add(kind, "not_sent_after_end", 0.0)
            return None
        return await _call(c, rec, kind, method, path, body, agent)


async def _call(c: Client, rec: Recorder, kind: str, method: str, path: str,
                body: Any, agent: EccAgent | None) -> Answer | None:  # fmt: skip
    t = time.perf_counter()
    try:
        r = await c.request(method, path, body, agent.token if agent is not None else None)
    except TimeoutError:
        rec.add(kind, "timeout", 0.0)
        return None
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
        rec.add(kind, "error", 0.0)
        return None
    rec.add(kind, r.status_code, (time.perf_counter() - t) * 1000)
    return r


async def attest_round(c: Client, rec: Recorder, a: EccAgent) -> bool | None:
    """One round as ``proofplane agent`` runs it: passed (True), failed (False), or None when
    the server kept refusing it with 429 past the agent's retry budget."""
    path = f"{API}/nodes/{a.name}/attestation"
    r = await call_backing_off(c, rec, "nonce", f"{path}/nonce", None, a)
    if r is not None and r.status_code == 429:
        return None
    if r is None or r.status_code != 201:
        return False
    n = r.json()
    ev = a.evidence(bytes.fromhex(n["nonce"]), n["pcrs"], n["pcr_bank"])
    body = {"nonce": n["nonce"], "evidence": ev}
    r = await call_backing_off(c, rec, "evidence", f"{path}/evidence", body, a)
    if r is not None and r.status_code == 429:
        return None
    if r is None or r.status_code != 200:
        return False
    return bool(r.json()["verdict"].get("ok"))


async def call_backing_off(
    c: Client, rec: Recorder, kind: str, path: str, body: Any, a: EccAgent
) -> Answer | None:
    """A POST as the agent's API client sends it (``proofplane.cli.client.ApiClient``): an
    overload refusal (429) is sent again after the client's own ``backoff_s`` (at least its
    Retry-After, doubled on every try, plus jitter), at most ``RETRY_TRIES`` tries within
    ``RETRY_BUDGET_S`` seconds; then the last answer (still a 429: the agent gave up)."""
    waited, tries = 0.0, 0
    while True:
        tries += 1
        r = await call(c, rec, kind, "POST", path, body, a)
        if r is None or r.status_code != 429:
            return r
        # the client's functions read the header from an httpx answer: give them one
        answer = httpx.Response(429, headers={"Retry-After": f"{_retry_after(r):g}"})
        wait = min(backoff_s(answer, tries), RETRY_BUDGET_S - waited)
        if tries >= RETRY_TRIES or wait < (retry_after_s(answer) or 0.0) or wait <= 0:
            rec.add(f"{kind}_gave_up", "gave_up", 0.0)
            return r
        await asyncio.sleep(wait)
        waited += wait


async def enroll(c: Client, rec: Recorder, a: EccAgent) -> bool:
    """Enroll, activate, first round; an answer of 429 is retried after its Retry-After (an
    agent's backoff), up to ``ENROLL_TRIES`` times."""
    for _ in range(ENROLL_TRIES):
        done = await _enroll(c, rec, a)
        if done is not None:
            return done
    return False


async def _enroll(c: Client, rec: Recorder, a: EccAgent) -> bool | None:
    b64 = base64.b64encode
    body = {"ek_public": b64(a.ek_public).decode(), "ak_public": b64(a.ak_public).decode()}
    r = await call(c, rec, "enroll", "POST", f"{API}/nodes/{a.name}/attestation/enroll", body, a)
    if r is not None and r.status_code == 429:
        await asyncio.sleep(_retry_after(r))
        return None
    if r is None or r.status_code != 200:
        return False
    secret = a.activate(base64.b64decode(r.json()["credential"]))
    r = await call(c, rec, "activate", "POST", f"{API}/nodes/{a.name}/attestation/activate",
                   {"secret": b64(secret).decode()}, a)  # fmt: skip
    if r is not None and r.status_code == 429:
        await asyncio.sleep(_retry_after(r))
        return None
    if r is None or r.status_code != 200:
        return False
    for _ in range(ENROLL_TRIES):
        got = await attest_round(c, rec, a)
        if got is not None:
            return got
    return False


def _retry_after(r: Answer) -> float:
    return min(30.0, max(0.05, 1.0 if r.retry_after is None else r.retry_after))


async def enroll_all(base: str, agents: list[EccAgent], concurrency: int) -> dict[str, Any]:
    rec = Recorder(concurrency)
    queue = list(agents)
    ok = 0
    async with Client(base) as c:
        t = time.perf_counter()

        async def worker() -> None:
            nonlocal ok
            while queue:
                a = queue.pop()
                done = await enroll(c, rec, a)  # (ok += await …: lost updates)
                ok += done

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
    return {"nodes": len(agents), "admitted": ok, "seconds": round(wall, 2),
            "nodes_per_s": round(len(agents) / wall, 1), "requests": rec.summary()}  # fmt: skip


async def steady(base: str, agents: list[EccAgent], args: argparse.Namespace) -> dict[str, Any]:
    rec = Recorder(args.pool)
    rnd = random.Random(7)
    due = passed = 0
    loop = asyncio.get_running_loop()
    async with Client(base) as c:
        t0 = loop.time() + 0.5
        end = t0 + args.duration
        rec.stop_at = time.monotonic() + 0.5 + args.duration + LATE_S

        async def sleep_until(t: float) -> None:
            wait = t - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            rec.late.append(max(0.0, loop.time() - t) * 1000)

        async def agent(a: EccAgent) -> None:
            nonlocal due, passed
            t = t0 + rnd.uniform(0, args.interval)
            while t < end:
                await sleep_until(t)
                due += 1
                if loop.time() - t > LATE_S:  # a backlog: this round is lost, not sent
                    rec.add("round_not_sent_late", "skipped", 0.0)
                    t += args.interval * (1 + rnd.uniform(-args.jitter, args.jitter))
                    continue
                good = await attest_round(c, rec, a)  # a 429: this round is lost, counted
                passed += bool(good)
                t += args.interval * (1 + rnd.uniform(-args.jitter, args.jitter))

        async def console() -> None:
            tasks = []
            i = 0
            while True:
                t = t0 + i / args.console_rate
                if t >= end:
                    break
                await sleep_until(t)
                i += 1
                if loop.time() - t > LATE_S:
                    continue
                kind, path = CONSOLE[(i - 1) % len(CONSOLE)]
                path = path or f"{API}/nodes/{agents[rnd.randrange(len(agents))].name}"
                tasks.append(asyncio.create_task(call(c, rec, kind, "GET", path)))
            await asyncio.gather(*tasks)

        async def submits() -> None:
            tasks = []
            i = 0
            while args.submit_rate > 0:
                t = t0 + i / args.submit_rate
                if t >= end:
                    break
                await sleep_until(t)
                body = {"name": f"fleet-wl-{i}", "tenant": TENANT, "gpus": {"count": 1},
                        "command": []}  # fmt: skip
                tasks.append(asyncio.create_task(call(c, rec, "submit", "POST",
                                                      f"{API}/workloads", body)))  # fmt: skip
                i += 1
            await asyncio.gather(*tasks)

        t = time.perf_counter()
        await asyncio.gather(*(agent(a) for a in agents), console(), submits())
        wall = time.perf_counter() - t - 0.5
    ev = rec.status.get("evidence", {})
    answered = sum(v for k, v in ev.items() if k == "200")
    return {
        "seconds": round(wall, 2),
        "rounds_due": due,
        "rounds_answered": answered,
        "rounds_passed": passed,
        # over the phase as it ran: rounds retried past the end make it longer than --duration
        "evidence_per_s": round(answered / wall, 1) if wall > 0 else 0.0,
        "status_429": sum(s.get("429", 0) for s in rec.status.values()),
        # rounds whose nonce or evidence was still refused when the agent's retries ran out
        "rounds_given_up": sum(s.get("gave_up", 0) for s in rec.status.values()),
        "status_5xx": sum(
            v for s in rec.status.values() for k, v in s.items() if k.isdigit() and k[0] == "5"
        ),
        "timeouts": sum(s.get("timeout", 0) for s in rec.status.values()),
        "generator_late_ms": {
            "p50": round(pct(rec.late, 0.5), 2),
            "p99": round(pct(rec.late, 0.99), 2),
            "max": round(max(rec.late, default=0.0), 2),
        },  # fmt: skip
        "requests": rec.summary(),
    }


def verdicts(out: dict[str, Any]) -> dict[str, bool]:
    """Each target of ``TARGETS`` against its figure; the others hold only for a run at the
    fleet's size and pace (``fleet``: at least that many agents, that often, that many
    console reads/s), so a smaller run meets nothing."""
    s = out["steady"]
    fleet = (
        out["agents"] >= TARGETS["agents"]
        and out["interval_s"] <= TARGETS["interval_s"]
        and out["console_rate_rps"] >= TARGETS["console_rate_rps"]
    )
    unanswered = s["rounds_due"] - s["rounds_answered"]
    evidence = s["requests"].get("evidence", {}).get("p99_ms")
    return {
        "fleet": fleet,
        "rounds_unanswered": fleet and unanswered <= TARGETS["rounds_unanswered"],
        "quarantined": fleet and out["quarantined"] <= TARGETS["quarantined"],
        "evidence_p99_ms": fleet
        and evidence is not None
        and evidence <= TARGETS["evidence_p99_ms"],
    }


def server_env(pairs: list[str]) -> dict[str, str]:
    """``--server-env`` values: PROOFPLANE_* settings only (the bench sets the others)."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("PROOFPLANE_"):
            raise SystemExit(f"--server-env takes PROOFPLANE_NAME=VALUE, not {pair!r}")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="50 agents, 10 s, interval 5 s")
    ap.add_argument("--db", default="postgresql://127.0.0.1:5432/test",
                    help="PostgreSQL server (a throwaway database is made on it)")  # fmt: skip
    ap.add_argument("--agents", type=int, default=10000)
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between rounds")
    ap.add_argument("--jitter", type=float, default=0.1, help="± fraction of the interval")
    ap.add_argument("--duration", type=float, default=180.0, help="steady phase, seconds")
    ap.add_argument("--console-rate", type=float, default=50.0, help="console reads/s")
    ap.add_argument("--submit-rate", type=float, default=1.0, help="workload submissions/s")
    ap.add_argument("--enroll-concurrency", type=int, default=32)
    ap.add_argument("--pool", type=int, default=128, help="client connections")
    ap.add_argument("--grace", type=float, default=None, help="default: 3 intervals, >= 10 s")
    ap.add_argument("--stale-check", type=float, default=None, help="default: interval / 2")
    ap.add_argument("--workers", type=int, default=1, help="serve --workers (when serve takes it)")
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="PROOFPLANE_X=VALUE",
        help="a setting for the server (repeatable), e.g. its in-flight budgets",
    )
    ap.add_argument(
        "--auth",
        choices=("agent", "operator"),
        default="agent",
        help="agents present their node's credential (default), or all the one admin token",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.agents, args.duration, args.interval = 50, 10.0, 5.0
        args.console_rate, args.submit_rate = 10.0, 1.0
    grace = args.grace or max(10.0, 3 * args.interval)
    stale_check = args.stale_check or max(1.0, args.interval / 2)

    supports = serve_supports_workers()
    workers = args.workers if supports else None
    with ExitStack() as stack:
        tmp = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="proofplane-bench-fleet-"))
        )
        url = stack.enter_context(throwaway_postgres(args.db))
        t = time.perf_counter()
        tokens = prepare(url, args.agents)
        pcrs, log = boot_state()
        agents = [
            EccAgent(node_name(i), pcrs, log, tokens[i] if args.auth == "agent" else None)
            for i in range(args.agents)
        ]
        setup_s = time.perf_counter() - t
        env = {
            "PROOFPLANE_ATTEST_GRACE_SECONDS": str(int(grace)),
            "PROOFPLANE_ATTEST_STALE_CHECK_SECONDS": str(int(stale_check)),
            **server_env(args.server_env),
        }
        server = Server(url, tmp, workers=workers, env=env)
        try:
            server.wait_ready()
            cpu0, own0 = server.cpu_seconds(), own_cpu_seconds()
            enrolled = asyncio.run(enroll_all(server.base, agents, args.enroll_concurrency))
            cpu1, own1 = server.cpu_seconds(), own_cpu_seconds()
            text1 = metrics_text(server.base, TOKEN)
            pg1 = process_cpu_seconds("postgres")
            with LockSampler(url) as sampler:
                run = asyncio.run(steady(server.base, agents, args))
            cpu2, own2 = server.cpu_seconds(), own_cpu_seconds()
            pg2 = process_cpu_seconds("postgres")
            text2 = metrics_text(server.base, TOKEN)
            if server.proc.poll() is not None:
                raise SystemExit(f"the server died:\n{server.errors_tail()}")
        finally:
            server.stop()
        states = node_states(url)

    enrolled["server_cpu_s"] = cpu_delta(cpu0, cpu1)
    run["server_cpu_s"] = cpu_delta(cpu1, cpu2)
    enrolled["generator_cpu_s"] = round(own1 - own0, 2)
    run["generator_cpu_s"] = round(own2 - own1, 2)
    # the one write lock every worker's writes take (a round: its evidence's; a nonce is a read)
    tx = write_lock_delta(
        write_lock(text1), write_lock(text2), run["seconds"], run["rounds_answered"]
    )
    run["write_lock"] = {
        **sampler.summary(),  # sampled from pg_locks: share of samples held or waited for
        "writes_per_round": tx["writes_per_unit"],
        # the server's own timing of a write transaction, from taking the write path to its
        # commit: on PostgreSQL that includes the wait for the advisory lock (taken at BEGIN)
        "write_tx_ms": round(tx["held_ms_per_write"], 2),
        "write_tx_in_progress": tx["busy_share"],  # their mean number at any moment
    }
    # the workers' garbage collections: each stops its worker, every request in it waits
    run["gc"] = gc_pauses_delta(gc_pauses(text1), gc_pauses(text2), run["seconds"])
    run["postgres_cpu_s"] = round(pg2 - pg1, 2)
    answered = run["rounds_answered"]
    run["server_cpu_per_evidence_ms"] = (
        round(1000 * run["server_cpu_s"]["total"] / answered, 2) if answered else None
    )
    # what the machine's cores could carry if they did nothing but this phase's work, at its
    # CPU per answered round (server, PostgreSQL and this generator, console reads and
    # submissions included): the rate past which the cores, not a lock, bound the rounds
    machine_cpu_s = run["server_cpu_s"]["total"] + run["postgres_cpu_s"] + run["generator_cpu_s"]
    run["machine_cpu_per_evidence_ms"] = (
        round(1000 * machine_cpu_s / answered, 2) if answered else None
    )
    run["cpu_bound_evidence_per_s"] = (
        round(usable_cores() * answered / machine_cpu_s, 1) if answered and machine_cpu_s else None
    )
    out: dict[str, Any] = {
        "database": "postgresql",
        "agents": args.agents,
        "interval_s": args.interval,
        "jitter": args.jitter,
        "duration_s": args.duration,
        "console_rate_rps": args.console_rate,
        "submit_rate_rps": args.submit_rate,
        "grace_s": grace,
        "server_env": server_env(args.server_env),
        "stale_check_s": stale_check,
        "workers": workers or 1,
        "serve_supports_workers": supports,
        "auth": args.auth,
        "setup_s": round(setup_s, 2),
        "enrollment": enrolled,
        "steady": run,
        "nodes_after": states["states"],
        "quarantined": states["states"].get(NodeState.QUARANTINED.value, 0),
        "quarantined_reasons_sample": states["quarantined_reasons_sample"],
        "note": (
            "real proofplane serve on PostgreSQL over loopback HTTP, real verifier; agents are "
            "software TPMs (ECC EK/AK) in one asyncio client process sharing this machine with "
            "the server; one run"
        ),
        "machine": machine(),
    }
    out["targets"], out["meets"] = TARGETS, verdicts(out)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        e, s = out["enrollment"], out["steady"]
        print(f"enrollment: {e['admitted']}/{e['nodes']} admitted, {e['nodes_per_s']} nodes/s")
        print(
            f"steady: rounds {s['rounds_answered']}/{s['rounds_due']} answered, "
            f"{s['evidence_per_s']} evidence/s, 429 {s['status_429']}, 5xx {s['status_5xx']}, "
            f"quarantined {out['quarantined']}, server CPU {s['server_cpu_s']['total']} s"
        )
        for kind, f in s["requests"].items():
            print(f"   {kind:>18}: p50 {f['p50_ms']} p95 {f['p95_ms']} p99 {f['p99_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
