"""The demo cluster's SIMULATED GPU telemetry (issue 15): there are no GPUs behind
``proofplane up``, so a simulated source posts what agents would, through the real ingest
path (``service.telemetry.store_samples``, as each node's agent ``node:<name>``), every reading
marked ``simulated`` (the API and CLI show it).

What it shows:

* **diurnal load**: every held GPU follows a day curve (busiest mid-afternoon UTC) with noise;
  a GPU nobody holds idles near 0;
* **one idle workload** (``IDLE_WORKLOAD``): it holds its GPUs and does nothing (peak below
  0.02); its tenant gets a short idle policy (``IDLE_POLICY``: notify after 3 minutes) so the
  notice (``workload.idle``) appears a few minutes into the demo;
* **one off-hours spike** (``SPIKE_TENANT``): its history is flat and low at every hour; from
  ``SPIKE_AFTER`` into the demo its work runs flat out and moves 20x its usual PCIe/NVLink
  traffic for ``SPIKE_FOR`` (what the anomaly rules look for);
* **one XID error**: on the ``XID_AT``-th pass, the first GPU held by ``XID_WORKLOAD`` reports
  XID 48 (double-bit ECC): the GPU is drained and its work re-placed on compliant capacity.

``backfill`` writes ``days`` of simulated hourly rollups of utilisation, PCIe traffic and
energy (so baselines and reports have a past)
and the last ``raw_minutes`` of raw readings through the ingest path (so idle detection and
the newest readings work at once).
"""

from __future__ import annotations

import hashlib
import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select

from proofplane.access import SYSTEM, Actor
from proofplane.meter import fields as F
from proofplane.meter.rollup import HOUR, hour_of
from proofplane.meter.samples import Sample
from proofplane.model import NodeState
from proofplane.service import idle
from proofplane.service import telemetry as tel
from proofplane.service.context import Store
from proofplane.store.tables import NodeRow
from proofplane.workers.base import Worker

log = logging.getLogger(__name__)

INTERVAL_S = 15.0
IDLE_WORKLOAD = ("research-lab", "llm-pretrain")  # 8 B200s, doing nothing
IDLE_POLICY = {"action": "notify", "window_s": 180, "threshold": 0.05}
SPIKE_TENANT = "nordbank"
SPIKE_AFTER = timedelta(minutes=2)
SPIKE_FOR = timedelta(minutes=20)
XID_WORKLOAD = ("st-marys-hospital", "pathology-finetune")
XID_AT = 3  # the pass that reports it (about 45 s into the demo)
XID = 48
SKIP_STATES = frozenset({NodeState.REGISTERED.value, NodeState.DECOMMISSIONED.value})


