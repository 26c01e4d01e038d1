"""Benchmark: choosing a request's route, FastAPI's whole walk against the route index (issue 12).

For a few request paths the API serves often, the time to find the first route that matches
fully (``route.matches(scope)`` over the application's top-level routes in order, each
included router walking its own), once over the whole route table and once over the list
``api/route_index.py`` narrows it to for that path: the same loop FastAPI's
``APIRouter.app`` runs, on the application ``create_app`` builds. Median of ``--runs`` runs of
``--repeat`` matches each, in microseconds.

    .venv/bin/python bench/routing.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from starlette.routing import BaseRoute, Match

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import positive
from proofplane.api.app import create_app
from proofplane.api.route_index import RouteIndex
from proofplane.machine import machine

PATHS = (
    ("POST", "/api/v1/changes/17/approve"),
    ("POST", "/api/v1/changes"),
    ("GET", "/api/v1/nodes/gpu-0001"),
    ("GET", "/api/v1/workloads"),
    ("POST", "/api/v1/nodes/gpu-0001/attestation/evidence"),
    ("GET", "/healthz"),
)


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": "",
            "headers": [], "query_string": b""}  # fmt: skip


def choose(routes: list[BaseRoute], method: str, path: str) -> BaseRoute | None:
    """The first route that matches fully (what FastAPI's walk stops at)."""
    scope = _scope(method, path)
    for route in routes:
        if route.matches(scope)[0] == Match.FULL:
            return route
    return None


def _time_us(routes: list[BaseRoute], method: str, path: str, repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        choose(routes, method, path)
    return (time.perf_counter() - t) / repeat * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeat", type=positive, default=2000, help="matches per run and path")
    ap.add_argument("--runs", type=positive, default=5, help="runs (medians reported)")
    args = ap.parse_args(argv)
    app = create_app(None)  # type: ignore[arg-type]  # the route table only
    index = app.router.middleware_stack
    if not isinstance(index, RouteIndex):
        raise SystemExit("create_app did not install the route index")
    whole = list(app.router.routes)
    rows = []
    for method, path in PATHS:
        narrowed = index.router_for(path)
        short = list(narrowed.routes) if narrowed is not None else whole
        if choose(short, method, path) is not choose(whole, method, path):
            raise SystemExit(f"{method} {path}: the index chose another route")
        walk = [_time_us(whole, method, path, args.repeat) for _ in range(args.runs)]
        indexed = [_time_us(short, method, path, args.repeat) for _ in range(args.runs)]
        rows.append({
            "method": method, "path": path,
            "routes_walked": {"whole": len(whole), "indexed": len(short)},
            "whole_walk_us": round(statistics.median(walk), 1),
            "indexed_us": round(statistics.median(indexed), 1),
        })  # fmt: skip
    out = {
        "benchmark": "route selection: FastAPI's whole walk vs the route index",
        "repeat": args.repeat,
        "runs": args.runs,
        "paths": rows,
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in rows:
            print(f"{r['method']:>5} {r['path']}: {r['whole_walk_us']:.1f} us -> "
                  f"{r['indexed_us']:.1f} us")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
