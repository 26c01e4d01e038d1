"""File I/O of the simulator: the node and pod CSVs, and the published results CSV."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from proofplane.sim.trace import Node, Pod, TraceError, parse_nodes, parse_pods

NODE_FILE = "openb_node_list_gpu_node.csv"
EXPECTED_FILE = "fgd_expected_results/analysis_allo_discrete.csv"
TRACES = (
    "default",
    "cpu050",
    "cpu100",
    "cpu200",
    "cpu250",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "gpuspec10",
    "gpuspec20",
    "gpuspec25",
    "gpuspec33",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
)
PUBLISHED_POLICY = {"best-fit": "05-BestFit", "fgd": "06-FGD"}


def default_data_dir() -> Path:
    """``../shared/data/openb`` relative to the repository root (this file is
    ``<root>/src/proofplane/sim/loader.py``)."""
    return Path(__file__).resolve().parents[3].parent / "shared" / "data" / "openb"


def pod_file(trace: str, data_dir: Path | None = None) -> Path:
    return (data_dir or default_data_dir()) / f"openb_pod_list_{trace}.csv"


def node_file(data_dir: Path | None = None) -> Path:
    return (data_dir or default_data_dir()) / NODE_FILE


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def load_nodes(path: Path) -> list[Node]:
    try:
        return parse_nodes(_rows(path))
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def load_pods(path: Path) -> list[Pod]:
    try:
        return parse_pods(_rows(path))
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def load_pod_times(path: Path) -> dict[str, tuple[int, int]]:
    """Per pod name, ``(creation_time, deletion_time)`` in seconds (the columns the FGD
    protocol ignores; ``sim openb --mig --dynamic`` replays them). A pod without a deletion
    time runs to the end of the trace."""
    rows = _rows(path)
    out: dict[str, tuple[int, int]] = {}
    end = 0
    for i, row in enumerate(rows):
        try:
            created = int(float(row["creation_time"]))
            raw = (row.get("deletion_time") or "").strip()
            deleted = int(float(raw)) if raw and raw.lower() != "nan" else -1
        except (KeyError, ValueError):
            raise TraceError(f"{path}: pod row {i + 1}: no creation/deletion time") from None
        out[row["name"].strip()] = (created, deleted)
        end = max(end, created, deleted)
    return {k: (c, d if d >= c else end) for k, (c, d) in out.items()}


@dataclass(frozen=True)
class PublishedRow:
    workload: str
    policy: str
    seed: int
    series: list[float | None]  # columns 0..130


def load_published(path: Path | None = None) -> list[PublishedRow]:
    """The FGD paper's cached ``analysis_allo_discrete.csv``."""
    rows = _rows(path or (default_data_dir() / EXPECTED_FILE))
    out = []
    for row in rows:
        series = [float(row[str(r)]) if row.get(str(r)) else None for r in range(131)]
        out.append(
            PublishedRow(
                workload=row["workload"].removeprefix("openb_pod_list_"),
                policy=row["sc_policy"],
                seed=int(row["seed"]),
                series=series,
            )
        )
    return out


def published_mean_at_130(trace: str, policy: str, rows: list[PublishedRow]) -> float | None:
    """Mean over seeds of column 130 for ``trace`` and a CSV policy label like ``06-FGD``."""
    vals = [
        v
        for r in rows
        if r.workload == trace and r.policy == policy and (v := r.series[130]) is not None
    ]
    return sum(vals) / len(vals) if vals else None
