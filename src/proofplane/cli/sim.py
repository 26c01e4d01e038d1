"""``proofplane sim …``: trace-driven placement simulations.

``proofplane sim openb`` replays the Alibaba "openb" GPU trace with the FGD (USENIX ATC'23)
paper's protocol through the production scheduler (``proofplane.schedule``, the policy being
its scoring plugin: the JSON says ``"engine"`` and ``"scorer"``) and reports the GPU allocation
ratio per policy: ``mean_at_130`` (mean over the
seeds of the allocation % when 130 % of the cluster's GPU capacity has arrived), the value per
seed, and the discretised series 0..130 % like the paper's ``analysis_allo_discrete.csv``.
"""

from __future__ import annotations

import json
import time
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from proofplane.machine import machine
from proofplane.schedule.policy import Policy
from proofplane.sim import dynamic as dyn_sim
from proofplane.sim import loader
from proofplane.sim import mig as mig_sim
from proofplane.sim.engine import ENGINE
from proofplane.sim.runner import (
    DEFAULT_POLICIES,
    POLICIES,
    RNG_KINDS,
    SeedResult,
    parse_seeds,
    run_seed,
    summarise,
)
from proofplane.sim.trace import Node, Pod, TraceError

app = typer.Typer(help="Trace-driven placement simulations.", no_args_is_help=True)

EXIT_USAGE = 2


@app.callback()
def sim() -> None:
    """Trace-driven placement simulations (e.g. `proofplane sim openb`)."""


