"""MIG layouts the server's scheduler makes on its own (issue 17 §2, ``PROOFPLANE_MIG_AUTO_LAYOUT``)
through the HTTP API: carving a new instance into a GPU's free slices beside running work,
never on a node the workload may not use, never destroying an instance; ``idle`` only re-lays
GPUs that hold no work, ``off`` changes no layout; the layout and the placement are written in
one transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_nodes import register_admitted
from proofplane import config
from proofplane.errors import ProofplaneError
from proofplane.service.context import Store, Tx

API = "/api/v1"


@pytest.fixture
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``PROOFPLANE_MIG_AUTO_LAYOUT`` for the test (``request.param``; default ``on``), set
    before the client loads a scheduler (list this fixture before ``client``)."""
    value = getattr(request, "param", "on")
    monkeypatch.setenv(config.MIG_AUTO_LAYOUT_ENV, value)
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")  # nothing moves: layouts only
    yield value


def mig_node(
    client: TestClient,
    name: str,
    layouts: list[list[str]],
    certs: dict[str, str] | None = None,
) -> None:
    """An admitted node of H100s in MIG mode, one GPU per layout (``profile@start`` items)."""
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-{name}-{i}",
            "model": "H100-80GB",
            "mig_enabled": True,
            "mig_instances": [
                {"profile": item.split("@")[0], "start": int(item.split("@")[1])} for item in layout
            ],
        }
        for i, layout in enumerate(layouts)
    ]
    register_admitted(client, {"name": name, "region": "eu", "zone": "eu-1", "gpus": gpus}, certs)


def tenant(client: TestClient, name: str, **profile: Any) -> None:
    r = client.post(f"{API}/tenants", json={"name": name, "profile": profile})
    assert r.status_code == 201, r.text


