"""Which plugins a scheduler places with, and the one function that builds it (issue 17).

A :class:`Policy` names the scoring plugin (``schedule.scoring``), the MIG carver
(``schedule.migslots``; None: no carving), whether carving may *reclaim* (destroy free,
unused instances on the GPUs it carves; never one in use) and whether the engine's
*repartitioning* step may re-lay idle MIG GPUs. :func:`build_scheduler` turns a policy, the
cluster and the work held now into a ``schedule.engine.Scheduler``, the scorer's and the
carver's demand mix primed with the held work.

The server (``service.scheduling.server_scheduler``) and the MIG trace replays
(``sim.mig.make_scheduler``) both build their scheduler here, so the replay policy that is the
server's default (``proofplane+relayout``: :func:`server_policy` with auto layout ``on``)
cannot drift from it. Pure: names and values in, a scheduler out; the caller reads the
environment (``PROOFPLANE_PLACEMENT_SCORER``, ``PROOFPLANE_MIG_AUTO_LAYOUT``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from proofplane.model import Node, Quota
from proofplane.schedule.engine import Held, Scheduler
from proofplane.schedule.migslots import Carver, make_carver
from proofplane.schedule.scoring import Scorer, Shape, make_scorer

#: the server's MIG carver when ``PROOFPLANE_MIG_AUTO_LAYOUT=on``
SERVER_CARVER = "least-fragmenting"
#: ``PROOFPLANE_MIG_AUTO_LAYOUT`` modes (``config.MIG_AUTO_LAYOUT_MODES``)
CARVE = "on"  # carve new instances into free slices, and re-lay idle GPUs
IDLE = "idle"  # re-lay idle GPUs only
OFF = "off"  # never change a layout
RECLAIM = "reclaim"  # as CARVE, and carving may destroy idle instances beside running ones


@dataclass(frozen=True, slots=True)
class Policy:
    """The plugins of one scheduler: ``scorer`` (a ``schedule.scoring.SCORERS`` name),
    ``carver`` (a ``schedule.migslots.CARVERS`` name, or None: no carving), ``reclaim``
    (carving may destroy free instances beside running ones), ``repartition`` (the engine may
    re-lay idle MIG GPUs)."""

    scorer: str
    carver: str | None
    reclaim: bool = False
    repartition: bool = False

    def describe(self) -> dict[str, object]:
        """As the replay reports list a policy's plugins."""
        return {
            "scorer": self.scorer,
            "carver": self.carver,
            "reclaim": self.reclaim,
            "repartition": self.repartition,
        }


def server_policy(scorer: str, auto_layout: str) -> Policy:
    """The server's policy: ``scorer`` and, per ``PROOFPLANE_MIG_AUTO_LAYOUT``
    (``auto_layout``), carving into free slices without reclaim (``on``) or reclaiming idle
    instances on the GPU it carves (``reclaim``), and the repartitioning of idle GPUs (every
    mode but ``off``: no layout ever changes)."""
    return Policy(
        scorer,
        SERVER_CARVER if auto_layout in (CARVE, RECLAIM) else None,
        reclaim=auto_layout == RECLAIM,
        repartition=auto_layout != OFF,
    )


def held_shape(h: Held) -> Shape:
    """What a scorer sees of the request behind a held workload (one part of it)."""
    part = h.placement.parts[0]
    devices = part.devices
    cpu = h.cpu_milli
    if devices and devices[0].mig_profile is not None:
        return (cpu, len(devices), 0, None, devices[0].mig_profile)
    if devices and devices[0].share_milli is not None:
        return (cpu, 1, devices[0].share_milli, None, None)
    return (cpu, len(devices), 1000 if devices else 0, None, None)


def primed_scorer(name: str, held: Iterable[Held]) -> Scorer:
    """Scorer ``name``, its workload mix primed with the work held now (it then learns from
    every request the scheduler decides)."""
    scorer = make_scorer(name)
    for h in held:
        scorer.observe(held_shape(h))
    return scorer


def primed_carver(carver: str | Carver | None, held: Iterable[Held]) -> Carver | None:
    """Carver ``carver`` (a name, or one already made), its demand mix primed with the MIG
    work held now (then learned from every request); None: no carving."""
    if carver is None:
        return None
    made = make_carver(carver) if isinstance(carver, str) else carver
    for h in held:
        devices = h.placement.parts[0].devices if h.placement.parts else ()
        if devices and devices[0].mig_profile is not None:
            made.observe(devices[0].mig_profile, len(devices))
    return made


def build_scheduler(
    policy: Policy,
    nodes: Iterable[Node],
    held: Iterable[Held] = (),
    quotas: Mapping[str, Quota] | None = None,
    *,
    carver: Carver | None = None,
) -> Scheduler:
    """The scheduler of ``policy`` over ``nodes`` with ``held`` work and ``quotas``.
    ``carver``: a carver made by the caller instead of ``policy.carver`` (a replay's fixed
    demand mix); ignored when the policy does not carve."""
    held = list(held)
    made = primed_carver(carver if carver is not None else policy.carver, held)
    return Scheduler(
        nodes,
        held,
        quotas,
        scorer=primed_scorer(policy.scorer, held),
        carver=made if policy.carver is not None else None,
        reclaim=policy.reclaim,
        repartition=policy.repartition,
    )