def _fail(message: str) -> typer.Exit:
    typer.echo(f"proofplane sim: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def _published_for(pods_path: Path, policies: list[str]) -> dict[str, float]:
    """The paper's mean at 130 % for FGD / BestFit when ``pods_path`` is one of the openb
    traces and the cached results CSV sits next to it; empty otherwise."""
    name = pods_path.name
    if not (name.startswith("openb_pod_list_") and name.endswith(".csv")):
        return {}
    trace = name.removeprefix("openb_pod_list_").removesuffix(".csv")
    csv_path = pods_path.parent / loader.EXPECTED_FILE
    if not csv_path.is_file():
        return {}
    try:
        rows = loader.load_published(csv_path)
    except (KeyError, ValueError, OSError):
        return {}
    out = {}
    for policy in policies:
        label = loader.PUBLISHED_POLICY.get(policy)
        mean = loader.published_mean_at_130(trace, label, rows) if label else None
        if mean is not None:
            out[policy] = round(mean, 4)
    return out


_WORK: tuple[list[Pod], list[Node]] | None = None


def _init_worker(pods: list[Pod], nodes: list[Node]) -> None:
    global _WORK
    _WORK = (pods, nodes)


def _work(job: tuple[str, int, str]) -> SeedResult:
    assert _WORK is not None
    policy, seed, rng = job
    return run_seed(_WORK[0], _WORK[1], policy, seed, rng)


def run_jobs(
    pods: list[Pod], nodes: list[Node], jobs: list[tuple[str, int, str]], workers: int
) -> list[SeedResult]:
    """Run (policy, seed, rng) replays, in ``workers`` processes when more than one."""
    if workers <= 1 or len(jobs) <= 1:
        return [run_seed(pods, nodes, p, s, r) for p, s, r in jobs]
    ctx = get_context("fork") if "fork" in get_all_start_methods() else get_context()
    with ctx.Pool(min(workers, len(jobs)), _init_worker, (pods, nodes)) as pool:
        return pool.map(_work, jobs, chunksize=1)


_MIG_WORK: tuple[list[Pod], list[Node], tuple[str, ...], str] | None = None


def _init_mig_worker(
    pods: list[Pod], nodes: list[Node], policies: tuple[str, ...], rng: str
) -> None:
    global _MIG_WORK
    _MIG_WORK = (pods, nodes, policies, rng)


def _mig_work(job: tuple[str, int]) -> list[mig_sim.MigSeedResult]:
    assert _MIG_WORK is not None
    pods, nodes, policies, rng = _MIG_WORK
    return mig_sim.run_mig_seed(pods, nodes, job[0], policies, job[1], rng, time.perf_counter)


def run_mig_jobs(
    pods: list[Pod],
    nodes: list[Node],
    mixes: list[str],
    policies: list[str],
    seeds: list[int],
    rng: str,
    workers: int,
) -> list[mig_sim.MigSeedResult]:
    """MIG-mode replays, one job per (mix, seed) running every policy on the same stream."""
    jobs = [(m, s) for m in mixes for s in seeds]
    pols = tuple(policies)
    if workers <= 1 or len(jobs) <= 1:
        return [
            r
            for m, s in jobs
            for r in mig_sim.run_mig_seed(pods, nodes, m, pols, s, rng, time.perf_counter)
        ]
    ctx = get_context("fork") if "fork" in get_all_start_methods() else get_context()
    with ctx.Pool(min(workers, len(jobs)), _init_mig_worker, (pods, nodes, pols, rng)) as pool:
        return [r for rs in pool.map(_mig_work, jobs, chunksize=1) for r in rs]


def mig_report(
    results: list[mig_sim.MigSeedResult],
    *,
    pods_path: Path,
    nodes_path: Path,
    rng: str,
    seeds: list[int],
    wall: float,
) -> dict[str, Any]:
    """The JSON document ``sim openb --mig --json`` prints."""
    return {
        "mode": "mig",
        "engine": mig_sim.ENGINE,
        "plugins": {
            p: v.describe()
            for p, v in mig_sim.POLICY_PLUGINS.items()
            if p in {r.policy for r in results}
        },
        "sku": mig_sim.SKU_NAME,
        "baseline": mig_sim.BASELINE,
        "pods": str(pods_path),
        "nodes": str(nodes_path),
        "rng": rng,
        "seeds": seeds,
        "machine": machine(),
        "wall_seconds": round(wall, 3),
        "mixes": mig_sim.summarise_mig(results),
    }


def _dynamic_plugins(policy: str) -> tuple[Policy, bool]:
    """A dynamic replay policy's scheduler plugins, and whether it defragments."""
    base = dyn_sim.DEFRAG_POLICIES.get(policy, policy)
    return mig_sim.POLICY_PLUGINS[base], policy in dyn_sim.DEFRAG_POLICIES


def dynamic_report(
    records: list[dict[str, Any]],
    *,
    policies: list[str],
    pods_path: Path,
    nodes_path: Path,
    rng: str,
    seeds: list[int],
    loads: list[float],
    patience: float,
    wall: float,
) -> dict[str, Any]:
    """The JSON document ``sim openb --mig --dynamic --json`` prints."""
    return {
        "mode": "mig-dynamic",
        "engine": mig_sim.ENGINE,
        "sku": mig_sim.SKU_NAME,
        "baseline": dyn_sim.BASELINE,
        "plugins": {
            p: {**v.describe(), "defrag": defrag}
            for p in policies
            for v, defrag in [_dynamic_plugins(p)]
        },
        "patience_s": patience,
        "tick_s": dyn_sim.TICK,
        "pods": str(pods_path),
        "nodes": str(nodes_path),
        "rng": rng,
        "seeds": seeds,
        "loads": loads,
        "definitions": dyn_sim.definitions(),
        "machine": machine(),
        "wall_seconds": round(wall, 3),
        "mixes": dyn_sim.dynamic_report(records),
    }


def _dynamic_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="MIG with departures: accepted requests per policy")
    for col in ("mix", "load", "seed", "policy", "accepted", "ratio", "GPU-h", "wait p95 s",
                "repart.", "why rejected (cap/frag/layout)"):  # fmt: skip
        table.add_column(col)
    for r in records:
        why = r["rejected_why"]
        table.add_row(
            r["mix"],
            f"{r['load']:.0%}",
            str(r["seed"]),
            r["policy"],
            str(r["accepted"]),
            f"{r['accepted_ratio']:.4f}",
            f"{r['gpu_compute_hours']:.0f}",
            f"{r['wait_p95_s']:.0f}",
            str(r["repartitions"]),
            f"{why['capacity']}/{why['fragmentation']}/{why['layout']}",
        )
    return table


def _mig_table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"MIG mode ({doc['sku']}), rng={doc['rng']}, accepted GPU requests")
    table.add_column("mix")
    table.add_column("policy", no_wrap=True)
    table.add_column("accepted (mean)", justify="right")
    table.add_column("of arrived %", justify="right")
    table.add_column("compute used %", justify="right")
    table.add_column("vs first-slot best-fit", justify="right")
    for mix, m in doc["mixes"].items():
        ratio = m.get("ratio_proofplane_vs_first_slot_best_fit")
        for name, p in m["policies"].items():
            table.add_row(
                mix,
                name,
                f"{p['accepted_mean']:.1f}",
                f"{p['accepted_pct_mean']:.2f}",
                f"{p['slice_utilisation_pct_mean']:.2f}",
                f"x{ratio:.4f}" if name == "proofplane" and ratio is not None else "",
            )
    return table