def submit(client: TestClient, name: str, tenant: str, profile: str) -> dict[str, Any]:
    body = {"name": name, "tenant": tenant, "gpus": {"mig_profile": profile}}
    r = client.post(f"{API}/workloads", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def layout(client: TestClient, node: str, gpu: int) -> list[str]:
    gpus = {g["index"]: g for g in client.get(f"{API}/nodes/{node}").json()["gpus"]}
    return sorted(f"{i['profile']}@{i['start']}" for i in gpus[gpu]["mig_instances"])


def device(w: dict[str, Any]) -> tuple[str, int, str, int]:
    d = w["placement"]["devices"][0]
    return w["placement"]["node"], d["gpu_index"], d["mig_profile"], d["mig_start"]


def events(client: TestClient, action: str) -> list[dict[str, Any]]:
    return client.get(f"{API}/events", params={"action": action, "limit": 500}).json()["items"]


def test_a_new_instance_is_carved_beside_running_work_and_recorded(
    mode: str, client: TestClient
) -> None:
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0"]])  # slices 4-7 free
    a = submit(client, "a", "lab", "3g.40gb")
    assert device(a) == ("m", 0, "3g.40gb", 0)
    b = submit(client, "b", "lab", "1g.10gb")  # no free 1g instance, no idle GPU
    assert b["status"] == "placed", b
    node, gpu, profile, start = device(b)
    assert (node, gpu, profile) == ("m", 0, "1g.10gb") and start >= 4
    assert layout(client, "m", 0) == sorted(["3g.40gb@0", f"1g.10gb@{start}"])
    (change,) = events(client, "node.gpu.repartition")
    d = change["details"]
    assert change["target_id"] == "m" and d["gpu_index"] == 0
    assert (d["before"], d["after"]) == (["3g.40gb@0"], ["3g.40gb@0", f"1g.10gb@{start}"])
    assert (d["by"], d["step"], d["for_workload"]) == ("scheduler", "carve", "lab/b")
    assert "carved" in d["why"]
    (placed,) = [e for e in events(client, "workload.place") if e["target_id"] == "b"]
    assert placed["details"]["repartitioned"] == ["m/gpu0"]
    # the running work kept its instance; the new one is reused once free
    assert device(client.get(f"{API}/workloads/a").json()) == ("m", 0, "3g.40gb", 0)
    assert client.post(f"{API}/workloads/b/cancel", json={}).status_code == 200
    c = submit(client, "c", "lab", "1g.10gb")
    assert device(c) == ("m", 0, "1g.10gb", start)
    assert len(events(client, "node.gpu.repartition")) == 1


@pytest.mark.parametrize(("mode", "lands_on"), [("on", 0), ("idle", 1)], indirect=["mode"])
def test_idle_mode_never_carves_a_gpu_holding_work(
    mode: str, lands_on: int, client: TestClient
) -> None:
    """GPU 0 holds work and has free slices; GPU 1 holds no work and no free slice. ``on``
    carves GPU 0 (no instance touched); ``idle`` leaves it as it is and re-lays GPU 1."""
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0"], ["7g.80gb@0"]])
    assert device(submit(client, "a", "lab", "3g.40gb")) == ("m", 0, "3g.40gb", 0)
    b = submit(client, "b", "lab", "1g.10gb")
    assert device(b)[:3] == ("m", lands_on, "1g.10gb")
    (change,) = events(client, "node.gpu.repartition")
    assert change["details"]["gpu_index"] == lands_on
    if mode == "idle":
        assert layout(client, "m", 0) == ["3g.40gb@0"]
        assert change["details"]["step"] == "repartition"
        assert change["details"]["before"] == ["7g.80gb@0"]
    else:
        assert layout(client, "m", 1) == ["7g.80gb@0"]
        assert change["details"]["step"] == "carve"


@pytest.mark.parametrize("mode", ["off"], indirect=True)
def test_off_changes_no_layout_and_the_request_waits_with_its_reason(
    mode: str, client: TestClient
) -> None:
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0"], []])  # free slices beside work; an empty MIG GPU
    assert device(submit(client, "a", "lab", "3g.40gb")) == ("m", 0, "3g.40gb", 0)
    b = submit(client, "b", "lab", "1g.10gb")
    assert b["status"] == "pending" and b["reason"] == "insufficient_capacity"
    assert b["reason_details"]["rejections"] == {"insufficient_gpu_capacity": 1}
    assert (layout(client, "m", 0), layout(client, "m", 1)) == (["3g.40gb@0"], [])
    assert events(client, "node.gpu.repartition") == []


def test_carving_never_happens_on_a_node_the_workload_may_not_use(
    mode: str, client: TestClient
) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    tenant(client, "lab")
    mig_node(client, "hip", [["3g.40gb@0", "3g.40gb@4"]], certs={"hipaa": "true"})
    mig_node(client, "plain", [[]])  # an empty MIG GPU: carvable, but not certified
    assert device(submit(client, "c1", "clinic", "3g.40gb"))[:2] == ("hip", 0)
    assert device(submit(client, "c2", "clinic", "3g.40gb"))[:2] == ("hip", 0)
    w = submit(client, "c3", "clinic", "1g.10gb")  # the certified GPU is full
    assert w["status"] == "pending" and w["reason"] == "insufficient_capacity"
    assert w["reason_details"]["rejections"] == {
        "missing_certification": 1,
        "insufficient_gpu_capacity": 1,
    }
    assert layout(client, "plain", 0) == [] and events(client, "node.gpu.repartition") == []
    # the general pool may use it: the same request is carved there
    assert device(submit(client, "l1", "lab", "1g.10gb"))[:3] == ("plain", 0, "1g.10gb")
    assert [e["target_id"] for e in events(client, "node.gpu.repartition")] == ["plain"]
    assert client.get(f"{API}/workloads/c3").json()["status"] == "pending"


class Injected(ProofplaneError):
    """A failure injected after the layout was written, before the placement was."""

    code = "injected"


def test_the_layout_and_the_placement_are_one_transaction(
    mode: str, client: TestClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0"]])
    submit(client, "a", "lab", "3g.40gb")
    record = Tx.record

    def failing(self: Tx, action: str, *args: Any, **kw: Any) -> Any:
        if action == "workload.place":
            raise Injected("the placement could not be written")
        return record(self, action, *args, **kw)

    monkeypatch.setattr(Tx, "record", failing)
    for path, body in (
        ("/workloads", {"name": "b", "tenant": "lab", "gpus": {"mig_profile": "1g.10gb"}}),
        (
            "/workloads/batch",
            {"items": [{"name": "b", "tenant": "lab", "gpus": {"mig_profile": "1g.10gb"}}]},
        ),
    ):
        r = client.post(f"{API}{path}", json=body)
        assert r.status_code >= 400, r.text
        # neither the new layout nor the workload nor any of their events was kept
        assert layout(client, "m", 0) == ["3g.40gb@0"]
        assert client.get(f"{API}/workloads/b").status_code == 404
        assert events(client, "node.gpu.repartition") == []
    monkeypatch.setattr(Tx, "record", record)
    # the scheduler kept nothing of the failed decisions either: the same request carves
    b = submit(client, "b", "lab", "1g.10gb")
    assert b["status"] == "placed" and len(events(client, "node.gpu.repartition")) == 1


@pytest.mark.parametrize("raw", ["yes", "1", "carve", "on off"])
def test_a_malformed_setting_is_refused_at_start(raw: str) -> None:
    with pytest.raises(ProofplaneError) as err:
        config.from_env({config.MIG_AUTO_LAYOUT_ENV: raw})
    assert err.value.code == "invalid_setting"
    assert config.MIG_AUTO_LAYOUT_ENV in str(err.value)


@pytest.mark.parametrize(
    ("raw", "want"),
    [("", "on"), ("on", "on"), (" IDLE ", "idle"), ("Off", "off"), ("Reclaim", "reclaim")],
)
def test_the_setting_is_parsed(raw: str, want: str) -> None:
    assert config.from_env({config.MIG_AUTO_LAYOUT_ENV: raw}).mig_auto_layout == want
    assert config.mig_auto_layout({config.MIG_AUTO_LAYOUT_ENV: raw}) == want


@pytest.mark.parametrize("mode", ["on", "reclaim"], indirect=True)
def test_reclaim_destroys_idle_instances_beside_running_work(mode: str, client: TestClient) -> None:
    """A GPU runs a 3g at slot 0 and holds three idle 1g instances in slots 4-6; a 3g.40gb
    request finds no free instance and no free slices. ``on`` never destroys an instance: it
    waits. ``reclaim`` destroys the three idle 1g instances (the running 3g untouched), carves
    3g@4 and places it there, a ``node.gpu.repartition`` event with step ``reclaim``, which
    ``workloads explain`` reports."""
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0", "1g.10gb@4", "1g.10gb@5", "1g.10gb@6"]])
    first = submit(client, "a", "lab", "3g.40gb")
    assert device(first) == ("m", 0, "3g.40gb", 0)
    b = submit(client, "b", "lab", "3g.40gb")
    if mode == "on":
        assert b["status"] == "pending" and events(client, "node.gpu.repartition") == []
        assert layout(client, "m", 0) == ["1g.10gb@4", "1g.10gb@5", "1g.10gb@6", "3g.40gb@0"]
        return
    assert device(b) == ("m", 0, "3g.40gb", 4)
    assert layout(client, "m", 0) == ["3g.40gb@0", "3g.40gb@4"]
    (ev,) = events(client, "node.gpu.repartition")
    assert ev["details"]["step"] == "reclaim"
    assert ev["details"]["before"] == ["3g.40gb@0", "1g.10gb@4", "1g.10gb@5", "1g.10gb@6"]
    assert "idle instances of the GPU destroyed" in ev["details"]["why"]
    m = client.get(f"{API}/workloads/b/explain").json()["mig_layout"]
    (change,) = m["changes"]
    assert (m["auto_layout"], change["step"], change["carved"]) == ("reclaim", "reclaim",
                                                                   ["3g.40gb@4"])  # fmt: skip
    # the running 3g kept its instance: still placed where it was
    assert device(client.get(f"{API}/workloads/a").json()) == ("m", 0, "3g.40gb", 0)


# --- workloads explain says what the scheduler did to MIG layouts (issue 17 §2) ----------------


def explain(client: TestClient, name: str) -> dict[str, Any]:
    r = client.get(f"{API}/workloads/{name}/explain")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_explain_names_the_instance_carved_for_a_placement(mode: str, client: TestClient) -> None:
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0"]])
    submit(client, "a", "lab", "3g.40gb")  # the free instance: nothing carved
    assert explain(client, "a")["mig_layout"] is None
    b = submit(client, "b", "lab", "1g.10gb")
    _node, _gpu, _profile, start = device(b)
    m = explain(client, "b")["mig_layout"]
    assert m["auto_layout"] == "on"
    (change,) = m["changes"]
    assert (change["node"], change["gpu_index"], change["step"]) == ("m", 0, "carve")
    assert change["carved"] == [f"1g.10gb@{start}"]
    assert (change["before"], change["after"]) == (["3g.40gb@0"], ["3g.40gb@0", f"1g.10gb@{start}"])
    assert "carved" in change["why"]
    assert m["instances"] == [{"node": "m", "gpu_index": 0, "profile": "1g.10gb", "start": start}]
    # an instance freed by a departure is reused: nothing carved for the next one
    assert client.post(f"{API}/workloads/b/cancel", json={}).status_code == 200
    assert explain(client, "b")["mig_layout"] is None  # finished: it holds nothing now
    submit(client, "c", "lab", "1g.10gb")
    assert explain(client, "c")["mig_layout"] is None


def test_explain_names_the_idle_gpu_re_laid_for_a_placement(mode: str, client: TestClient) -> None:
    tenant(client, "lab")
    mig_node(client, "m", [["7g.80gb@0"]])  # idle, no free slice: carving cannot help
    b = submit(client, "b", "lab", "1g.10gb")
    assert b["status"] == "placed", b
    m = explain(client, "b")["mig_layout"]
    (change,) = m["changes"]
    assert (change["node"], change["gpu_index"], change["step"]) == ("m", 0, "repartition")
    assert change["before"] == ["7g.80gb@0"] and "7g.80gb@0" not in change["after"]
    assert change["why"] == "no free 1g.10gb instance; the GPU was idle"
    assert change["freed_by_defragmentation"] is False
    assert [i["profile"] for i in m["instances"]] == ["1g.10gb"]


@pytest.mark.parametrize("mode", ["off", "idle"], indirect=True)
def test_explain_says_a_waiting_request_needs_carving_that_is_off(
    mode: str, client: TestClient
) -> None:
    tenant(client, "lab")
    mig_node(client, "m", [["3g.40gb@0"]])  # slices 4-7 free, but the GPU holds work
    submit(client, "a", "lab", "3g.40gb")
    b = submit(client, "b", "lab", "1g.10gb")
    assert b["status"] == "pending" and b["reason"] == "insufficient_capacity"
    m = explain(client, "b")["mig_layout"]
    assert m["auto_layout"] == mode and m["disabled"] == ["carve"]
    assert m["would_place_on"] == "m" and m["would"][0]["step"] == "carve"
    assert (
        "carving 1g.10gb@" in m["message"] and f"PROOFPLANE_MIG_AUTO_LAYOUT={mode}" in m["message"]
    )
    assert layout(client, "m", 0) == ["3g.40gb@0"]  # explaining changed nothing
    # what carving could not place either is not said
    submit(client, "c", "lab", "7g.80gb")
    assert explain(client, "c")["mig_layout"] is None
