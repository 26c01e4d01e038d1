"""An operator's MIG layout for one GPU (issue 12: the ``mig.layout`` change type).

The scheduler repartitions an idle MIG GPU on its own when a workload needs a profile no free
instance has; this is the deliberate version: set GPU ``gpu`` of ``node`` to exactly the
instances named (``profile@start``, e.g. ``3g.40gb@4``; an empty layout turns MIG off). The
layout is checked against the pure per-SKU tables (``hardware.skus.layout_errors``), and a GPU
instance that a running workload holds is never destroyed: 409 ``mig_instances_in_use`` names
the workloads (drain them first). One ``node.gpu.layout`` event, before and after.
"""

from __future__ import annotations

from typing import Any

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, NotFound, ValidationFailed
from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model.node import MigInstance
from proofplane.service.context import Store
from proofplane.service.lifecycle import workloads_on
from proofplane.store.repo import node_row

MAX_INSTANCES = 7


def parse_layout(items: Any) -> tuple[MigInstance, ...]:
    """``["3g.40gb@0", "3g.40gb@4"]`` → instances; 422 ``invalid_mig_layout`` otherwise."""
    if not isinstance(items, list | tuple) or len(items) > MAX_INSTANCES:
        raise ValidationFailed(f"layout is a list of at most {MAX_INSTANCES} profile@start",
                               code="invalid_mig_layout")  # fmt: skip
    out = []
    for item in items:
        profile, sep, start = item.partition("@") if isinstance(item, str) else ("", "", "")
        # a start is a memory slot (0..7): more than two digits is no start, and int() of
        # thousands of digits would raise instead of refusing
        if not sep or not profile or not start.isascii() or not start.isdecimal() or len(start) > 2:
            raise ValidationFailed(
                f"MIG instance {item!r} must be written profile@start, e.g. 3g.40gb@4",
                code="invalid_mig_layout",
                details={"instance": str(item)[:64]},
            )
        out.append(MigInstance(profile, int(start)))
    return tuple(sorted(out, key=lambda i: i.start))


def _label(i: MigInstance) -> str:
    return f"{i.profile}@{i.start}"


def _target(session: Any, node: str, gpu: int, wanted: tuple[MigInstance, ...]) -> Any:
    """(node row, GPU row, SKU) when ``wanted`` fits that GPU; 404 or 422 otherwise."""
    row = node_row(session, node)
    gpu_row = next((g for g in row.gpus if g.index == gpu), None)
    if gpu_row is None:
        raise NotFound(f"node {node!r} has no GPU {gpu}", code="gpu_not_found",
                       details={"node": node, "gpu": gpu,
                                "gpus": sorted(g.index for g in row.gpus)})  # fmt: skip
    sku = get_sku(gpu_row.model)
    if wanted:
        problems = layout_errors(sku, wanted)
        if problems:
            raise ValidationFailed(
                f"{sku.name} cannot hold this layout: {'; '.join(problems)}",
                code="invalid_mig_layout",
                details={"model": sku.name, "problems": problems},
            )
    return row, gpu_row, sku


def check_mig_layout(store: Store, node: str, gpu: int, layout: Any) -> None:
    """Whether ``layout`` is one GPU ``gpu`` of ``node`` can hold (a ``mig.layout`` change is
    checked when asked for; whether work holds its instances is checked when it applies)."""
    wanted = parse_layout(layout)
    with store.read() as session:
        _target(session, node, gpu, wanted)


def set_mig_layout(
    store: Store,
    actor: Actor,
    node: str,
    gpu: int,
    layout: Any,
    *,
    change_id: int | None = None,
) -> dict[str, Any]:
    """Set ``node``'s GPU ``gpu`` to ``layout`` in one transaction (see the module)."""
    authorize(actor, Permission.NODES_WRITE)
    wanted = parse_layout(layout)
    with store.write(actor) as tx:
        row, gpu_row, sku = _target(tx.session, node, gpu, wanted)
        before = tuple(MigInstance(i["profile"], int(i["start"])) for i in gpu_row.mig_instances)
        kept = set(wanted)
        holders = []
        for wl in workloads_on(tx, row):
            placement = wl.placement
            if placement is None:
                continue
            if placement.members:  # a gang: the first member is node/devices
                devices = [d for m in placement.members if m.get("node") == node
                           for d in m.get("devices") or ()]  # fmt: skip
            else:
                devices = list(placement.devices) if placement.node_id == row.id else []
            for d in devices:
                if d.get("gpu_index") != gpu:
                    continue
                held = d.get("mig_profile")
                if held is None or MigInstance(held, int(d.get("mig_start") or 0)) not in kept:
                    what = "the whole GPU" if held is None else f"{held}@{d.get('mig_start')}"
                    holders.append({"workload": f"{wl.tenant.name}/{wl.name}", "holds": what})
        if holders:
            raise Conflict(
                f"GPU {gpu} of node {node!r} has running work on instances this layout would "
                f"destroy ({', '.join(h['workload'] for h in holders)}): drain it first "
                f"(proofplane nodes cordon {node}, then let the work finish or move)",
                code="mig_instances_in_use",
                details={"node": node, "gpu": gpu, "held": holders},
            )
        gpu_row.mig_enabled = bool(wanted)
        gpu_row.mig_instances = [{"profile": i.profile, "start": i.start} for i in wanted]
        row.updated_at = tx.now
        details = {"gpu_index": gpu, "gpu_uuid": gpu_row.uuid, "model": sku.name,
                   "before": [_label(i) for i in before], "after": [_label(i) for i in wanted],
                   "mig_enabled": bool(wanted), "change_id": change_id}  # fmt: skip
        tx.record("node.gpu.layout", "node", node, details=details)
        return {"node": node, **details}