def _noise(*key: object) -> float:
    """A repeatable pseudo-random number in [0, 1) for ``key``."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def diurnal(ts: datetime) -> float:
    """The day curve: 0.25 at night, 0.85 mid-afternoon (UTC)."""
    hours = ts.hour + ts.minute / 60
    return 0.55 + 0.3 * math.sin(2 * math.pi * (hours - 9) / 24)


class DemoTelemetry(Worker):
    """The simulated agents' telemetry, one pass every ``interval_s``. ``started_at``: when
    the demo started (the spike and the XID count from it)."""

    leader_only = False

    def __init__(self, store: Store, *, interval_s: float = INTERVAL_S,
                 started_at: datetime | None = None,
                 backfill_days: int | None = None) -> None:  # fmt: skip
        # the first pass runs at once: it writes the history (``backfill_days``, None: none)
        super().__init__("demo-telemetry", interval_s, run_at_start=True)
        self.store = store
        self.started_at = started_at or datetime.now(UTC)
        self.backfill_days = backfill_days
        self.backfilled: dict[str, int] | None = None
        self.energy: dict[str, float] = {}  # GPU → its energy counter (mJ)
        self.rounds = 0
        self.xid_sent: str | None = None

    # --- the model --------------------------------------------------------------------------

    def _nodes(self) -> list[tel.NodeDevices]:
        with self.store.read() as session:
            rows = session.execute(
                select(NodeRow.id, NodeRow.name, NodeRow.state).order_by(NodeRow.name)
            ).all()
            return [
                tel.load_devices(session, node_id, name, state)
                for node_id, name, state in rows
                if state not in SKIP_STATES
            ]

    def utilisation(self, ts: datetime, uuid: str, holder: tel.Holder | None,
                    *, live: bool = True) -> float:  # fmt: skip
        """A device's GR_ENGINE_ACTIVE at ``ts`` held by ``holder``."""
        wiggle = _noise(uuid, int(ts.timestamp() // 60))
        if holder is None:
            return round(0.01 * wiggle, 4)
        if (holder.tenant, holder.workload) == IDLE_WORKLOAD:
            return round(0.015 * wiggle, 4)
        if holder.tenant == SPIKE_TENANT:
            if live and self.spiking(ts):
                return round(0.95 + 0.04 * wiggle, 4)
            return round(0.08 + 0.04 * wiggle, 4)
        return round(min(1.0, max(0.0, diurnal(ts) + 0.2 * (wiggle - 0.5))), 4)

    def spiking(self, ts: datetime) -> bool:
        start = self.started_at + SPIKE_AFTER
        return start <= ts < start + SPIKE_FOR

    def _device_readings(
        self, ts: datetime, uuid: str, holder: tel.Holder | None, dt_s: float, live: bool
    ) -> dict[str, float]:
        util = self.utilisation(ts, uuid, holder, live=live)
        power = 90 + 600 * util
        energy = self.energy.get(uuid, 1e9 + 1e9 * _noise(uuid)) + power * dt_s * 1000
        self.energy[uuid] = energy
        traffic = 20.0 if holder is not None and holder.tenant == SPIKE_TENANT and live and (
            self.spiking(ts)) else 1.0  # fmt: skip
        return {
            F.GR_ENGINE_ACTIVE: util,
            F.SM_ACTIVE: round(util * 0.9, 4),
            F.POWER_USAGE: round(power, 1),
            F.TOTAL_ENERGY: round(energy),
            F.GPU_TEMP: round(35 + 40 * util, 1),
            F.FB_USED: round(2000 + 60000 * util),
            F.PCIE_TX_BYTES: round(traffic * 2e8 * util),
            F.PCIE_RX_BYTES: round(traffic * 4e8 * util),
            F.NVLINK_TX_BYTES: round(traffic * 5e9 * util),
            F.NVLINK_RX_BYTES: round(traffic * 5e9 * util),
            F.XID_ERRORS: 0,
            F.ECC_DBE_VOL_TOTAL: 0,
        }

    def samples(
        self,
        node: tel.NodeDevices,
        ts: datetime,
        *,
        dt_s: float,
        live: bool = True,
        fields: tuple[str, ...] | None = None,
    ) -> list[Sample]:
        """One read of ``node`` at ``ts`` (``dt_s``: seconds since the previous read)."""
        out: list[Sample] = []
        for uuid, (_index, _model, layout) in sorted(node.gpus.items()):
            whole = node.whole.get(uuid)
            parts = node.parts.get(uuid, [])
            holder = whole or (max(parts, key=lambda h: h.share) if parts else None)
            values = self._device_readings(ts, uuid, holder, dt_s, live)
            if layout:  # MIG mode: no GPU_UTIL; per instance its own activity
                for gi, (start, profile) in enumerate(sorted(layout.items()), start=1):
                    h = node.mig.get((uuid, start))
                    util = self.utilisation(ts, f"{uuid}/{start}", h, live=live)
                    for f, v in ((F.GR_ENGINE_ACTIVE, util), (F.SM_ACTIVE, round(util * 0.9, 4)),
                                 (F.FB_USED, round(1000 + 8000 * util))):  # fmt: skip
                        if fields is None or f in fields:
                            out.append(Sample(node.node, uuid, gi, profile, f, ts, v, start))
            else:
                values[F.GPU_UTIL] = round(values[F.GR_ENGINE_ACTIVE] * 100)
            for f, v in values.items():
                if fields is None or f in fields:
                    out.append(Sample(node.node, uuid, None, None, f, ts, float(v)))
        return out

    # --- the passes -------------------------------------------------------------------------

    def run_once(self, now: datetime | None = None) -> dict[str, Any]:
        now = now or datetime.now(UTC)
        if self.backfill_days is not None and self.backfilled is None:
            self.backfilled = self.backfill(now, days=self.backfill_days)
            log.info("demo telemetry: simulated history written: %s", self.backfilled)
        self.rounds += 1
        posted, drained = 0, []
        for node in self._nodes():
            samples = self.samples(node, now, dt_s=self.interval_s)
            if self.rounds >= XID_AT and self.xid_sent is None:
                samples = self._with_xid(node, samples)
            try:
                out = tel.store_samples(self.store, Actor(f"node:{node.node}"), node.node,
                                        samples, simulated=True, now=now)  # fmt: skip
            except Exception:  # one node's failure must not stop the others' readings
                log.exception("simulated telemetry of %s failed", node.node)
                continue
            posted += out.stored
            drained += out.drained
        return {"stored": posted, "drained": drained}

    def _with_xid(self, node: tel.NodeDevices, samples: list[Sample]) -> list[Sample]:
        held = sorted(u for u, h in node.whole.items() if (h.tenant, h.workload) == XID_WORKLOAD)
        if not held:
            return samples
        self.xid_sent = held[0]
        return [s._replace(value=float(XID)) if s.gpu_uuid == held[0] and
                s.field == F.XID_ERRORS else s for s in samples]  # fmt: skip

    def backfill(self, now: datetime | None = None, *, days: int = 14,
                 raw_minutes: int = 6, step_s: int = 60) -> dict[str, int]:  # fmt: skip
        """Simulated history: ``days`` of hourly rollups of the current holders' usage (flat
        and low for the spike tenant), then ``raw_minutes`` of raw readings through the
        ingest path. Sets the idle tenant's short policy. Returns the rows written."""
        now = now or datetime.now(UTC)
        nodes = self._nodes()
        raw_start = now - timedelta(minutes=raw_minutes)
        first = hour_of(raw_start) - timedelta(days=days)
        rows: list[tuple[Any, ...]] = []
        hour = first
        while hour < hour_of(raw_start):
            if self.stopping:  # the demo is stopping: no history is needed any more
                return {"hourly": 0, "raw": 0}
            for node in nodes:
                rows.extend(self._hour_rows(node, hour))
            hour += HOUR
        if rows:
            with self.store.write(SYSTEM, now) as tx:
                tel.insert_hourly(tx.session, rows)
        raw = 0
        ts = raw_start
        while ts <= now and not self.stopping:
            for node in nodes:
                samples = self.samples(node, ts, dt_s=step_s, live=False)
                raw += tel.store_samples(self.store, Actor(f"node:{node.node}"), node.node,
                                         samples, simulated=True, now=now).stored  # fmt: skip
            ts += timedelta(seconds=step_s)
        tenant, _workload = IDLE_WORKLOAD
        try:
            idle.set_idle_policy(self.store, SYSTEM, tenant, IDLE_POLICY)
        except Exception:  # a cluster file without that tenant
            log.info("demo telemetry: no tenant %s for the idle policy", tenant)
        return {"hourly": len(rows), "raw": raw}

    def _hour_rows(self, node: tel.NodeDevices, hour: datetime) -> list[tuple[Any, ...]]:
        """One simulated hour of ``node``: per GPU and field, one row per holder (split by
        share as the ingest splits a shared GPU's readings)."""
        out: list[tuple[Any, ...]] = []
        mid = hour + timedelta(minutes=30)
        for uuid in sorted(node.gpus):
            whole = node.whole.get(uuid)
            holders = [whole] if whole else node.parts.get(uuid, [])
            rest = 1.0 - sum(h.share for h in holders)
            targets: list[tuple[tel.Holder | None, float]] = [(h, h.share) for h in holders]
            if rest > 1e-9:
                targets.append((None, rest))
            lead = whole or (max(holders, key=lambda h: h.share) if holders else None)
            util = self.utilisation(mid, uuid, lead, live=False)
            power = 90 + 600 * util
            before = self.energy.get(uuid, 1e9 + 1e9 * _noise(uuid))
            energy_mj = power * 3600 * 1000
            self.energy[uuid] = before + energy_mj
            values = {
                F.GR_ENGINE_ACTIVE: (util * 240, util, util, util),
                F.PCIE_TX_BYTES: (2e8 * util * 240, 2e8 * util, 2e8 * util, 2e8 * util),
            }
            for holder, share in targets:
                workload = holder.workload if holder else None
                tenant = holder.tenant if holder else None
                if holder is not None:  # an idle, unheld GPU's history: its energy only
                    for f, (total, lo, hi, last) in values.items():
                        out.append(self._row(hour, node.node, uuid, f, workload, tenant, 240,
                                             total, lo, hi, last))  # fmt: skip
                out.append(self._row(hour, node.node, uuid, F.TOTAL_ENERGY, workload, tenant,
                                     240, energy_mj * share, before, before + energy_mj,
                                     before + energy_mj))  # fmt: skip
        return out

    @staticmethod
    def _row(hour: datetime, node: str, uuid: str, field: str, workload: str | None,
             tenant: str | None, count: int, total: float, lo: float, hi: float,
             last: float) -> tuple[Any, ...]:  # fmt: skip
        """A rollup row in ``tel.insert_hourly``'s order (``meter.rollup.Hourly``'s)."""
        return (hour, node, uuid, None, field, workload, tenant, count, total, lo, hi, last,
                True)  # fmt: skip
