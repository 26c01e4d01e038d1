"""The demo cluster attests too (issue 5): the staleness worker, the simulated attester that only
demo mode accepts, and `up`'s demo with a drifting node quarantined and its work moved, and with
two nodes attested by the node agent against their own swtpm (without swtpm/tpm2-tools: `up`
falls back to simulated nodes locally; in CI (CI=true) the test fails)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from ci import IN_CI, unavailable
from proofplane.access import SYSTEM, Actor
from proofplane.agent.tpm import swtpm as swtpm_harness
from proofplane.api.app import create_app
from proofplane.attest import load_record, replay_record
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.cli import credentials as cli_credentials
from proofplane.cli import server as server_cli
from proofplane.cli.main import app
from proofplane.config import Settings, from_env
from proofplane.demo import attester as demo
from proofplane.demo import swtpm as demo_swtpm
from proofplane.errors import InvalidState, ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import NodeState
from proofplane.service import attestation as svc
from proofplane.service.context import Store
from proofplane.service.events import list_events
from proofplane.service.nodes import get_node, list_nodes
from proofplane.service.workloads import list_workloads
from proofplane.workers import StaleWorker

API = "/api/v1"
POLICY = {"id": "p", "node_class": "default", "require_eventlog": False,
          "require_secure_boot": False, "require_inventory": False}  # fmt: skip


def _spec():
    text = (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text("utf-8")
    return parse_cluster(text)


def _node(client: TestClient, name: str) -> None:
    body = {"name": name, "region": "r1", "zone": "z1",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "model": "H100-80GB"}]}  # fmt: skip
    client.post(f"{API}/nodes", json=body).raise_for_status()


def test_settings_for_staleness_and_demo_mode() -> None:
    s = from_env({})
    assert s.attest_grace_s == 900 and s.attest_stale_check_interval_s == 30
    assert s.demo_attester is None  # only `up` turns demo mode on
    s = from_env({"PROOFPLANE_ATTEST_STALE_CHECK_SECONDS": "0",
                  "PROOFPLANE_DEMO_ATTESTER": "simulated"})  # fmt: skip
    assert s.attest_stale_check_interval_s is None and s.demo_attester == "simulated"
    for env in ({"PROOFPLANE_ATTEST_GRACE_SECONDS": "soon"},
                {"PROOFPLANE_ATTEST_GRACE_SECONDS": "1"},
                {"PROOFPLANE_DEMO_ATTESTER": "yes"}):  # fmt: skip
        with pytest.raises(ValidationFailed):
            from_env(env)


def test_stale_worker_quarantines_only_under_an_enforcing_policy(
    client: TestClient, store: Store
) -> None:
    _node(client, "n1")
    client.post(f"{API}/nodes/n1/state", json={"state": "admitted"}).raise_for_status()
    worker = StaleWorker(store, interval_s=3600, grace=timedelta(minutes=5))
    before = len(list_events(store, SYSTEM, limit=500).items)
    assert worker.run_once() == []  # no policy: nothing checked, nothing written
    assert len(list_events(store, SYSTEM, limit=500).items) == before
    client.put(f"{API}/attestation/policy", json={"policy": POLICY}).raise_for_status()
    assert worker.run_once() == ["n1"]  # never attested
    node = client.get(f"{API}/nodes/n1").json()
    assert node["state"] == "quarantined"
    assert node["state_reason"] == "attestation stale: never attested"
    assert worker.run_once() == [] and worker.quarantined == ["n1"]


def test_the_server_runs_the_stale_worker(store: Store) -> None:
    settings = Settings(attest_stale_check_interval_s=60, attest_grace_s=120)
    with TestClient(create_app(store, settings)) as c:
        checker = c.app.state.attest_stale_checker  # type: ignore[attr-defined]
        assert isinstance(checker, StaleWorker)
        assert checker.grace == timedelta(seconds=120) and checker.interval_s == 60
    with TestClient(create_app(store, Settings())) as c:
        assert c.app.state.attest_stale_checker is None  # type: ignore[attr-defined]


def test_simulated_attester_is_refused_outside_demo_mode(client: TestClient, store: Store) -> None:
    _node(client, "n1")
    client.put(f"{API}/attestation/policy", json={"policy": POLICY}).raise_for_status()
    a = SimulatedAttester.create()
    actor = Actor("node:n1")
    with pytest.raises(InvalidState) as refused:
        svc.enroll(store, actor, "n1", a.ek_public, a.ak_public, simulated=True)
    assert refused.value.code == "simulated_attester_refused"

    # enrolled in demo mode, it passes there and is marked simulated everywhere
    ch = svc.enroll(store, actor, "n1", a.ek_public, a.ak_public,
                    simulated=True, allow_simulated=True)  # fmt: skip
    svc.activate(store, actor, "n1", a.activate(ch.credential))
    a.boot(demo_boot_log(b"kernel"))
    nonce = svc.issue_nonce(store, actor, "n1")
    ev = a.evidence(nonce.nonce, list(nonce.pcrs))
    out = svc.submit_evidence(store, actor, "n1", nonce.nonce, ev, allow_simulated=True)
    assert out.verdict["ok"] and out.state == "admitted"
    assert out.state_reason == "attestation passed (simulated attester)"
    assert svc.attestation_status(store, SYSTEM, "n1")["simulated"] is True

    # the same node's evidence on a server outside demo mode: refused, quarantined
    nonce = svc.issue_nonce(store, actor, "n1")
    ev = a.evidence(nonce.nonce, list(nonce.pcrs))
    out = svc.submit_evidence(store, actor, "n1", nonce.nonce, ev)
    assert out.verdict["reasons"] == ["simulated_attester_refused"]
    assert out.state == "quarantined"
    items = svc.list_evidence(store, SYSTEM, "n1")
    assert [i["ok"] for i in items] == [False, True]
    assert all(i["simulated"] and i["record"]["simulated"] for i in items)
    events = list_events(store, SYSTEM, action="node.attest", limit=10).items
    assert len(events) == 2 and all(e.details["simulated"] is True for e in events)
    # a real (non-simulated) identity never carries the mark
    b = SimulatedAttester.create()
    _node(client, "n2")
    ch = svc.enroll(store, Actor("node:n2"), "n2", b.ek_public, b.ak_public)
    svc.activate(store, Actor("node:n2"), "n2", b.activate(ch.credential))
    assert svc.attestation_status(store, SYSTEM, "n2")["simulated"] is False


def _check_drift(store: Store, drift: str) -> None:
    nodes = {n.name: n for n in list_nodes(store, SYSTEM, limit=500).items}
    assert nodes[drift].state is NodeState.QUARANTINED
    assert nodes[drift].state_reason == (
        "attestation failed: kernel_not_allowed (simulated attester)"
    )
    admitted = [n for n in nodes.values() if n.state is NodeState.ADMITTED]
    assert len(admitted) == 21  # 24, less the drifting, the cordoned and the registered one
    # its work moved to a node that carries the workload's tags (Paris, GDPR); read from the
    # events, which hold after `up` has stopped (and cancelled) the demo's workloads too
    history = sorted(
        list_events(store, SYSTEM, action="workload.*", target_id="claims-triage", limit=500).items,
        key=lambda e: e.seq,
    )
    evicted_at = next(i for i, e in enumerate(history) if e.action == "workload.evict")
    assert history[evicted_at].details["node"] == drift
    replaced = next(e for e in history[evicted_at:] if e.action == "workload.place")
    moved_to = replaced.details["node"]
    assert moved_to != drift
    assert get_node(store, SYSTEM, moved_to).certifications.get("gdpr-zone") == "paris"
    assert not [
        w for w in list_workloads(store, SYSTEM, limit=500).items
        if w.placement is not None and w.placement.node == drift
    ]  # fmt: skip
    # admitted through the verifier, not by the loader; the records say simulated
    first = list_events(store, SYSTEM, action="node.state", target_id=admitted[0].name).items
    assert first[0].details["reason"] == "attestation passed (simulated attester)"
    fails = list_events(store, SYSTEM, action="node.attest", target_id=drift).items
    assert [e.details["ok"] for e in fails] == [True, False]
    assert all(e.details["simulated"] for e in fails)
    assert fails[1].details["reasons"] == ["kernel_not_allowed"]
    evicted = list_events(store, SYSTEM, action="workload.*", target_id="claims-triage").items
    assert any(e.action != "workload.submit" for e in evicted)


def test_demo_drifting_node_is_quarantined_and_its_work_moves(store: Store) -> None:
    counts, attester = demo.load_attested_demo(store, _spec())
    assert counts == {"tenants": 5, "nodes": 24, "workloads": 13}
    _check_drift(store, demo.DRIFT_NODE)
    # later rounds: the good nodes stay admitted, the drifting one stays quarantined
    later = {o.node: o.state for o in attester.round_all()}
    assert later[demo.DRIFT_NODE] == "quarantined"
    assert sum(s == "admitted" for s in later.values()) == 21


def _check_swtpm_nodes(store: Store, names: list[str]) -> None:
    """Admitted through real quotes: not simulated anywhere, latest verdict pass, no reasons."""
    policies = {p["node_class"]: p for p in svc.list_policies(store, SYSTEM)}
    assert policies[demo_swtpm.NODE_CLASS]["enforce"] is True
    for name in names:
        node = get_node(store, SYSTEM, name)
        assert node.labels["node-class"] == demo_swtpm.NODE_CLASS
        assert node.state is NodeState.ADMITTED
        assert node.state_reason == "attestation passed"
        assert svc.attestation_status(store, SYSTEM, name)["simulated"] is False
        latest = svc.list_evidence(store, SYSTEM, name)[0]
        assert latest["ok"] is True and latest["reasons"] == [] and latest["simulated"] is False
        assert "simulated" not in latest["record"]
        assert latest["policy_id"] == "demo-swtpm-boot"
        record = load_record(json.dumps(latest["record"]))
        assert record.evidence.eventlog and record.evidence.inventory is not None
        assert record.evidence.inventory["source"] == "cluster-file"
        assert replay_record(record).ok  # the stored quote re-verifies offline
        events = list_events(store, SYSTEM, action="node.attest", target_id=name).items
        assert events and not any(e.details.get("simulated") for e in events)


def test_up_runs_the_attested_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free_tcp_port: int
) -> None:
    missing = demo_swtpm.missing_tools()
    if missing and IN_CI:
        unavailable(f"swtpm/tpm2-tools missing: {', '.join(missing)} (scripts/test-deps.sh)")
    for var in [v for v in os.environ if v.startswith("PROOFPLANE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setattr(cli_credentials, "config_dir", lambda: tmp_path / "xdg-config" / "pp")
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(server_cli.uvicorn, "run", lambda a, **kw: calls.append({"app": a}))
    demo_db = tmp_path / "demo.db"
    monkeypatch.setattr(server_cli, "demo_database_path", lambda: demo_db)
    fleets: list[demo_swtpm.SwtpmFleet] = []
    start = demo_swtpm.SwtpmFleet.start

    def recorded(nodes: list[object]) -> demo_swtpm.SwtpmFleet:
        fleets.append(start(nodes))  # type: ignore[arg-type]
        return fleets[-1]

    monkeypatch.setattr(demo_swtpm.SwtpmFleet, "start", recorded)
    started = datetime.now(UTC)
    result = CliRunner().invoke(app, ["up", "--port", str(free_tcp_port)])
    assert result.exit_code == 0, result.output
    assert "5 tenants, 24 nodes, 13 workloads" in result.stdout
    served = calls[0]["app"]
    assert served.state.settings.demo_attester == "simulated"  # type: ignore[attr-defined]
    store = Store(f"sqlite:///{demo_db}")
    try:
        _check_drift(store, demo.DRIFT_NODE)
        assert datetime.now(UTC) - started < timedelta(seconds=30)
        if missing:
            assert "swtpm/tpm2-tools not installed" in result.stdout and not fleets
            return
        names = list(demo_swtpm.SWTPM_NODES)
        assert "attesting with swtpm" in result.stdout
        assert f"{', '.join(names)}; the other nodes use the simulated attester" in result.stdout
        _check_swtpm_nodes(store, names)
    finally:
        store.dispose()
    # `up` stopped them on its way out (the served app returned here)
    [fleet] = fleets
    assert fleet.nodes == tuple(names)
    assert fleet.running == [] and not fleet.workdir.exists()
    assert all(a.tpm.proc is None for a in fleet.agents)


def test_up_falls_back_to_simulated_nodes_without_swtpm(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    monkeypatch.setattr(demo_swtpm, "missing_tools", lambda: ["swtpm"])
    fleet, line = server_cli._swtpm_nodes(spec)
    assert fleet is None
    assert line == (
        "swtpm/tpm2-tools not installed (swtpm missing): every demo node uses the simulated "
        "attester"
    )
    monkeypatch.setattr(demo_swtpm, "missing_tools", lambda: [])

    def broken(nodes: object) -> None:
        raise swtpm_harness.TpmToolError("swtpm_setup failed (1): no")

    monkeypatch.setattr(demo_swtpm.SwtpmFleet, "start", broken)
    fleet, line = server_cli._swtpm_nodes(spec)
    assert fleet is None and line.startswith("swtpm did not start (swtpm_setup failed (1): no)")
    # an EK CA bundle would refuse the swtpm EKs' throwaway CA; an operator may opt out
    monkeypatch.setenv("PROOFPLANE_EK_CA_BUNDLE", "/etc/ek-ca.pem")
    fleet, line = server_cli._swtpm_nodes(spec)
    assert fleet is None and line.startswith("PROOFPLANE_EK_CA_BUNDLE is set")
    monkeypatch.delenv("PROOFPLANE_EK_CA_BUNDLE")
    monkeypatch.setenv("PROOFPLANE_DEMO_SWTPM", "0")
    fleet, line = server_cli._swtpm_nodes(spec)
    assert fleet is None and line.startswith("PROOFPLANE_DEMO_SWTPM=0")


def test_swtpm_nodes_are_picked_where_no_placement_depends_on_them() -> None:
    spec = _spec()
    assert demo_swtpm.pick_nodes(spec) == list(demo_swtpm.SWTPM_NODES)
    nodes = {ns.node.name: ns for ns in spec.nodes}
    for name in demo_swtpm.SWTPM_NODES:
        assert nodes[name].state is NodeState.ADMITTED and not nodes[name].certifications
    # another cluster file: its first admitted nodes, never the drifting one
    others = dataclasses.replace(
        spec, nodes=tuple(ns for ns in spec.nodes if ns.node.name not in demo_swtpm.SWTPM_NODES)
    )
    picked = demo_swtpm.pick_nodes(others, drift_node="fra-h100-01")
    assert picked == ["fra-h100-02", "fra-h100-03"]


def test_swtpm_class_policy_follows_the_log_and_the_gpus() -> None:
    log = swtpm_harness.boot_log(kernel=b"vmlinuz-demo")
    fleet = demo_swtpm.SwtpmFleet(Path("/nonexistent"), "synthetic", log)
    spec = _spec()
    nodes = [ns.node for ns in spec.nodes if ns.node.name in demo_swtpm.SWTPM_NODES]
    doc = fleet.policy(nodes)
    assert doc["node_class"] == "demo-swtpm" and doc["require_secure_boot"] is True
    assert doc["allowed_kernels"] == [hashlib.sha256(b"vmlinuz-demo").hexdigest()]
    assert len(doc["allowed_boot_apps"]) == 2 and sorted(doc["golden_pcrs"]) == [
        str(i) for i in range(10)
    ]
    assert doc["allowed_vbios"] == ["92.00.25.00.08", "96.00.99.00.01"]
    assert doc["min_driver"] == "550.127.05" and doc["require_inventory"] is True
