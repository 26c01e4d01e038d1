"""``proofplane keys …``: the KMS key inventory through the API — list, show, create, rotate,
rewrap (in batches, with a progress bar, until done), disable and enable."""

from __future__ import annotations

from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from proofplane.cli import render
from proofplane.cli.client import CliError, segment
from proofplane.cli.common import JsonOpt, client, fetch, send

app = typer.Typer(
    help="KMS keys: what each protects, versions, rotation, rewrap, disable.",
    no_args_is_help=True,
)
API = "/api/v1/keys"
NameArg = typer.Argument(..., help="Key name (e.g. secrets, audit-checkpoint).")


def keys_table(keys: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold", caption_justify="left")
    for col in ("NAME", "PURPOSE", "BACKEND", "VERSION", "PROTECTS", "STALE", "STATE"):
        table.add_column(col)
    for k in keys:
        protects = k["protects"].get("total", k["protects"].get("audit_checkpoints", 0))
        table.add_row(
            render.text(k["name"]),
            render.text(f"{k['purpose']} ({k['algorithm']})"),
            render.text(k["backend"]),
            render.text(str(k["current_version"])),
            render.text(str(protects)),
            render.text(str(k["stale"]), "yellow" if k["stale"] else None),
            render.text(
                "disabled" if k["disabled_at"] else "enabled", "red" if k["disabled_at"] else None
            ),  # fmt: skip
        )
    return table


def show(key: dict[str, Any]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.title = f"Key {key['name']}"
    grid.title_justify = "left"
    grid.title_style = "bold"
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(overflow="fold")
    rows: list[tuple[str, Any]] = [
        ("purpose", f"{key['purpose']} ({key['algorithm']})"),
        ("backend", key["backend"]),
        ("current version", key["current_version"]),
        ("disabled", render.timestamp(key.get("disabled_at")) if key["disabled_at"] else "no"),
        *((f"protects {p}", n) for p, n in sorted(key["protects"].items())),
        ("stale", f"{key['stale']} ciphertext(s) under an older version"),
        *((f"operations {op}", n) for op, n in sorted(key["operations"].items())),
    ]
    for v in key["versions"]:
        life = f"{render.timestamp(v['created_at'])} .. "
        life += render.timestamp(v["retired_at"]) if v["retired_at"] else "current"
        if v["destroyed_at"]:
            life += f" (destroyed {render.timestamp(v['destroyed_at'])})"
        if v.get("checkpoints") is not None:
            life += f"; {v['checkpoints']} checkpoint(s)"
        rows.append((f"version {v['version']}", life))
    for name, value in rows:
        grid.add_row(name, render.text(str(value)))
    render.console().print(grid)


def _out(key: dict[str, Any], as_json: bool, message: str) -> None:
    if as_json:
        render.print_json(key)
    else:
        render.print_line(message)
        show(key)


@app.command("list")
def list_keys(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """List the keys: purpose, backend, current version, what each protects."""
    data = fetch(ctx, API)
    if as_json:
        render.print_json(data)
    else:
        render.print_list(keys_table(data["items"]), len(data["items"]), "key", None)


@app.command("show")
def show_key(ctx: typer.Context, name: str = NameArg, as_json: bool = JsonOpt) -> None:
    """Show one key: versions (created, retired, destroyed), protected data, use counts."""
    key = fetch(ctx, f"{API}/{segment(name)}")
    if as_json:
        render.print_json(key)
    else:
        show(key)


@app.command("create")
def create(
    ctx: typer.Context,
    name: str = NameArg,
    purpose: str = typer.Option(..., "--purpose", "-p", help="encrypt or sign."),
    as_json: bool = JsonOpt,
) -> None:
    """Create a key (version 1) in the configured KMS backend."""
    key = send(ctx, "POST", API, {"name": name, "purpose": purpose})
    _out(key, as_json, f"key {key['name']} created")


@app.command("rotate")
def rotate(ctx: typer.Context, name: str = NameArg, as_json: bool = JsonOpt) -> None:
    """A new version becomes current. Older versions still open what they sealed and verify
    what they signed (rotating audit-checkpoint publishes a new verifier key)."""
    key = send(ctx, "POST", f"{API}/{segment(name)}/rotate")
    _out(key, as_json, f"key {key['name']} rotated to version {key['current_version']}")


@app.command("disable")
def disable(ctx: typer.Context, name: str = NameArg, as_json: bool = JsonOpt) -> None:
    """Disable a key: nothing is sealed, opened or signed with it until it is enabled."""
    key = send(ctx, "POST", f"{API}/{segment(name)}/disable")
    _out(key, as_json, f"key {key['name']} disabled")


@app.command("enable")
def enable(ctx: typer.Context, name: str = NameArg, as_json: bool = JsonOpt) -> None:
    """Enable a disabled key again."""
    key = send(ctx, "POST", f"{API}/{segment(name)}/enable")
    _out(key, as_json, f"key {key['name']} enabled")


@app.command("rewrap")
def rewrap(
    ctx: typer.Context,
    name: str = NameArg,
    batch: int = typer.Option(100, "--batch", min=1, max=1000, help="Secrets per request."),
    as_json: bool = JsonOpt,
) -> None:
    """Re-seal every stored secret of the key under its newest version, batch by batch (each
    its own transaction; safe to interrupt and run again)."""
    path = f"{API}/{segment(name)}/rewrap"
    total = 0
    last: dict[str, Any] = {}
    with (
        client(ctx) as api,
        Progress(
            TextColumn(f"rewrap {name}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=render.console(),
            disable=as_json,
            transient=False,
        ) as bar,
    ):
        task = bar.add_task("rewrap", total=None)
        while True:
            last = api.request("POST", path, params={"limit": batch})
            total += last["rewrapped"]
            bar.update(task, completed=total, total=total + last["remaining"])
            if last["done"] or last["rewrapped"] == 0:
                break
    result = {**last, "rewrapped": total}
    if as_json:
        render.print_json(result)
    if not last["done"]:
        lines = [f"  {f['where']}: {f['error']}" for f in last.get("failed", [])]
        raise CliError(
            f"proofplane: keys rewrap {name}: {last['remaining']} secret(s) could not be rewrapped",
            lines=lines,
        )
    if not as_json:
        render.print_line(
            f"key {name}: {total} secret(s) rewrapped; all under version {last['version']}"
        )


@app.command("destroy")
def destroy(
    ctx: typer.Context,
    name: str = NameArg,
    version: int = typer.Argument(..., min=1, help="The superseded version to destroy."),
    as_json: bool = JsonOpt,
) -> None:
    """Destroy a superseded version for good (rewrap first: refused while secrets are sealed
    under it). With change control on, a key.destroy change is requested instead (two other
    people approve it) and its id printed."""
    from proofplane.cli.nodes import governed

    key = governed(ctx, "POST", f"{API}/{segment(name)}/versions/{version}/destroy", {}, as_json)
    if key is not None:
        _out(key, as_json, f"key {key['name']}: version {version} destroyed")
