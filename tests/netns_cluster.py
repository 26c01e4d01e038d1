"""Issue 14's proof in network namespaces, as one scenario the test asserts on and the
benchmark (bench/network.py's ``convergence`` section) reports from.

A real server (the API on uvicorn, a fresh SQLite database, no execution engine: workloads are
placed, never run), three "GPU nodes" as network namespaces on a veth underlay
(tests/netns.py), and on each node the real agent — ``proofplane agent --apply-network
--netns <node>`` as a process, registering its underlay and then applying its desired state
every ``interval`` seconds. Two tenants use **the same subnet** 10.10.0.0/24:

    acme   (policy: ICMP and tcp 29500 inside the tenant, nothing else)
           a1 on gpu-1 (10.10.0.1), a2 on gpu-2 (10.10.0.2)
    globex (the default policy: everything inside the tenant)
           b1 on gpu-1 (10.10.0.1), b2 on gpu-2 (10.10.0.2),
           b3 on gpu-1 (10.10.0.3), b4 on gpu-2 (10.10.0.4)

Placement goes through the API (POST /workloads) and the scheduler; the nodes' certifications
(rack r1 / r2) and the workloads' tags put the work where the matrix needs it, and gpu-3
(rack r2) stays cordoned until gpu-2 is about to fail, so it is where gpu-2's work goes. Each
workload's network end is the veth peer the agent makes in ``ppw-<8 hex>``.

The matrix, probed from a1 (pings ``-c 2 -i 0.2 -W 1``, TCP connects with a 1 s timeout, the
negative ones side by side), with tcpdump in every globex namespace counting frames from a1's
MAC — it must see none:

* same tenant across nodes: a1 → a2 (ping, and tcp 29500: allowed), b1 → b2 (ping, and tcp
  8080: globex allows everything inside);
* cross-tenant on the same node: a1 → 10.10.0.3 (only b3 has it, on a1's node): no answer;
* cross-tenant across nodes: a1 → 10.10.0.4 (b4's, on gpu-2): no answer; and a1 → a2's
  10.10.0.2, which b2 also has: only a2 answers;
* a denied port: a1 → a2 tcp 8080 (a listener is there, reachable inside a2): closed.

Then gpu-2 dies (its agent stops, its namespace goes away) and is marked failed through the
API; the scheduler re-places a2, b2, b4 on gpu-3, the agents converge, and the matrix runs
again. Convergence is measured from the API call: ``control_plane_s`` until every live node's
agent reported the node's current desired generation with a passing self-check and no drift,
``data_plane_s`` until a1's first ping to a2 (now on gpu-3) was answered.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import netns
from live_server import serve
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate

TOKEN = "ppt_netns-admin-token-0123456789abcdef"
API = "/api/v1"
SUBNET = "10.10.0.0/24"
ACME_POLICY = {
    "subnet": SUBNET,
    "allow": [{"proto": "icmp"}, {"proto": "tcp", "ports": 29500, "source": "tenant"}],
}
# (workload, tenant key, rack): submitted in this order (so each tenant's addresses are .1, .2, …)
WORKLOADS = (
    ("a1", "a", "r1"),
    ("a2", "a", "r2"),
    ("b1", "b", "r1"),
    ("b2", "b", "r2"),
    ("b3", "b", "r1"),
    ("b4", "b", "r2"),
)
RACKS = {"gpu-1": "r1", "gpu-2": "r2", "gpu-3": "r2"}
ALLOWED, DENIED = 29500, 8080


@dataclass(frozen=True)
class Where:
    """A workload's network end, as its node's desired state says."""

    workload: str
    tenant: str
    node: str
    ip: str
    mac: str
    netns: str
    peer_if: str


class Cluster:
    """The running scenario: server, lab, agents, and the API as the admin."""

    def __init__(self, lab: netns.Lab, url: str, tmp: Path, interval: float) -> None:
        self.lab = lab
        self.url = url
        self.tmp = tmp
        self.interval = interval
        self.api = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
        self.tag = lab.tag
        self.tenants = {"a": f"acme-{self.tag}", "b": f"globex-{self.tag}"}
        self.nodes = {n.name: n for n in lab.underlay(3)}
        self.agents: dict[str, Any] = {}

    # ------------------------------------------------------------------ API
    def call(
        self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201)
    ) -> Any:
        r = self.api.request(method, API + path, json=body)
        if r.status_code not in ok:
            raise AssertionError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else None

    def workload(self, short: str) -> str:
        return f"{short}-{self.tag}"

    def register(self, name: str, cordon: bool) -> None:
        gpus = [
            {"index": i, "uuid": f"GPU-{name}-{self.tag}-{i}", "model": "H100-80GB"}
            for i in range(4)
        ]
        self.call("POST", "/nodes", {"name": name, "region": "eu", "zone": "eu-1", "gpus": gpus})
        self.admit(name)
        self.call("POST", f"/nodes/{name}/certifications", {"key": "rack", "value": RACKS[name]})
        if cordon:
            self.call("POST", f"/nodes/{name}/state", {"state": "cordoned"})

    def admit(self, name: str) -> None:
        self.call("POST", f"/nodes/{name}/state", {"state": "admitted"})

    def start_agent(self, name: str) -> None:
        token = self.call("POST", f"/nodes/{name}/agent-credentials", {"ttl_days": 1})["token"]
        node = self.nodes[name]
        log = self.tmp / f"agent-{name}.log"
        argv = [
            sys.executable,
            "-m",
            "proofplane.cli.main",
            "agent",
            "--apply-network",
            "--server",
            self.url,
            "--token",
            token,
            "--node",
            name,
            "--netns",
            node.netns,
            "--underlay-dev",
            node.underlay_dev,
            "--state-dir",
            str(self.tmp / f"st-{name}"),
            "--interval",
            str(self.interval),
            "--json",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
        self.agents[name] = self.lab.start(argv, log=log, env=env)

    def stop_agent(self, name: str) -> None:
        netns.stop(self.agents.pop(name))

    def agent_log(self, name: str) -> str:
        path = self.tmp / f"agent-{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def status(self) -> dict[str, dict[str, Any]]:
        items = self.call("GET", "/network/nodes?limit=100")["items"]
        return {i["node"]: i for i in items}

    def converged(self, live: list[str]) -> bool:
        """Every live node's agent reported its current desired generation, passing, no drift."""
        st = self.status()
        return all(
            n in st
            and st[n]["applied_generation"] == st[n]["desired_generation"]
            and st[n]["network_drift"] is False
            for n in live
        )

    def placed(self) -> dict[str, str]:
        """workload → node for the scenario's placed workloads."""
        out = {}
        for short, _t, _r in WORKLOADS:
            w = self.call("GET", f"/workloads/{self.workload(short)}")
            if w.get("status") in ("placed", "running") and w.get("placement"):
                out[short] = w["placement"]["node"]
        return out

    def where(self, live: list[str]) -> dict[str, Where]:
        """Each workload's network end, from the nodes' desired states (what the agents apply)."""
        out = {}
        for name in live:
            doc = self.call("GET", f"/nodes/{name}/network")
            for seg in doc["segments"]:
                for e in seg["local"]:
                    short = e["workload"].split("/", 1)[1].rsplit("-", 1)[0]
                    out[short] = Where(
                        e["workload"],
                        e["tenant"],
                        name,
                        e["ip"],
                        e["mac"],
                        e["netns"],
                        e["peer_if"],
                    )
        return out


