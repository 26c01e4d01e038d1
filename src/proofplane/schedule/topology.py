"""Topology-aware gang placement (issue 17 §4): pack a gang's members into the fewest domains
at one topology level (``block``, ``rack``, ``nvlink_domain``, ``rail``).

A gang that carries ``TopologyRequest(level, mode)`` is placed here instead of member by member
(``Scheduler._place_gang``). The compliance filters come first, always: only nodes of the
request's compliant set (admitted, certified for every tag) are ever looked at, and every
candidate passes the same per-node filters (tenancy, GPU model, CPU, memory, capacity) as any
placement; topology only chooses *among* them (rule 5).

How a decision goes, without per-node Python work across the cluster:

* ``TopologyIndex`` (kept current by the snapshot on every node change, reservation and
  release) files each admitted node, per level, under its domain and counts, per domain, the
  nodes by their number of *free* plain GPUs (no whole-GPU holder, no share). The nodes able to
  take a member of ``p`` GPUs in a domain are at most the domain's nodes with ``free >= p``: a
  sum over a handful of buckets, an upper bound that prunes every domain too small for the gang.
* **One domain, best fit over domains**: the domains whose bound holds the whole gang, the
  smallest bound first; the first whose exact count (the compliant nodes of that domain that
  pass every filter: at most a domain's few nodes evaluated) holds the gang takes it. Within the
  domain, members go to the nodes with the fewest free GPUs (best fit), then by name.
* ``required`` and no domain holds it: the gang waits with ``topology_unsatisfiable`` (when it
  would fit ignoring topology; otherwise with the usual capacity reason).
* ``preferred``: the fewest domains. Domains are evaluated largest bound first until their exact
  counts hold the gang; of those, the largest fill first and the last domain is the smallest
  that holds the rest (best fit). The lower bound on the number of domains (from the bounds) is
  reported beside the number used, so the explanation says how far the placement is from the
  best possible: "placed across 3 racks (at least 2 needed; best found)". Nodes that name no
  domain at the level count as a domain each, and only a ``preferred`` gang uses them.

Pure: no I/O, no clock; the snapshot is read, never changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from proofplane.model import (
    TOPOLOGY_LEVELS,
    GpuRequest,
    Node,
    PlacedDevice,
    Placement,
    TopologyMode,
    domain_of,
)
from proofplane.schedule.usage import NodeInfo, Usage
from proofplane.schedule.values import Request

if TYPE_CHECKING:
    from proofplane.schedule.snapshot import ClusterSnapshot

LOOSE = "node:"  # prefix of the one-node domain of a node that names none at the level

_Where = tuple[tuple[str | None, ...], int]  # (domain per level, free GPUs)


def free_gpus(info: NodeInfo, u: Usage) -> int:
    """Plain GPUs of the node that nothing holds (no whole-GPU holder, no share)."""
    whole, shares = u.whole, u.shares
    if not whole and not shares:
        return len(info.plain)
    return sum(1 for g in info.plain if g.index not in whole and not shares.get(g.index))


class TopologyIndex:
    """Per level: domain → its admitted nodes, and → how many of them have ``f`` free GPUs;
    the admitted nodes that name no domain at the level. Updated one node at a time."""

    def __init__(self) -> None:
        self._where: dict[str, _Where] = {}
        # per node: the Node its domains were read from, the domains, whether it names any
        self._seen: dict[str, tuple[Node, tuple[str | None, ...], bool]] = {}
        self._names: dict[str, dict[str, set[str]]] = {lv: {} for lv in TOPOLOGY_LEVELS}
        self._counts: dict[str, dict[str, list[int]]] = {lv: {} for lv in TOPOLOGY_LEVELS}
        self._loose: dict[str, set[str]] = {lv: set() for lv in TOPOLOGY_LEVELS}

    def changed(self, name: str, node: Node | None, free: int | Callable[[], int]) -> None:
        """Node ``name`` is now ``node`` (None: not admitted, or gone) with ``free`` GPUs (or a
        function that counts them, called only for a node that names a domain: a reservation
        on a node without topology costs a lookup)."""
        new: _Where | None = None
        if node is not None:
            seen = self._seen.get(name)
            if seen is None or seen[0] is not node:
                domains = tuple(domain_of(node, lv) for lv in TOPOLOGY_LEVELS)
                seen = self._seen[name] = (node, domains, any(d is not None for d in domains))
            if not seen[2]:
                free = 0
            elif callable(free):
                free = free()
            new = (seen[1], free)
        else:
            self._seen.pop(name, None)
        old = self._where.get(name)
        if old == new:
            return
        if old is not None and new is not None and old[0] == new[0]:
            # the common change: a reservation or release, same domains, other free count
            was, now = old[1], new[1]
            counts = self._counts
            for level, domain in zip(TOPOLOGY_LEVELS, new[0], strict=True):
                if domain is not None:
                    c = counts[level][domain]
                    if len(c) <= now:
                        c.extend([0] * (now + 1 - len(c)))
                    c[was] -= 1
                    c[now] += 1
            self._where[name] = new
            return
        if old is not None:
            self._file(name, old, -1)
            del self._where[name]
        if new is not None:
            self._file(name, new, 1)
            self._where[name] = new

    def _file(self, name: str, where: _Where, by: int) -> None:
        domains, free = where
        for level, domain in zip(TOPOLOGY_LEVELS, domains, strict=True):
            if domain is None:
                if by > 0:
                    self._loose[level].add(name)
                else:
                    self._loose[level].discard(name)
                continue
            names = self._names[level]
            counts = self._counts[level]
            if by > 0:
                names.setdefault(domain, set()).add(name)
                c = counts.get(domain)
                if c is None:
                    c = counts[domain] = []
                if len(c) <= free:
                    c.extend([0] * (free + 1 - len(c)))
                c[free] += 1
            else:
                members = names[domain]
                members.discard(name)
                if not members:
                    del names[domain]
                    del counts[domain]
                else:
                    counts[domain][free] -= 1

    def domain(self, name: str, level: str) -> str | None:
        where = self._where.get(name)
        if where is None:
            return None
        return where[0][TOPOLOGY_LEVELS.index(level)]

    def free(self, name: str) -> int:
        where = self._where.get(name)
        return where[1] if where is not None else 0

    def bounds(self, level: str, per_node: int) -> dict[str, int]:
        """Per domain at ``level``: its admitted nodes with at least ``per_node`` free GPUs (an
        upper bound on the members it can take); domains with none are left out."""
        out: dict[str, int] = {}
        for domain, c in self._counts[level].items():
            n = sum(c[per_node:])
            if n:
                out[domain] = n
        return out

    def names(self, level: str, domain: str) -> AbstractSet[str]:
        return self._names[level].get(domain, frozenset())

    def loose(self, level: str) -> AbstractSet[str]:
        return self._loose[level]


@dataclass(frozen=True, slots=True)
class TopologyChoice:
    """What the topology search found: a placement (None: none that honours the request) and
    the outcome for the explanation and the decision record (``info``)."""

    placement: Placement | None
    message: str
    info: dict[str, Any]
    fits_elsewhere: bool = False  # a required gang that would fit across several domains


_Fit = tuple[int, str, tuple[PlacedDevice, ...]]  # (free GPUs, node, devices)


def fewest_domains(sizes: Iterable[int], k: int) -> int | None:
    """The fewest of ``sizes`` (domains' capacities) whose sum reaches ``k``; None if all do not."""
    total = 0
    for m, size in enumerate(sorted(sizes, reverse=True), start=1):
        total += size
        if total >= k:
            return m
    return None


def pick_domains(fits: Mapping[str, int], k: int) -> list[tuple[str, int]] | None:
    """Which domains take how many members: the fewest domains (largest first), the last one
    the smallest that holds what is left (best fit). ``fits``: members each domain can take.
    None when all of them together cannot take ``k``."""
    ranked = sorted(fits.items(), key=lambda dn: (-dn[1], dn[0]))
    m = fewest_domains((n for _d, n in ranked), k)
    if m is None:
        return None
    chosen = [(d, n) for d, n in ranked[: m - 1]]
    rest = k - sum(n for _d, n in chosen)
    last = min(
        ((n, d) for d, n in ranked[m - 1 :] if n >= rest),
        key=lambda nd: (nd[0], nd[1]),
    )
    return [*chosen, (last[1], rest)]


def place_gang(snap: ClusterSnapshot, req: Request) -> TopologyChoice:
    """Place the gang ``req`` (with ``req.topology``) into the fewest domains; see the module
    docstring. Changes nothing."""
    topo = req.topology
    assert topo is not None
    level, k, per = topo.level, req.gpus.nodes, req.gpus.per_node
    member = replace(req, gpus=GpuRequest(per, req.gpus.model), topology=None)
    index = snap.topology
    compliant = snap.compliant_nodes(req.tags)
    bounds = index.bounds(level, per)
    exact: dict[str, list[_Fit]] = {}

    def evaluate(names: Iterable[str]) -> list[_Fit]:
        found: list[_Fit] = []
        for name in names:
            devices = snap.member_fit(name, member)
            if devices is not None:
                found.append((index.free(name), name, devices))
        found.sort()
        return found

    def of_domain(domain: str) -> list[_Fit]:
        hit = exact.get(domain)
        if hit is None:
            names = index.names(level, domain)
            among = names & compliant if len(names) <= len(compliant) else compliant & names
            hit = exact[domain] = evaluate(among)
        return hit

    info: dict[str, Any] = {"level": level, "mode": topo.mode.value}
    # 1. one domain: best fit over the domains whose bound holds the gang
    for _b, domain in sorted((b, d) for d, b in bounds.items() if b >= k):
        fits = of_domain(domain)
        if len(fits) >= k:
            info |= {"domains": [domain], "domains_used": 1, "fewest_possible": 1}
            return TopologyChoice(
                _placement(fits[:k]), f"placed within one {level} ({domain})", info
            )
    required = topo.mode is TopologyMode.REQUIRED
    if required:
        most = max((len(exact[d]) if d in exact else b for d, b in bounds.items()), default=0)
        info |= {"domains_used": None, "most_in_one_domain": min(most, k - 1)}
    # 2. the fewest domains, evaluated largest bound first until they hold the gang (for a
    # required gang only to tell "waits for its topology" from "waits for capacity")
    loose = index.loose(level) & compliant
    lower = fewest_domains([*bounds.values(), *([1] * len(loose))], k)
    sizes: dict[str, list[_Fit]] = {}
    total = 0
    for domain in sorted(bounds, key=lambda d: (-bounds[d], d)):
        fits = of_domain(domain)
        if fits:
            sizes[domain] = fits
            total += len(fits)
            if total >= k:
                break
    if total < k:
        for fit in evaluate(sorted(loose)):
            sizes[LOOSE + fit[1]] = [fit]
            total += 1
            if total >= k:
                break
    chosen = pick_domains({d: len(f) for d, f in sizes.items()}, k)
    if chosen is None:
        info |= {"domains_used": None}
        return TopologyChoice(None, "", info)
    if required:
        info |= {"fits_across": len(chosen), "fewest_possible": lower}
        return TopologyChoice(None, "", info, fits_elsewhere=True)
    members = [fit for domain, n in chosen for fit in sizes[domain][:n]]
    used = len(chosen)
    best = lower is not None and used <= lower
    info |= {
        "domains": [d for d, _n in chosen],
        "domains_used": used,
        "fewest_possible": lower,
        "best_possible": best,
    }
    how = "the fewest possible" if best else f"best found; at least {lower} needed"
    plural = f"{level}s" if used > 1 else level
    return TopologyChoice(_placement(members), f"placed across {used} {plural} ({how})", info)


def _placement(fits: list[_Fit]) -> Placement:
    return Placement.of_parts(tuple(Placement(name, devices) for _f, name, devices in fits))


def domains_of(snap: ClusterSnapshot, nodes: Iterable[str], level: str) -> list[str]:
    """The distinct domains at ``level`` the named nodes sit in (a node naming none counts as
    its own ``node:<name>`` domain), in first-seen order."""
    out: dict[str, None] = {}
    for name in nodes:
        node = snap.node(name)
        domain = domain_of(node, level) if node is not None else None
        out[domain if domain is not None else LOOSE + name] = None
    return list(out)
