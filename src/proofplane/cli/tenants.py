"""``proofplane tenants …``: tenants and their compliance profiles."""

from __future__ import annotations

import typer

from proofplane.cli import render
from proofplane.cli.client import segment
from proofplane.cli.common import (
    AllOpt,
    CursorOpt,
    JsonOpt,
    LimitOpt,
    fetch,
    parse_pairs,
    run_list,
    send,
)
from proofplane.model import IsolationLevel

app = typer.Typer(help="Tenants and their compliance profiles.", no_args_is_help=True)

_LEVELS = ", ".join(level.value for level in IsolationLevel)


def parse_rules(values: list[str] | None) -> dict[str, str]:
    """``["pci-dss=isolated:dedicated-node"]`` → ``{"pci-dss=isolated": "dedicated-node"}``."""
    out: dict[str, str] = {}
    for raw in values or []:
        tag, sep, level = raw.rpartition(":")
        if not sep or "=" not in tag or not tag.partition("=")[0]:
            raise typer.BadParameter(
                f"{raw!r} is not key=value:LEVEL (e.g. pci-dss=isolated:dedicated-node)",
                param_hint="--rule",
            )
        if level not in {lv.value for lv in IsolationLevel}:
            raise typer.BadParameter(
                f"{level!r} in {raw!r} is not an isolation level ({_LEVELS})", param_hint="--rule"
            )
        out[tag] = level
    return out


@app.command("list")
def list_tenants(
    ctx: typer.Context,
    limit: int | None = LimitOpt,
    cursor: str | None = CursorOpt,
    all_pages: bool = AllOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List tenants with their compliance profiles."""
    run_list(
        ctx,
        "/api/v1/tenants",
        {},
        limit=limit,
        cursor=cursor,
        follow=all_pages,
        as_json=as_json,
        table=render.tenants_table,
        noun="tenant",
    )


@app.command("show")
def show_tenant(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Tenant name."),
    as_json: bool = JsonOpt,
) -> None:
    """Show one tenant and its compliance profile."""
    tenant = fetch(ctx, f"/api/v1/tenants/{segment(name)}")
    if as_json:
        render.print_json(tenant)
    else:
        render.show_tenant(tenant)


@app.command("create")
def create_tenant(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Tenant name (lowercase letters, digits, '-')."),
    description: str = typer.Option("", "--description", "-d"),
    require: list[str] | None = typer.Option(
        None, "--require", help="key=value every workload of the tenant carries; repeatable."
    ),
    min_isolation: IsolationLevel | None = typer.Option(
        None, "--min-isolation", help="The isolation floor for every workload (default shared)."
    ),
    rule: list[str] | None = typer.Option(
        None,
        "--rule",
        help="key=value:LEVEL raises the floor for workloads with that tag; repeatable.",
    ),
    co_residency: bool = typer.Option(
        True,
        "--co-residency/--no-co-residency",
        help="--no-co-residency: the tenant's MIG slices and GPU shares never share a physical "
        "GPU with another tenant's.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Create a tenant with a compliance profile."""
    profile: dict[str, object] = {
        "required_tags": parse_pairs(require, "--require"),
        "isolation_rules": parse_rules(rule),
        "co_residency": co_residency,
    }
    if min_isolation is not None:
        profile["min_isolation"] = min_isolation.value
    tenant = send(
        ctx,
        "POST",
        "/api/v1/tenants",
        {"name": name, "description": description, "profile": profile},
    )
    if as_json:
        render.print_json(tenant)
    else:
        render.print_line(f"tenant {tenant['name']} created")
        render.show_tenant(tenant)


@app.command("quota")
def set_quota(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Tenant name."),
    gpus: int | None = typer.Option(
        None, "--gpus", min=0, help="Most whole GPUs held at once (shares count as fractions)."
    ),
    mig_slices: int | None = typer.Option(
        None, "--mig-slices", min=0, help="Most MIG compute slices held at once (3g = 3)."
    ),
    unlimited: bool = typer.Option(
        False, "--unlimited", help="Remove the limits not given (--gpus / --mig-slices)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Set a tenant's quotas. A limit not given is kept, unless --unlimited removes it.

    Example: proofplane tenants quota research-lab --gpus 16 --mig-slices 14
    """
    current = fetch(ctx, f"/api/v1/tenants/{segment(name)}").get("quota") or {}
    body = {
        "gpus": gpus if gpus is not None else (None if unlimited else current.get("gpus")),
        "mig_slices": (
            mig_slices
            if mig_slices is not None
            else (None if unlimited else current.get("mig_slices"))
        ),
    }
    tenant = send(ctx, "PUT", f"/api/v1/tenants/{segment(name)}/quota", body)
    if as_json:
        render.print_json(tenant)
    else:
        render.print_line(f"tenant {tenant['name']} quota: {render.quota_summary(tenant['quota'])}")
