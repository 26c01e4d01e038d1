"""``proofplane workloads …``: submit, list, inspect and cancel workloads."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from proofplane.cli import backends, render
from proofplane.cli.client import CliError, segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    client,
    parse_pairs,
    run_list,
    send,
)
from proofplane.model import IsolationLevel, WorkloadStatus
from proofplane.model.workload import MAX_BATCH  # the API's bound on one batch

app = typer.Typer(help="Workloads: submit, inspect, explain, cancel.", no_args_is_help=True)

TenantOpt = typer.Option(
    None, "--tenant", "-t", help="The workload's tenant, when several tenants use the name."
)


def _call(
    ctx: typer.Context,
    method: str,
    name: str,
    tenant: str | None,
    suffix: str = "",
    body: Any = None,
) -> Any:
    """One workload's endpoint, with ``?tenant=`` when given (an ambiguous name needs it)."""
    with client(ctx) as api:
        return api.request(
            method,
            f"/api/v1/workloads/{segment(name)}{suffix}",
            params={"tenant": tenant},
            body=body,
        )


@app.command("submit")
def submit(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name (lowercase letters, digits, '-')."),
    command: list[str] | None = typer.Argument(
        None, help="The command to run; put it after `--` when it has options of its own."
    ),
    tenant: str = typer.Option(..., "--tenant", "-t", help="The tenant it runs for."),
    tag: list[str] | None = typer.Option(
        None, "--tag", help="key=value compliance tag; repeatable (e.g. --tag hipaa=true)."
    ),
    isolation: IsolationLevel | None = typer.Option(
        None, "--isolation", help="Default: what the GPU request implies, raised to the floor."
    ),
    gpus: int | None = typer.Option(
        None, "--gpus", "-g", min=1, help="Whole GPUs, or MIG instances with --mig-profile."
    ),
    model: str | None = typer.Option(None, "--model", help="Pin a GPU SKU, e.g. H100-80GB."),
    mig_profile: str | None = typer.Option(None, "--mig-profile", help="e.g. 3g.40gb"),
    share_milli: int | None = typer.Option(
        None, "--share-milli", help="A fraction of one GPU in thousandths (1-999)."
    ),
    nodes: int | None = typer.Option(
        None,
        "--nodes",
        min=1,
        help="A gang: --gpus in total, spread evenly over this many nodes, all or nothing.",
    ),
    priority: int = typer.Option(0, "--priority", min=-1000, max=1000),
    restartable: bool = typer.Option(
        False,
        "--restartable",
        help="It checkpoints itself: defragmentation may move it while it runs.",
    ),
    topology: str | None = typer.Option(
        None,
        "--topology",
        help="A gang's packing: LEVEL[:MODE], LEVEL one of block, rack, nvlink_domain, rail; "
        "MODE required (default: all members in one domain, or wait) or preferred (the fewest "
        "domains now). E.g. --topology rack:preferred",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Submit a workload; it is placed at once on compliant capacity or waits with a reason.

    Example: proofplane workloads submit my-job --tenant research-lab --gpus 2 -- python train.py
    """
    request: dict[str, Any] = {
        "model": model,
        "mig_profile": mig_profile,
        "share_milli": share_milli,
    }
    if gpus is not None:
        request["count"] = gpus
    if nodes is not None:
        request["nodes"] = nodes
    body: dict[str, Any] = {
        "name": name,
        "tenant": tenant,
        "tags": parse_pairs(tag, "--tag"),
        "isolation": isolation.value if isolation else None,
        "gpus": {k: v for k, v in request.items() if v is not None},
        "priority": priority,
        "command": list(command or []),
    }
    if restartable:
        body["restartable"] = True
    if topology is not None:
        level, _, mode = topology.partition(":")
        body["topology"] = {"level": level, "mode": mode or "required"}
    workload = send(ctx, "POST", "/api/v1/workloads", body)
    if as_json:
        render.print_json(workload)
    else:
        render.workload_outcome(workload, "submitted")


def _read_batch(path: str) -> list[Any]:
    """Workload objects from a JSON file (``{"items": [...]}`` or a list) or JSON Lines (one
    object per line); ``-`` reads standard input."""
    where = "standard input" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"proofplane: cannot read {where}: {exc}", exit_code=2) from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CliError(
                    f"proofplane: {where} line {n} is not JSON: {exc.msg}", exit_code=2
                ) from exc
    if isinstance(doc, dict):
        if not isinstance(doc.get("items"), list):
            raise CliError(f'proofplane: {where}: an object needs an "items" list', exit_code=2)
        doc = doc["items"]
    if not isinstance(doc, list):
        raise CliError(f"proofplane: {where}: expected a list of workloads", exit_code=2)
    if not doc:
        raise CliError(f"proofplane: {where} holds no workloads", exit_code=2)
    if len(doc) > MAX_BATCH:
        raise CliError(
            f"proofplane: {where} holds {len(doc)} workloads; one batch (one transaction) "
            f"holds at most {MAX_BATCH}: split the file",
            exit_code=2,
        )
    return doc


@app.command("submit-batch")
def submit_batch(
    ctx: typer.Context,
    path: str = typer.Argument(
        ...,
        help='JSON file ({"items": [...]} or a list) or JSON Lines, one workload each, in the '
        "body shape of POST /api/v1/workloads; '-' reads standard input.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Submit up to 1000 workloads in one transaction: all are accepted (placed in file order,
    or pending with a reason) or none is, and the error names the refused item.

    Example: proofplane workloads submit-batch jobs.jsonl
    """
    items = _read_batch(path)
    out = send(ctx, "POST", "/api/v1/workloads/batch", {"items": items})
    if as_json:
        render.print_json(out)
        return
    workloads = out["items"]
    render.console().print(render.workloads_table(workloads))
    placed = sum(1 for w in workloads if w.get("placement"))
    render.console().print(
        f"{len(workloads)} submitted: {placed} placed, {len(workloads) - placed} pending"
    )


@app.command("list")
def list_workloads(
    ctx: typer.Context,
    tenant: str | None = typer.Option(None, "--tenant", "-t"),
    status: WorkloadStatus | None = typer.Option(None, "--status"),
    node: str | None = typer.Option(None, "--node", help="Only workloads placed on this node."),
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List workloads with their status, request and node."""
    run_list(
        ctx,
        "/api/v1/workloads",
        {"tenant": tenant, "status": status.value if status else None, "node": node},
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.workloads_table,
        noun="workload",
    )


@app.command("show")
def show(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    tenant: str | None = TenantOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Show one workload: where it was placed and the engine job running it, or why it
    waits."""
    workload = _call(ctx, "GET", name, tenant)
    if as_json:
        render.print_json(workload)
    else:
        jobs = backends.workload_jobs(ctx, name, workload["tenant"])["items"]
        render.show_workload(workload, jobs)


app.command("logs")(backends.logs)


@app.command("cancel")
def cancel(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    reason: str | None = typer.Option(None, "--reason", "-r"),
    tenant: str | None = TenantOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Cancel a workload; its capacity is freed and offered to waiting work."""
    workload = _call(ctx, "POST", name, tenant, "/cancel", {"reason": reason})
    if as_json:
        render.print_json(workload)
    else:
        render.workload_outcome(workload, "cancelled")


@app.command("explain")
def explain(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Workload name."),
    tenant: str | None = TenantOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Why a workload is where it is (node, devices, its best-fit rank), or why it waits
    (reason code, and how many nodes each filter rejected)."""
    e = _call(ctx, "GET", name, tenant, "/explain")
    if as_json:
        render.print_json(e)
        return
    out = render.console()
    out.print(
        render.text(f"{e['tenant']}/{e['workload']}: ", "bold"),
        render.text(e["summary"]),
        soft_wrap=True,
    )
    defrag = e.get("defrag") or {}
    for m in defrag.get("moves") or []:
        out.print(
            render.text(f"  moved by defragmentation: {m['workload']} {m['from']} → {m['to']}"),
            soft_wrap=True,
        )
    if defrag.get("refused"):
        out.print(render.text(f"  defragmentation: {defrag['message']}"), soft_wrap=True)
    for line in render.mig_layout_lines(e.get("mig_layout")):
        out.print(render.text(f"  {line}"), soft_wrap=True)
    placement = e.get("placement")
    for part in (placement or {}).get("members") or []:
        devices = ", ".join(
            render.device_summary(d) + f" (GPU {d['gpu_index']})" for d in part["devices"]
        )
        out.print(render.text(f"  {part['node']}: {devices}"), soft_wrap=True)
    a = e.get("analysis") or {}
    filters = a.get("filters") or {}
    if filters:
        table = Table("NODES REJECTED BECAUSE", "COUNT", header_style="bold")
        for code, n in sorted(filters.items(), key=lambda kv: (-kv[1], kv[0])):
            table.add_row(code, str(n))
        out.print(table)
    candidates = a.get("candidates") or []
    if candidates:
        table = Table("RANK", "CANDIDATE NODE", "IDLE GPUS LEFT", header_style="bold")
        for c in candidates:
            table.add_row(str(c["rank"]), c["node"], str(c["idle_gpus_after"]))
        table.caption = f"{a.get('candidates_total', 0)} candidate(s); {a.get('score', '')}"
        out.print(table)
    topo = a.get("topology")
    if topo:
        out.print(render.text(render.topology_summary(topo)), soft_wrap=True)
    quota = a.get("quota") or {}
    if quota.get("exceeded"):
        out.print(render.text(f"quota exceeded: {quota['exceeded']}", "yellow"), soft_wrap=True)
