"""``bench/topology.py --quick --json`` runs the production core and prints the figures.

Checks the keys and that the figures are sane (gangs were placed, topology packs at least as
well as the blind baseline, required gangs never span); never speed, which CI machines vary in.
"""

from __future__ import annotations

from ci import bench_json


def test_quick_run_prints_the_figures() -> None:
    doc = bench_json("topology.py", "--quick", "--json")
    assert doc["engine"] == "proofplane.schedule" and doc["scorer"]
    assert doc["gang_decisions_per_s"] > 0 and doc["p50_ms"] <= doc["p99_ms"]
    assert doc["cpu_gang_decisions_per_s"] > 0 and doc["blind_gang_decisions_per_s"] > 0
    one = doc["within_one_domain"]
    assert 0 <= one["blind"] <= one["topology"] <= 1
    assert doc["mean_domains"]["topology"] <= doc["mean_domains"]["blind"]
    run = doc["first_run"]["topology"]
    assert run["placed"] > 0
    for cls, s in run["by_class"].items():
        if cls.startswith("required"):
            assert s["one_domain"] == s["placed"], cls  # a required gang never spans
    assert {"cpu", "cores", "load_avg"} <= doc["machine"].keys()
    assert doc["params"]["quick"] is True and doc["params"]["rack_nodes"] == 18
