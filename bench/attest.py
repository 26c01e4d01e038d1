"""Benchmark: attestation verdicts per second on one core (quote + event-log replay + policy).

Setup (not timed): when swtpm and tpm2-tools are installed, ``--nodes`` software TPMs are
manufactured (each its own EK and AKs) in a temporary directory; each one "boots" by extending
its PCRs with the events of one of the real firmware logs in ``../shared/data/tcg-eventlogs``
(Secure Boot enabled ones), then produces ``--quotes`` real quotes over PCRs 0-9 with fresh
nonces (tpm2_quote, ECDSA P-256 AK). Without swtpm the same evidence is made in Python with a
software AK (``proofplane.attest.simulate``) and the JSON says ``"evidence": "software-key"``.

Timed: ``verify(evidence, expected, policy, now)`` for every recorded round, one thread: parse
and check the AK, verify the signature, parse TPMS_ATTEST, nonce/freshness/clock, PCR digest,
golden PCRs, parse + replay the whole event log and compare with the quote, Secure Boot and
boot-application allow-lists, GPU VBIOS/driver allow-list, and the SHA-256 evidence hash.
Nothing is cached between verdicts: every verdict parses the AK and EK, and parses and replays
its whole event log (the verifier's fused pass, ``proofplane.attest.facts.analyze_eventlog``).
The only things kept across calls are compiled formats, never a result: the struct layout of an
event for a given Spec ID algorithm list (as ``re`` keeps compiled patterns) and the parsed
driver-version strings of the policy check. ``verdicts_per_s`` is the median over ``--rounds``
passes; ``cached_eventlog`` is the same run with a ``VerifierCache`` (facts memoized by the
log's SHA-256, AKs by their bytes).

    .venv/bin/python bench/attest.py --json [--quick]
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from proofplane.agent.tpm.swtpm import (
    AK_HANDLES,
    EK_HANDLE,
    SwtpmNode,
    boot_log,
    manufacture,
    measure,
)
from proofplane.attest import Evidence, Expected, Policy, verify
from proofplane.attest import eventlog as el
from proofplane.attest.facts import VerifierCache, analyze_eventlog
from proofplane.attest.simulate import SoftTpm
from proofplane.machine import machine

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".." / "shared" / "data" / "tcg-eventlogs"
# Secure Boot enabled, sha1+sha256 (or sha256) logs from real servers and VMs.
BOOT_LOGS = [
    "intel_svr.bin",
    "rhcos.bin",
    "css-flex14vm4-bootlog.bin",
    "bootlog-5.0.0-rhel-20210423T133156Z_8b0347a.bin",
    "201123-eventlog.bin",
]
TARGET = 2000.0
T0 = datetime(2026, 1, 1, tzinfo=UTC)
INVENTORY = {
    "driver_version": "550.54.15",
    "gpus": [
        {"index": i, "uuid": f"GPU-{i:04d}", "name": "NVIDIA H100 80GB HBM3",
         "vbios_version": "96.00.99.00.01", "driver_version": "550.54.15"}
        for i in range(8)
    ],
}  # fmt: skip


def calibration_us() -> float:
    """Time of a fixed pure-Python loop (``sum(range(10_000))``), best of 20: lets readers
    scale figures between machines and see how loaded this one was."""
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        sum(range(10_000))
        best = min(best, time.perf_counter() - t)
    return round(best * 1e6, 1)


def boot_logs(n: int) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        name = BOOT_LOGS[i % len(BOOT_LOGS)]
        path = LOGS / name
        if path.exists():
            out.append((name, path.read_bytes()))
        else:
            out.append(("synthetic", boot_log(kernel=f"vmlinuz-{i}".encode())))
    return out


def policy_for(log_blob: bytes, node_class: str) -> Policy:
    log = el.parse_eventlog(log_blob)
    golden = el.replay(log, ["sha256"])["sha256"]
    apps = {
        e.digests["sha256"] for e in log.events if e.type == el.EV_EFI_BOOT_SERVICES_APPLICATION
    }
    return Policy(
        id=f"{node_class}-v1",
        node_class=node_class,
        golden_pcrs={i: frozenset({v}) for i, v in golden.items() if i <= 9},
        allowed_boot_apps=frozenset(apps),
        allowed_vbios=frozenset({"96.00.99.00.01", "96.00.5E.00.01"}),
        min_driver="550.54",
        max_quote_age_s=120,
    )


Round = tuple[Evidence, Expected, Policy, datetime]


def record_swtpm(n_nodes: int, quotes: int, tmp: Path) -> list[Round]:
    rounds: list[Round] = []
    for i, (name, blob) in enumerate(boot_logs(n_nodes)):
        template = manufacture(tmp / f"tpm{i}")
        node = SwtpmNode.start(template, tmp / f"node{i}")
        try:
            measure(node, blob)
            ak, ek = node.read_public(AK_HANDLES["ecc"]), node.read_public(EK_HANDLE)
            policy = policy_for(blob, f"class-{name}")
            for q in range(quotes):
                nonce = secrets.token_bytes(32)
                quote, sig, pcrs = node.quote(nonce, list(range(10)))
                issued = T0 + timedelta(minutes=q)
                rounds.append((Evidence(quote, sig, pcrs, blob, INVENTORY),
                               Expected(nonce, issued, ak, ek), policy,
                               issued + timedelta(seconds=1)))  # fmt: skip
        finally:
            node.stop()
    return rounds


def record_software(n_nodes: int, quotes: int) -> list[Round]:
    rounds: list[Round] = []
    for name, blob in boot_logs(n_nodes):
        soft = SoftTpm(ec.generate_private_key(ec.SECP256R1()))
        for ev in el.parse_eventlog(blob).events:
            if ev.extended:
                soft.extend(ev.pcr, ev.digests)
        policy = policy_for(blob, f"class-{name}")
        for q in range(quotes):
            nonce = secrets.token_bytes(32)
            quote, sig, pcrs = soft.quote(nonce, list(range(10)))
            issued = T0 + timedelta(minutes=q)
            rounds.append((Evidence(quote, sig, pcrs, blob, INVENTORY),
                           Expected(nonce, issued, soft.ak_public), policy,
                           issued + timedelta(seconds=1)))  # fmt: skip
    return rounds


def _timed(
    rounds: list[Round], passes: int, cache: VerifierCache | None
) -> tuple[list[float], list[float], list[int]]:
    """Per pass: verdicts per CPU second of this process and per wall second; latencies."""
    cpu_rates, wall_rates, lat = [], [], []
    for _ in range(passes):
        c0, w0 = time.process_time(), time.perf_counter()
        for ev, exp, pol, now in rounds:
            t = time.perf_counter_ns()
            verify(ev, exp, pol, now, cache=cache)
            lat.append(time.perf_counter_ns() - t)
        cpu = max(time.process_time() - c0, 1e-9)
        cpu_rates.append(len(rounds) / cpu)
        wall_rates.append(len(rounds) / (time.perf_counter() - w0))
    lat.sort()
    return cpu_rates, wall_rates, lat


def run(rounds: list[Round], passes: int) -> dict[str, Any]:
    cache = VerifierCache()
    for ev, exp, pol, now in rounds:  # every recorded round must pass, or the figure is void
        for c in (None, cache):
            v = verify(ev, exp, pol, now, cache=c)
            if not v.ok:
                raise SystemExit(f"recorded evidence did not verify: {v.reasons} {v.messages}")
    rates, wall, lat = _timed(rounds, passes, None)
    c_rates, c_wall, c_lat = _timed(rounds, passes, cache)
    # where the time goes (best of the passes): the event-log facts a verdict computes (the
    # verifier's fused parse + replay + decode, analyze_eventlog), and the rich parser that
    # `proofplane attest eventlog` uses (parse_eventlog builds every Event; replay)
    facts_us = rich_us = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for ev, _exp, pol, _now in rounds:
            analyze_eventlog(ev.eventlog or b"", pol.pcr_bank)
        facts_us = min(facts_us, (time.perf_counter() - t) / len(rounds) * 1e6)
        t = time.perf_counter()
        for ev, *_ in rounds:
            el.replay(el.parse_eventlog(ev.eventlog or b""), ["sha256"])
        rich_us = min(rich_us, (time.perf_counter() - t) / len(rounds) * 1e6)

    def pct(xs: list[int], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(len(xs) * q))] / 1000, 1)

    return {
        "verdicts_per_s": round(statistics.median(rates), 1),
        "verdicts_per_s_wall": round(statistics.median(wall), 1),
        "rate_basis": "verdicts per second of this process's CPU time (time.process_time), "
        "median over passes, one thread; _wall is per elapsed second on this shared machine",
        "p50_us": pct(lat, 0.5),
        "p99_us": pct(lat, 0.99),
        "cached_eventlog": {
            "verdicts_per_s": round(statistics.median(c_rates), 1),
            "verdicts_per_s_wall": round(statistics.median(c_wall), 1),
            "p50_us": pct(c_lat, 0.5),
            "p99_us": pct(c_lat, 0.99),
            "note": "same checks; event-log facts memoized by the log's SHA-256 (a node's boot "
            "log is the same bytes every round until it reboots)",
        },
        "eventlog_facts_us": round(facts_us, 1),
        "eventlog_parse_replay_us": round(rich_us, 1),
        "eventlog_note": "per verdict, best pass: eventlog_facts_us is the event-log share of a "
        "verdict (fused parse + replay + policy facts); eventlog_parse_replay_us the rich "
        "parser (an Event per event) + replay that the CLI uses",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="1 node, 5 quotes, 2 passes (smoke test)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--quotes", type=int, default=25, help="quotes recorded per node")
    ap.add_argument("--rounds", type=int, default=5, help="timed passes over all evidence")
    ap.add_argument("--software", action="store_true", help="skip swtpm: software-key evidence")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.quotes, args.rounds = 1, 5, 2
    have_swtpm = all(shutil.which(t) for t in ("swtpm", "swtpm_setup", "tpm2_quote"))
    t_setup = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pp-bench-attest-") as tmp:
        if have_swtpm and not args.software:
            rounds, source = record_swtpm(args.nodes, args.quotes, Path(tmp)), "swtpm"
        else:
            rounds, source = record_software(args.nodes, args.quotes), "software-key"
    setup_s = time.perf_counter() - t_setup
    res = run(rounds, args.rounds)
    events = [len(el.parse_eventlog(ev.eventlog or b"").events) for ev, *_ in rounds]
    out = {
        "benchmark": "attest",
        **res,
        "target_verdicts_per_s": TARGET,
        "meets_target": res["verdicts_per_s"] >= TARGET,
        "meets_target_cached_eventlog": res["cached_eventlog"]["verdicts_per_s"] >= TARGET,
        "evidence": source,
        "evidence_note": "real tpm2_quote quotes from swtpm (ECDSA P-256 AKs)"
        if source == "swtpm"
        else "quotes made in Python with a software ECDSA P-256 AK (swtpm not used)",
        "nodes": args.nodes,
        "verdicts_per_pass": len(rounds),
        "passes": args.rounds,
        "eventlog_events_mean": round(sum(events) / len(events), 1),
        "eventlog_bytes_mean": round(
            sum(len(ev.eventlog or b"") for ev, *_ in rounds) / len(rounds)
        ),
        "logs": sorted({n for n, _ in boot_logs(args.nodes)}),
        "setup_s": round(setup_s, 2),
        "calibration_sum_range_10k_us": calibration_us(),
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>28}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
