"""``workloads explain`` in the CLI says what the scheduler did to MIG layouts (issue 17 §2): a
line naming the instance it carved into a GPU's free slices, or the idle GPU it re-laid, with
``PROOFPLANE_MIG_AUTO_LAYOUT``; no such line when a free instance took the request; for a
waiting request that only carving would place, that the setting turns it off. Each test runs
its own server (test_cli's ``serve``) on a one-node cluster file."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_cli import ADMIN_TOKEN, as_json, cli, config_dir, ok  # noqa: F401 - fixtures

from live_server import serve
from proofplane import config
from proofplane.access import SYSTEM
from proofplane.cli import render
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate


@contextmanager
def one_mig_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, mode: str = "on"
) -> Iterator[str]:
    """A server whose cluster is node ``m``: one H100 in MIG mode holding ``layout``, with
    ``PROOFPLANE_MIG_AUTO_LAYOUT=mode`` and no defragmentation (layouts only)."""
    monkeypatch.setenv(config.MIG_AUTO_LAYOUT_ENV, mode)
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")
    store = Store(f"sqlite:///{tmp_path / 'mig.db'}")
    migrate.upgrade(store.engine)
    text = f"""cluster: mig
tenants:
  - name: lab
nodes:
  - name: m
    region: eu
    zone: eu-1
    gpus:
      - {{model: H100-80GB, count: 1, mig: [{layout}]}}
"""
    load_cluster(store, SYSTEM, parse_cluster(text))
    assert bootstrap_admin(store, ADMIN_TOKEN)
    with serve(store) as url:
        yield url


def submit(url: str, name: str, profile: str) -> dict[str, object]:
    w = as_json(cli(url, "workloads", "submit", name, "-t", "lab", "--gpus", "1",
                    "--mig-profile", profile, "--json"))  # fmt: skip
    assert isinstance(w, dict)
    return w


def test_explain_prints_the_carved_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with one_mig_node(tmp_path, monkeypatch, "3g.40gb@0") as url:
        assert submit(url, "a", "3g.40gb")["status"] == "placed"
        out = ok(cli(url, "workloads", "explain", "a")).stdout
        assert "MIG layout" not in out  # the free instance took it: nothing carved
        assert as_json(cli(url, "workloads", "explain", "a", "--json"))["mig_layout"] is None
        b = submit(url, "b", "1g.10gb")
        assert b["status"] == "placed"
        out = ok(cli(url, "workloads", "explain", "b")).stdout
        assert "MIG layout: carved 1g.10gb@" in out and "free slices of m GPU 0" in out
        assert "PROOFPLANE_MIG_AUTO_LAYOUT=on" in out


def test_explain_prints_the_re_laid_idle_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with one_mig_node(tmp_path, monkeypatch, "7g.80gb@0") as url:
        assert submit(url, "b", "1g.10gb")["status"] == "placed"
        out = ok(cli(url, "workloads", "explain", "b")).stdout
        assert "MIG layout: re-laid idle m GPU 0: 7g.80gb@0 → " in out
        assert "PROOFPLANE_MIG_AUTO_LAYOUT=on" in out


def test_explain_says_carving_is_off_for_a_waiting_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with one_mig_node(tmp_path, monkeypatch, "3g.40gb@0", "off") as url:
        submit(url, "a", "3g.40gb")
        assert submit(url, "b", "1g.10gb")["status"] == "pending"
        out = ok(cli(url, "workloads", "explain", "b")).stdout
        assert "MIG layout: it would be placed now on m by carving 1g.10gb@" in out
        assert "PROOFPLANE_MIG_AUTO_LAYOUT=off turns off" in out


def test_the_lines_for_each_kind_of_change() -> None:
    assert render.mig_layout_lines(None) == []
    change = {
        "node": "m",
        "gpu_index": 1,
        "step": "repartition",
        "carved": [],
        "before": ["7g.80gb@0"],
        "after": ["4g.40gb@0"],
        "why": "defragmentation: a 4g.40gb region for lab/big",
        "freed_by_defragmentation": True,
    }
    (line,) = render.mig_layout_lines({"auto_layout": "on", "changes": [change]})
    assert line == (
        "MIG layout: re-laid m GPU 1 after defragmentation moved its work: 7g.80gb@0 → "
        "4g.40gb@0 (PROOFPLANE_MIG_AUTO_LAYOUT=on)"
    )
    reclaimed = {
        **change,
        "step": "reclaim",
        "freed_by_defragmentation": False,
        "before": ["3g.40gb@0", "1g.10gb@4"],
        "after": ["3g.40gb@0", "3g.40gb@4"],
    }
    (line,) = render.mig_layout_lines({"auto_layout": "reclaim", "changes": [reclaimed]})
    assert line == (
        "MIG layout: reclaimed idle instances of m GPU 1: 3g.40gb@0, 1g.10gb@4 → 3g.40gb@0, "
        "3g.40gb@4 (PROOFPLANE_MIG_AUTO_LAYOUT=reclaim)"
    )