def report(
    results: list[SeedResult],
    *,
    pods_path: Path,
    nodes_path: Path,
    rng: str,
    seeds: list[int],
    wall: float,
) -> dict[str, Any]:
    """The JSON document ``sim openb --json`` prints."""
    summary = summarise(results)
    published = _published_for(pods_path, list(summary))
    policies: dict[str, Any] = {}
    for name, s in summary.items():
        secs = sorted(s.seconds.values())
        policies[name] = {
            "mean_at_130": s.mean_at_130,
            "per_seed": {str(k): v for k, v in s.per_seed.items()},
            "seconds_per_seed": {str(k): v for k, v in s.seconds.items()},
            "median_seconds_per_seed": secs[len(secs) // 2] if secs else None,
            "published_mean_at_130": published.get(name),
            "series": {str(k): v for k, v in s.series.items()},
            "engine": ENGINE,
            "scorer": name,
        }
    return {
        "engine": ENGINE,
        "pods": str(pods_path),
        "nodes": str(nodes_path),
        "rng": rng,
        "seeds": seeds,
        "machine": machine(),
        "wall_seconds": round(wall, 3),
        "policies": policies,
    }


def _table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"openb replay, rng={doc['rng']}, GPU allocation % at 130 % arrival")
    table.add_column("policy")
    table.add_column("mean@130", justify="right")
    table.add_column("paper (42-51)", justify="right")
    table.add_column("min..max", justify="right")
    table.add_column("s/seed (median)", justify="right")
    for name, p in doc["policies"].items():
        vals = [v for v in p["per_seed"].values() if v is not None]
        mean = p["mean_at_130"]
        pub = p["published_mean_at_130"]
        table.add_row(
            name,
            f"{mean:.2f}" if mean is not None else "-",
            f"{pub:.2f}" if pub is not None else "",
            f"{min(vals):.2f}..{max(vals):.2f}" if vals else "-",
            f"{p['median_seconds_per_seed']:.2f}",
        )
    return table


