"""The benches' verdicts on issue 20's targets (``meets`` in bench/api.py and bench/fleet.py):
each figure against its target, and none met by a run below the target's rate or size."""

from __future__ import annotations

from typing import Any

import pytest

from ci import load_script

API = load_script("bench/api.py", "bench_api_verdicts")
FLEET = load_script("bench/fleet.py", "bench_fleet_verdicts")


def _seq(get: float = 1.0, lst: float = 2.0) -> dict[str, Any]:
    return {"nodes_get": {"p50_ms": get}, "nodes_list": {"p50_ms": lst}}


def _phase(rate: float, achieved: float, read: float, write: float, **more: Any) -> dict[str, Any]:
    classes = {c: {"p99_ms": read} for c in ("read_node", "read_nodes", "read_workloads")}
    classes.update({"read_events": {"p99_ms": read / 2}, "submit": {"p99_ms": write},
                    "cancel": {"p99_ms": write / 2}})  # fmt: skip
    return {"rate_rps": rate, "achieved_rps": achieved, "classes": classes, "timeouts": 0,
            "status_429": 10, "latency_429_ms": {"p50": 1.0, "p99": 8.0}, **more}  # fmt: skip


def test_the_api_mix_is_met_only_at_its_rate_and_within_its_p99s() -> None:
    met = API.verdicts(_seq(), _phase(500, 499, 20, 45), _phase(2500, 2400, 90, 900))
    assert all(met.values()), met
    slow_reads = API.verdicts(_seq(), _phase(500, 499, 26, 45), _phase(2500, 2400, 0, 0))
    assert not slow_reads["mixed_read_p99_ms"] and slow_reads["mixed_write_p99_ms"]
    slow_writes = API.verdicts(_seq(), _phase(500, 499, 20, 51), _phase(2500, 2400, 0, 0))
    assert slow_writes["mixed_read_p99_ms"] and not slow_writes["mixed_write_p99_ms"]
    timeouts = API.verdicts(_seq(), _phase(500, 499, 20, 45, timeouts=1), _phase(2500, 2400, 0, 0))
    assert not timeouts["mixed_timeouts"]
    late_429 = _phase(2500, 2400, 0, 0, latency_429_ms={"p50": 2.0, "p99": 11.0})
    assert not API.verdicts(_seq(), _phase(500, 499, 20, 45), late_429)["overload_429_p99_ms"]
    # a mix sent at 100 req/s, or not sent in full, meets none of the mix's targets
    for mixed in (_phase(100, 100, 1, 1), _phase(500, 400, 1, 1)):
        v = API.verdicts(_seq(), mixed, _phase(2500, 2400, 0, 0))
        assert not any(v[k] for k in v if k.startswith(("mixed_", "overload_"))), v
    assert not API.verdicts(_seq(get=2.5), _phase(100, 100, 1, 1), _phase(500, 5, 0, 0))[
        "nodes_get_p50_ms"
    ]
    # a mix in which no write was sent has no write figure: not met
    no_writes = _phase(500, 499, 20, 45)
    del no_writes["classes"]["submit"], no_writes["classes"]["cancel"]
    assert not API.verdicts(_seq(), no_writes, _phase(2500, 2400, 0, 0))["mixed_write_p99_ms"]


def _fleet(agents: int = 10000, interval: float = 60, console: float = 50, **s: Any) -> Any:
    steady = {"rounds_due": 100, "rounds_answered": 100,
              "requests": {"evidence": {"p99_ms": 150.0}}, **s}  # fmt: skip
    return {"agents": agents, "interval_s": interval, "console_rate_rps": console,
            "quarantined": 0, "steady": steady}  # fmt: skip


def test_the_fleet_is_met_only_at_its_size_with_every_round_answered_in_time() -> None:
    assert all(FLEET.verdicts(_fleet()).values())
    assert not FLEET.verdicts(_fleet(rounds_answered=99))["rounds_unanswered"]
    late = _fleet(requests={"evidence": {"p99_ms": 201.0}})
    assert not FLEET.verdicts(late)["evidence_p99_ms"]
    quarantined = {**_fleet(), "quarantined": 1}
    assert not FLEET.verdicts(quarantined)["quarantined"]
    for smaller in (_fleet(agents=1000), _fleet(interval=120), _fleet(console=10)):
        assert not any(FLEET.verdicts(smaller).values())


def test_the_fleet_bench_passes_only_server_settings_through() -> None:
    assert FLEET.server_env([]) == {}
    got = FLEET.server_env(["PROOFPLANE_MAX_INFLIGHT_ATTESTATION=8", "PROOFPLANE_X=a=b"])
    assert got == {"PROOFPLANE_MAX_INFLIGHT_ATTESTATION": "8", "PROOFPLANE_X": "a=b"}
    for bad in ("PROOFPLANE_X", "PATH=/tmp", "=1"):
        with pytest.raises(SystemExit, match="PROOFPLANE_NAME=VALUE"):
            FLEET.server_env([bad])