def _wait(what: str, predicate: Any, timeout: float, cluster: Cluster | None = None) -> float:
    took = netns.wait_until(predicate, timeout, interval=0.05)
    if took is None:
        logs = (
            ""
            if cluster is None
            else "\n".join(
                f"--- agent {n}:\n{cluster.agent_log(n)}" for n in sorted(cluster.agents)
            )
        )
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")
    return took


def matrix(c: Cluster, at: dict[str, Where]) -> dict[str, Any]:
    """The isolation matrix (see the module docstring): each check's result, True = as it must
    be, with the globex captures' packet counts."""
    a1, a2, b1, b2 = at["a1"], at["a2"], at["b1"], at["b2"]
    b_only_same = next(at[w] for w in ("b3", "b4") if at[w].node == a1.node)
    b_only_across = next(at[w] for w in ("b3", "b4") if at[w].node != a1.node)
    captures = {
        w: c.lab.capture(at[w].netns, at[w].peer_if, f"ether src {a1.mac}")
        for w in ("b1", "b2", "b3", "b4")
    }
    sanity = c.lab.capture(a2.netns, a2.peer_if, f"ether src {a1.mac}")
    t0 = time.monotonic()
    probes = {
        "same_tenant_across_nodes_ping": (netns.ping(a1.netns, a2.ip), True),
        "same_tenant_across_nodes_b_ping": (netns.ping(b1.netns, b2.ip), True),
        "allowed_port_open": (netns.connect(a1.netns, a2.ip, ALLOWED), True),
        "other_tenant_all_ports_open": (netns.connect(b1.netns, b2.ip, DENIED), True),
        "cross_tenant_same_node_ping": (netns.ping(a1.netns, b_only_same.ip), False),
        "cross_tenant_across_nodes_ping": (netns.ping(a1.netns, b_only_across.ip), False),
        "denied_port_closed": (netns.connect(a1.netns, a2.ip, DENIED), False),
        "denied_port_listening_inside": (netns.connect(a2.netns, "127.0.0.1", DENIED), True),
    }
    results = {name: netns.reached(p) == want for name, (p, want) in probes.items()}
    probe_s = time.monotonic() - t0
    seen = {w: cap.stop() for w, cap in captures.items()}
    results["cross_tenant_captures_see_nothing"] = all(not lines for lines in seen.values())
    results["capture_sees_same_tenant"] = any("ICMP echo request" in x for x in sanity.stop())
    return {
        "ok": all(results.values()),
        "checks": results,
        "globex_frames_from_a1": {w: len(lines) for w, lines in seen.items()},
        "globex_frame_samples": [x for lines in seen.values() for x in lines][:5],
        "placement": {w: x.node for w, x in sorted(at.items())},
        "probe_s": round(probe_s, 2),
    }


