"""Benchmark: replay the Alibaba "openb" trace with the FGD paper's protocol.

Every policy is a scoring plugin of the production scheduler (``proofplane.schedule``), which
does the placing (``"engine"`` in the JSON).

Default: the ``default`` trace, policies proofplane, fgd, best-fit and first-fit, seeds 42–51,
Go-compatible RNG, two worker processes. Prints one JSON document: per policy the mean GPU
allocation % at 130 % arrival (``mean_at_130``), the value per seed, the median seconds per
seed replay, the paper's published FGD / BestFit means for comparison, and the machine.

``--all-traces`` also replays the 17 trace variants of the paper (proofplane and fgd unless
``--policy`` says otherwise) and summarises "proofplane beats FGD on N of 17".

    .venv/bin/python bench/sim_openb.py [--all-traces] [--jobs 2] [--seeds 42-51] [--series]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path

from proofplane.cli.sim import machine
from proofplane.sim import loader
from proofplane.sim.engine import ENGINE
from proofplane.sim.runner import DEFAULT_POLICIES, POLICIES, SeedResult, parse_seeds, run_seed

_PODS: dict[str, list] = {}
_NODES: dict[str, list] = {}


def _job(args: tuple[str, str, str, int, str]) -> tuple[str, SeedResult]:
    data_dir, trace, policy, seed, rng = args
    base = Path(data_dir)
    if trace not in _PODS:
        _PODS[trace] = loader.load_pods(loader.pod_file(trace, base))
    if "nodes" not in _NODES:
        _NODES["nodes"] = loader.load_nodes(loader.node_file(base))
    return trace, run_seed(_PODS[trace], _NODES["nodes"], policy, seed, rng)


def _summary(results: list[SeedResult], with_series: bool) -> dict:
    out: dict = {}
    for r in results:
        p = out.setdefault(r.policy, {"per_seed": {}, "seconds_per_seed": {}, "series": {}})
        p["per_seed"][str(r.seed)] = r.at_130
        p["seconds_per_seed"][str(r.seed)] = round(r.seconds, 3)
        p["series"][str(r.seed)] = r.series
    for p in out.values():
        vals = [v for v in p["per_seed"].values() if v is not None]
        p["mean_at_130"] = round(statistics.fmean(vals), 4) if vals else None
        p["std_at_130"] = round(statistics.pstdev(vals), 4) if len(vals) > 1 else None
        p["median_seconds_per_seed"] = round(statistics.median(p["seconds_per_seed"].values()), 3)
        if not with_series:
            del p["series"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=loader.default_data_dir())
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--rng", choices=("go", "python"), default="go")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES))
    ap.add_argument("--all-traces", action="store_true")
    ap.add_argument("--series", action="store_true", help="Include the discretised series.")
    args = ap.parse_args(argv)
    if not (args.data / loader.NODE_FILE).is_file():
        print(f"sim_openb: no openb data under {args.data}", file=sys.stderr)
        return 2
    seeds = parse_seeds(args.seeds)
    traces = list(loader.TRACES) if args.all_traces else ["default"]
    default_policies = ["proofplane", "fgd"] if args.all_traces else list(DEFAULT_POLICIES)
    policies = list(dict.fromkeys(args.policy or default_policies))
    jobs = [(str(args.data), t, p, s, args.rng) for t in traces for p in policies for s in seeds]
    start = time.perf_counter()
    results: dict[str, list[SeedResult]] = {t: [] for t in traces}
    if args.jobs > 1:
        with get_context("fork").Pool(args.jobs) as pool:
            for trace, res in pool.imap_unordered(_job, jobs, chunksize=1):
                results[trace].append(res)
    else:
        for job in jobs:
            trace, res = _job(job)
            results[trace].append(res)
    wall = time.perf_counter() - start
    published_rows = loader.load_published(args.data / loader.EXPECTED_FILE)
    per_trace = {}
    for trace in traces:
        ordered = sorted(results[trace], key=lambda r: (policies.index(r.policy), r.seed))
        summary = _summary(ordered, args.series)
        published = {
            label: loader.published_mean_at_130(trace, label, published_rows)
            for label in ("06-FGD", "05-BestFit")
        }
        per_trace[trace] = {
            "policies": summary,
            "published_mean_at_130": {
                k: (round(v, 4) if v is not None else None) for k, v in published.items()
            },
        }
    all_seconds = [r.seconds for rs in results.values() for r in rs]
    doc: dict = {
        "benchmark": "openb replay, FGD (ATC'23) protocol, GPU allocation % at 130 % arrival",
        "engine": ENGINE,
        "scorers": policies,
        "rng": args.rng,
        "seeds": seeds,
        "jobs": args.jobs,
        "machine": machine(),
        "wall_seconds": round(wall, 2),
        "median_seconds_per_seed": round(statistics.median(all_seconds), 3),
        "median_seconds_per_seed_by_policy": {
            p: round(
                statistics.median(
                    r.seconds for rs in results.values() for r in rs if r.policy == p
                ),
                3,
            )
            for p in policies
        },
    }
    if args.all_traces:
        doc["traces"] = per_trace
        if "proofplane" in policies and "fgd" in policies:
            beats = []
            beats_published = []
            for trace, t in per_trace.items():
                ours = t["policies"]["proofplane"]["mean_at_130"]
                fgd = t["policies"]["fgd"]["mean_at_130"]
                pub = t["published_mean_at_130"]["06-FGD"]
                if ours is not None and fgd is not None and ours > fgd:
                    beats.append(trace)
                if ours is not None and pub is not None and ours > pub:
                    beats_published.append(trace)
            doc["proofplane_beats_fgd"] = f"{len(beats)} of {len(per_trace)}"
            doc["proofplane_beats_fgd_traces"] = beats
            doc["proofplane_beats_published_fgd"] = f"{len(beats_published)} of {len(per_trace)}"
    else:
        doc.update(per_trace["default"])
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