@app.command("openb")
def openb(
    pods: Path | None = typer.Option(
        None,
        "--pods",
        help="Pod list CSV (default: ../shared/data/openb/openb_pod_list_default.csv).",
        show_default=False,
    ),
    nodes: Path | None = typer.Option(
        None,
        "--nodes",
        help="Node list CSV (default: ../shared/data/openb/openb_node_list_gpu_node.csv).",
        show_default=False,
    ),
    policy: list[str] | None = typer.Option(
        None,
        "--policy",
        "-p",
        help=f"Policy to replay, repeatable: {', '.join(POLICIES)} (default: all).",
        show_default=False,
    ),
    seeds: str = typer.Option("42-51", "--seeds", help="Seeds, e.g. 42-51 or 42,45."),
    rng: str = typer.Option(
        "go", "--rng", help="go: bit-exact Go math/rand (matches the paper); python: Python's."
    ),
    jobs: int = typer.Option(
        1, "--jobs", "-j", min=1, help="Worker processes (one replay per seed and policy)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    mig: bool = typer.Option(
        False,
        "--mig",
        help="MIG mode: every GPU an H100-80GB with MIG; accepted requests for "
        f"{', '.join(mig_sim.MIG_POLICIES)}.",
    ),
    mix: list[str] | None = typer.Option(
        None,
        "--mix",
        help=f"With --mig, request mix, repeatable: {', '.join(mig_sim.MIXES)} (default: both).",
        show_default=False,
    ),
    dynamic: bool = typer.Option(
        False,
        "--dynamic",
        help="With --mig: arrivals and departures in trace time, FIFO with backfill and "
        f"patience; policies {', '.join(dyn_sim.POLICIES)}.",
    ),
    load: list[float] | None = typer.Option(
        None,
        "--load",
        help="With --dynamic: offered load as a share of MIG compute, repeatable "
        "(default: 1.0, 1.3, 1.6).",
        show_default=False,
    ),
    patience: float = typer.Option(
        dyn_sim.PATIENCE, "--patience", help="With --dynamic: seconds a request may wait."
    ),
) -> None:
    """Replay the openb trace with the FGD paper's protocol; GPU allocation per policy (with
    --mig: accepted MIG requests per policy)."""
    pods_path = pods or loader.pod_file("default")
    nodes_path = nodes or loader.node_file()
    if dynamic and not mig:
        raise _fail("--dynamic needs --mig")
    if load and not dynamic:
        raise _fail("--load needs --dynamic")
    mig_known = tuple(mig_sim.POLICY_PLUGINS)
    if dynamic:
        mig_known += tuple(dyn_sim.DEFRAG_POLICIES)
    known = mig_known if mig else tuple(POLICIES)
    default = dyn_sim.POLICIES if dynamic else mig_sim.MIG_POLICIES if mig else DEFAULT_POLICIES
    chosen = list(policy) if policy else list(default)
    for name in chosen:
        if name not in known:
            mode = " with --mig" if mig else ""
            raise _fail(f"unknown policy {name!r}{mode} (known: {', '.join(known)})")
    chosen = list(dict.fromkeys(chosen))
    if mix and not mig:
        raise _fail("--mix needs --mig")
    mixes = list(dict.fromkeys(mix)) if mix else list(mig_sim.MIXES)
    for name in mixes:
        if name not in mig_sim.MIXES:
            raise _fail(f"unknown mix {name!r} (known: {', '.join(mig_sim.MIXES)})")
    if rng not in RNG_KINDS:
        raise _fail(f"unknown rng {rng!r} (use go or python)")
    try:
        seed_list = parse_seeds(seeds)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    try:
        pod_list = loader.load_pods(pods_path)
        node_list = loader.load_nodes(nodes_path)
    except (FileNotFoundError, TraceError, UnicodeDecodeError, KeyError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:
        raise _fail(f"cannot read input: {exc}") from None
    start = time.perf_counter()
    if dynamic:
        loads = list(dict.fromkeys(load or dyn_sim.LOADS))
        try:
            times = loader.load_pod_times(pods_path) if "openb" in mixes else {}
            records = dyn_sim.run_dynamic(
                pod_list,
                times,
                node_list,
                mixes,
                chosen,
                loads,
                seed_list,
                rng=rng,
                patience=patience,
                clock=time.perf_counter,
            )
        except (TraceError, mig_sim.MigSimError) as exc:
            raise _fail(str(exc)) from None
        dyn_doc = dynamic_report(
            records,
            policies=chosen,
            pods_path=pods_path,
            nodes_path=nodes_path,
            rng=rng,
            seeds=seed_list,
            loads=loads,
            patience=patience,
            wall=time.perf_counter() - start,
        )
        if as_json:
            typer.echo(json.dumps(dyn_doc, indent=2))
        else:
            console = Console()
            console.print(_dynamic_table(records))
        return
    if mig:
        mig_results = run_mig_jobs(pod_list, node_list, mixes, chosen, seed_list, rng, jobs)
        mig_doc = mig_report(
            mig_results,
            pods_path=pods_path,
            nodes_path=nodes_path,
            rng=rng,
            seeds=seed_list,
            wall=time.perf_counter() - start,
        )
        if as_json:
            typer.echo(json.dumps(mig_doc, indent=2))
        else:
            console = Console()
            console.print(_mig_table(mig_doc))
            m = mig_doc["machine"]
            console.print(
                f"{len(seed_list)} seed(s), {mig_doc['wall_seconds']:.1f} s wall; "
                f"{m['platform']}, Python {m['python']}, {m['cpu_count']} CPU(s)"
            )
        return
    work = [(p, s, rng) for p in chosen for s in seed_list]
    results = run_jobs(pod_list, node_list, work, jobs)
    doc = report(
        results,
        pods_path=pods_path,
        nodes_path=nodes_path,
        rng=rng,
        seeds=seed_list,
        wall=time.perf_counter() - start,
    )
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        console = Console()
        console.print(_table(doc))
        m = doc["machine"]
        console.print(
            f"{len(seed_list)} seed(s), {doc['wall_seconds']:.1f} s wall; "
            f"{m['platform']}, Python {m['python']}, {m['cpu_count']} CPU(s)"
        )
