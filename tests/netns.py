"""Network namespaces for the tests: "GPU nodes" joined by a veth underlay, workload namespaces,
probes (ping, TCP connect), listeners and packet captures, all torn down by the names made.

The recipe is /work/shared/notes/network-namespaces.md (what this kernel can do): named
namespaces (``ip netns add``), an underlay bridge in its own namespace with one veth per node
(``ul0`` inside the node, 10.250.0.<i>/24), VXLAN on top. Every namespace a :class:`Lab` makes
or adopts is deleted by its name when the lab closes, also when the test fails; the
processes it started (listeners, captures, agents) are stopped first.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ``ip``, ``bridge``, ``nft``, ``ping``, ``tcpdump``
and a kernel with veth, bridge and vxlan: :func:`require` skips a test without them (fails it
in CI, tests/ci.py).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ci import unavailable

TOOLS = ("ip", "bridge", "nft", "ping", "tcpdump")
NETNS_DIR = Path("/run/netns")
UNDERLAY = "10.250.0"  # node i has 10.250.0.<i>/24 on its ul0

# A TCP server for a workload namespace: accepts and closes; prints "ready" once listening.
LISTENER = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(16)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.close()\n"
)
# One TCP connect attempt: exit 0 when it connected within the timeout.
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
)


def missing() -> list[str]:
    """What this machine lacks for the namespace tests ([] when nothing)."""
    out = [] if os.geteuid() == 0 else ["root"]
    out += [t for t in TOOLS if shutil.which(t) is None]
    if out:
        return out
    probe = f"ppprobe{secrets.token_hex(3)}"
    try:
        if run(["ip", "netns", "add", probe], check=False).returncode != 0:
            return ["network namespaces (ip netns add)"]
        lines = [
            "link add vxp0 type vxlan id 42 dstport 4789 nolearning",
            "link add brp0 type bridge",
            "link add vep0 type veth peer name vep1",
        ]
        for line in lines:
            if run(["ip", "-n", probe, *line.split()], check=False).returncode != 0:
                out.append(f"kernel support for: ip {line}")
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return out


def require() -> None:
    """Skip (locally) or fail (CI) a test this machine cannot run."""
    lacking = missing()
    if lacking:
        unavailable(
            "network namespace tests need "
            + ", ".join(lacking)
            + " (run as root; scripts/test-deps.sh installs iproute2 nftables iputils-ping tcpdump)"
        )


def run(
    argv: Sequence[str], *, check: bool = True, timeout: float = 30, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, check=False, input=input
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: rc {proc.returncode}: {proc.stderr.strip()}")
    return proc


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


@dataclass
class Node:
    """A "GPU node": its namespace, underlay device and VTEP."""

    name: str
    netns: str
    vtep: str
    underlay_dev: str = "ul0"


@dataclass
class Lab:
    """The namespaces and processes of one test (see the module docstring). ``tag`` keeps the
    names of concurrent runs apart."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def netns(self, name: str) -> str:
        """Make namespace ``name`` (exact) and own it."""
        run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def adopt(self, name: str) -> None:
        """Delete ``name`` with the lab (a namespace someone else makes, e.g. the agent's
        ``ppw-<8>``), whether or not it exists yet."""
        if name not in self.namespaces:
            self.namespaces.append(name)

    def underlay(self, count: int) -> list[Node]:
        """``count`` node namespaces ``ppn<tag>-<i>`` (i from 1), each with ``ul0`` at
        10.250.0.<i>/24 on a bridge in the namespace ``ppu<tag>``."""
        hub = self.netns(f"ppu{self.tag}")
        run(["ip", "-n", hub, "link", "add", "ulbr", "type", "bridge"])
        run(["ip", "-n", hub, "link", "set", "ulbr", "up"])
        nodes = []
        for i in range(1, count + 1):
            ns = self.netns(f"ppn{self.tag}-{i}")
            port = f"ulp{i}"
            run(
                [
                    "ip",
                    "-n",
                    hub,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "ul0",
                    "netns",
                    ns,
                ]
            )
            run(["ip", "-n", hub, "link", "set", port, "master", "ulbr", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{UNDERLAY}.{i}/24", "dev", "ul0"])
            run(["ip", "-n", ns, "link", "set", "ul0", "up"])
            nodes.append(Node(f"gpu-{i}", ns, f"{UNDERLAY}.{i}"))
        return nodes

    def kill_node(self, node: Node) -> None:
        """The node dies: its namespace (and every link in it, so its workloads' veth ends)
        goes away."""
        run(["ip", "netns", "del", node.netns], check=False)

    def start(
        self,
        argv: Sequence[str],
        *,
        ready: str | None = None,
        stream: str = "stdout",
        timeout: float = 10,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen[str]:
        """Start a process the lab stops; with ``ready``, wait until that text appears on its
        ``stream`` (stdout or stderr); with ``log``, its output goes to that file instead (a
        long-running process nobody reads must not fill a pipe)."""
        if log is not None:
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    list(argv),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                    env=env,
                )
            self.procs.append(proc)
            return proc
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.procs.append(proc)
        if ready is not None:
            pipe = proc.stdout if stream == "stdout" else proc.stderr
            assert pipe is not None
            seen = _wait_line(pipe, ready, timeout)
            if not seen:
                proc.kill()
                out_text, err = proc.communicate(timeout=5)
                raise AssertionError(f"{' '.join(argv)} not ready: {out_text[-500:]} {err[-500:]}")
        return proc

    def listen(self, ns: str, port: int) -> subprocess.Popen[str]:
        """A TCP listener on ``port`` in namespace ``ns``."""
        return self.start(in_ns(ns, sys.executable, "-c", LISTENER, str(port)), ready="ready")

    def capture(self, ns: str, iface: str, bpf: str) -> Capture:
        """tcpdump in ``ns`` on ``iface`` (``bpf``: its filter), until :meth:`Capture.stop`."""
        argv = in_ns(ns, "tcpdump", "-n", "-l", "-p", "-i", iface, bpf)
        proc = self.start(argv, ready="listening on", stream="stderr")
        return Capture(proc)

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)
        self.procs.clear()
        for name in reversed(self.namespaces):
            if (NETNS_DIR / name).exists():
                run(["ip", "netns", "del", name], check=False)
        self.namespaces.clear()


@contextmanager
def lab() -> Iterator[Lab]:
    """A :class:`Lab`, closed on exit (also when the test fails)."""
    made = Lab()
    try:
        yield made
    finally:
        made.close()


def _wait_line(pipe: object, text: str, timeout: float) -> bool:
    found = threading.Event()

    def read() -> None:
        for line in pipe:  # type: ignore[attr-defined]
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Stop a process started with its own session (and its children); its remaining output."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate(timeout=5)
    except ValueError:  # a pipe a reader thread holds
        proc.wait(timeout=5)
        return "", ""


class Capture:
    """A running tcpdump; :meth:`stop` gives the packets it printed (one line each)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        assert proc.stdout is not None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip():
                self.lines.append(line.rstrip("\n"))

    def stop(self) -> list[str]:
        time.sleep(0.1)  # the last packets reach tcpdump's output
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        return list(self.lines)


def ping(ns: str, ip: str) -> subprocess.Popen[str]:
    """Start ``ping -c 2 -i 0.2 -W 1`` from ``ns`` (a negative costs ~1.2 s): wait on it with
    :func:`reached`."""
    return subprocess.Popen(
        in_ns(ns, "ping", "-n", "-c", "2", "-i", "0.2", "-W", "1", ip),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def connect(ns: str, ip: str, port: int, timeout: float = 1.0) -> subprocess.Popen[str]:
    """Start one TCP connect from ``ns``: wait on it with :func:`reached`."""
    return subprocess.Popen(
        in_ns(ns, sys.executable, "-c", CONNECT, ip, str(port), str(timeout)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reached(proc: subprocess.Popen[str]) -> bool:
    """Whether a :func:`ping` (any reply) or :func:`connect` succeeded."""
    proc.communicate(timeout=30)
    return proc.returncode == 0


def wait_until(predicate: object, timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until ``predicate()`` held (polled every ``interval``), None if it never did."""
    t0 = time.monotonic()
    while True:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(interval)