def _lag_text(counts: dict[str, int]) -> str:
    """Two workers' ``proofplane_event_loop_lag_seconds`` buckets (cumulative), summed."""
    lines = ["# TYPE proofplane_event_loop_lag_seconds histogram"]
    for le, n in counts.items():
        for _ in range(2):
            lines.append(f'proofplane_event_loop_lag_seconds_bucket{{le="{le}",loop="http"}} {n}')
    return "\n".join(lines) + "\n"


def test_the_loop_lag_is_read_from_the_metrics_over_a_phase() -> None:
    read, delta = API.loop_lag, API.loop_lag_delta  # bench/_server.py's, as api.py uses them
    before = read(_lag_text({"0.005": 10, "0.01": 10, "0.02": 10, "1.0": 10, "+Inf": 10}))
    assert before[float("inf")] == 20  # summed over the two workers
    after = read(_lag_text({"0.005": 60, "0.01": 100, "0.02": 109, "1.0": 110, "+Inf": 110}))
    got = delta(before, after)  # 200 probes: 100 within 5 ms, 80 more within 10, ...
    assert got == {"probes": 200, "over_10ms_share": 0.1, "p50_ms": 5.0, "p99_ms": 20.0}
    late = read(_lag_text({"0.005": 0, "0.01": 0, "0.02": 0, "1.0": 0, "+Inf": 5}))
    assert delta({}, late)["p99_ms"] is None  # past the last bound
    assert delta(after, after)["probes"] == 0


def _gc_text(gen2: dict[str, int], gen2_sum: float) -> str:
    """Two workers' ``proofplane_gc_pause_seconds``: generation 2's cumulative buckets and
    seconds (each worker's half), generation 0 one fast collection each."""
    lines = ["# TYPE proofplane_gc_pause_seconds histogram"]
    for _ in range(2):
        for le, n in gen2.items():
            lines.append(f'proofplane_gc_pause_seconds_bucket{{generation="2",le="{le}"}} {n}')
        lines.append(f'proofplane_gc_pause_seconds_sum{{generation="2"}} {gen2_sum / 2}')
        lines.append(f'proofplane_gc_pause_seconds_count{{generation="2"}} {gen2["+Inf"]}')
        for le in ("0.001", "+Inf"):
            lines.append(f'proofplane_gc_pause_seconds_bucket{{generation="0",le="{le}"}} 1')
    return "\n".join(lines) + "\n"


def test_the_collections_are_read_from_the_metrics_over_a_phase() -> None:
    read, delta = FLEET.gc_pauses, FLEET.gc_pauses_delta  # bench/_server.py's, as fleet.py uses
    before = read(_gc_text({"0.01": 1, "0.1": 1, "0.25": 1, "+Inf": 1}, 0.01))
    after = read(_gc_text({"0.01": 1, "0.1": 3, "0.25": 4, "+Inf": 4}, 0.51))
    got = delta(before, after, 10.0)  # 6 full collections, 0.5 s of them over 10 s
    assert got["2"] == {"collections": 6, "longest_within_ms": 250.0, "stopped_share": 0.05}
    assert got["0"] == {"collections": 0, "longest_within_ms": 0.0, "stopped_share": 0.0}
    assert got["1"]["collections"] == 0  # none exposed: none counted
    past = read(_gc_text({"0.01": 0, "0.1": 0, "0.25": 0, "+Inf": 2}, 3.0))
    assert delta(read(""), past, 1.0)["2"]["longest_within_ms"] is None  # past the last bound


def test_the_servers_own_refusal_times_are_read_from_the_metrics() -> None:
    lines = ["# TYPE proofplane_http_request_duration_seconds histogram"]
    for route, counts in (("<refused>", (90, 99, 100)), ("/api/v1/nodes", (0, 0, 50))):
        for method in ("GET", "POST"):  # summed over methods (and workers)
            for le, n in zip(("0.001", "0.01", "+Inf"), counts, strict=True):
                lines.append(
                    "proofplane_http_request_duration_seconds_bucket"
                    f'{{le="{le}",method="{method}",route="{route}"}} {n}'
                )
    after = API.refusals("\n".join(lines) + "\n")
    assert after == {0.001: 180, 0.01: 198, float("inf"): 200}  # the routed ones left out
    got = API.histogram_delta({}, after)
    assert got == {"count": 200, "over_10ms_share": 0.01, "p50_ms": 1.0, "p99_ms": 10.0}
    assert API.histogram_delta(after, after)["count"] == 0
