"""Invariants of a scheduler that carves MIG instances (the MIG replays' checks): every MIG
layout valid for its SKU, no MIG instance held twice, every held instance present in its GPU's
layout, CPU and memory never over-committed, compliance tags of every holder satisfied."""

from __future__ import annotations

from collections import Counter

from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model import missing_tags
from proofplane.schedule.engine import Scheduler


def check_scheduler(sched: Scheduler) -> None:
    nodes = {n.name: n for n in sched.nodes()}
    for node in nodes.values():
        for gpu in node.gpus:
            if gpu.mig_enabled and gpu.mig_instances:
                errors = layout_errors(get_sku(gpu.model), gpu.mig_instances)
                assert errors == [], (node.name, gpu.index, gpu.mig_instances, errors)
    slots: Counter[tuple[str, int, int]] = Counter()
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    for h in sched.held.values():
        for part in h.placement.parts:
            node = nodes[part.node]
            cpu[part.node] += h.cpu_milli
            mem[part.node] += h.memory_mib
            assert not missing_tags(dict(h.pool), node.certifications), (h.name, node.name)
            for d in part.devices:
                if d.mig_start is None:
                    continue
                slots[(part.node, d.gpu_index, d.mig_start)] += 1
                gpu = next(g for g in node.gpus if g.index == d.gpu_index)
                assert any(
                    i.start == d.mig_start and i.profile == d.mig_profile for i in gpu.mig_instances
                ), (h.name, part.node, d)
    double = {k: v for k, v in slots.items() if v > 1}
    assert not double, double
    for name, used in cpu.items():
        cap = nodes[name].cpu_milli
        assert cap is None or used <= cap, (name, used, cap)
    for name, used in mem.items():
        cap = nodes[name].memory_mib
        assert cap is None or used <= cap, (name, used, cap)