@contextlib.contextmanager
def cluster(interval: float = 0.5) -> Iterator[Cluster]:
    """The server, the lab and the agents of the scenario, torn down on exit."""
    netns.require()
    with netns.lab() as lab, tempfile.TemporaryDirectory(prefix="pp-netns-") as tmpdir:
        tmp = Path(tmpdir)
        url = f"sqlite:///{tmp / 'proofplane.db'}"
        store = Store(url)
        migrate.upgrade(store.engine)
        bootstrap_admin(store, TOKEN)
        with serve(store) as base:
            c = Cluster(lab, base, tmp, interval)
            try:
                yield c
            finally:
                for name in list(c.agents):
                    c.stop_agent(name)
                c.api.close()
                for short, _t, _r in WORKLOADS:  # the agents made these
                    lab.adopt(_netns_of(c, short))


def _netns_of(c: Cluster, short: str) -> str:
    from proofplane.network.desired import interface_id

    tenant = c.tenants[next(t for w, t, _r in WORKLOADS if w == short)]
    return "ppw-" + interface_id(f"{tenant}/{c.workload(short)}")


def run_scenario(interval: float = 0.5, log: Any = None) -> dict[str, Any]:
    """The whole scenario; its report (``ok``: every check of both matrices held)."""
    say = log or (lambda _m: None)
    t_start = time.monotonic()
    with cluster(interval) as c:
        for name in ("gpu-1", "gpu-2", "gpu-3"):
            c.register(name, cordon=name == "gpu-3")
        for name in c.nodes:
            c.start_agent(name)
        # each agent registers its underlay, then reports: the nodes are under management
        _wait("the agents' first reports", lambda: c.converged(list(c.nodes)), 30, c)
        c.call(
            "POST", "/tenants", {"name": c.tenants["a"], "profile": {"network_policy": ACME_POLICY}}
        )
        c.call("POST", "/tenants", {"name": c.tenants["b"], "profile": {}})
        for short, t, rack in WORKLOADS:
            c.call(
                "POST",
                "/workloads",
                {
                    "name": c.workload(short),
                    "tenant": c.tenants[t],
                    "gpus": {"count": 1},
                    "tags": {"rack": rack},
                },
            )
        live = ["gpu-1", "gpu-2", "gpu-3"]
        _wait("all six placed", lambda: len(c.placed()) == len(WORKLOADS), 30, c)
        _wait("the agents to apply", lambda: c.converged(live), 30, c)
        at = c.where(live)
        assert len(at) == len(WORKLOADS), at
        for w in ("a2", "b2"):
            c.lab.listen(at[w].netns, DENIED)
        c.lab.listen(at["a2"].netns, ALLOWED)
        say(f"placed: { ({w: x.node for w, x in sorted(at.items())}) }")
        before = matrix(c, at)
        say(f"matrix before failover: {before['checks']}")

        # gpu-2 dies; gpu-3 (rack r2) is there to take its work
        c.admit("gpu-3")
        c.stop_agent("gpu-2")
        c.lab.kill_node(c.nodes["gpu-2"])
        live = ["gpu-1", "gpu-3"]
        a1, a2 = at["a1"], at["a2"]
        t0 = time.monotonic()
        c.call("POST", "/nodes/gpu-2/state", {"state": "failed"})
        cp: float | None = None
        dp: float | None = None
        deadline = t0 + 30
        while (cp is None or dp is None) and time.monotonic() < deadline:
            if dp is None:
                probe = netns.run(
                    netns.in_ns(a1.netns, "ping", "-n", "-c", "1", "-W", "0.2", a2.ip), check=False
                )
                if probe.returncode == 0:
                    dp = time.monotonic() - t0
            if (
                cp is None
                and c.placed().get("a2") == "gpu-3"
                and len(c.placed()) == 6
                and (c.converged(live))
            ):
                cp = time.monotonic() - t0
            time.sleep(0.02)
        if cp is None or dp is None:
            raise AssertionError(
                f"no convergence in 30 s (control plane {cp}, data plane {dp})"
                + "".join(f"\n--- agent {n}:\n{c.agent_log(n)}" for n in sorted(c.agents))
            )
        at = c.where(live)
        say(
            f"converged: control plane {cp:.2f} s, data plane {dp:.2f} s; placed: "
            f"{ ({w: x.node for w, x in sorted(at.items())}) }"
        )
        after = matrix(c, at)
        say(f"matrix after failover: {after['checks']}")
        status = c.status()
    return {
        "ok": before["ok"] and after["ok"],
        "before": before,
        "after": after,
        "convergence": {"control_plane_s": round(cp, 2), "data_plane_s": round(dp, 2)},
        "agent_interval_s": interval,
        "self_checks": {n: s.get("self_check", {}).get("ok") for n, s in status.items()},
        "seconds": round(time.monotonic() - t_start, 1),
    }
