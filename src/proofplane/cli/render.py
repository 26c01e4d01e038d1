"""Rendering for the CLI: Rich tables for lists, key/value views for single objects, raw JSON.

Every value that came from the server goes through ``Text`` (never through Rich markup), so a
name or reason containing ``[brackets]`` prints as it is.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

NODE_STATE_STYLES = {
    "admitted": "green",
    "registered": "cyan",
    "cordoned": "yellow",
    "quarantined": "magenta",
    "failed": "red",
    "decommissioned": "dim",
}
WORKLOAD_STATUS_STYLES = {
    "placed": "green",
    "running": "green",
    "pending": "yellow",
    "succeeded": "blue",
    "failed": "red",
    "cancelled": "dim",
}
OUTCOME_STYLES = {"success": "green", "failure": "yellow", "denied": "red"}
PIPE_WIDTH = 200


def console() -> Console:
    """A console on the current stdout (looked up per call, so test runners can capture it).
    When stdout is not a terminal and COLUMNS is unset, lines are not cut at 80 characters:
    tables keep their natural width so that piped output stays greppable."""
    out = sys.stdout
    width = None
    if not out.isatty() and not os.environ.get("COLUMNS"):
        width = PIPE_WIDTH
    return Console(file=out, highlight=False, width=width)


def print_json(data: Any) -> None:
    """The API's JSON, indented, uncoloured: safe to pipe into jq."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def print_line(message: str, style: str | None = None) -> None:
    console().print(Text(message, style=style or ""), soft_wrap=True)


def text(value: Any, style: str | None = None) -> Text:
    if value is None or value == "":
        return Text("-", style="dim")
    return Text(str(value), style=style or "")


def pairs(mapping: dict[str, Any] | None) -> str:
    """``{"hipaa": "true"}`` as ``hipaa=true``; several joined with ", "."""
    return ", ".join(f"{k}={v}" for k, v in sorted((mapping or {}).items()))


def timestamp(value: str | None) -> str:
    """An API timestamp as ``2025-06-01 12:34:56Z`` (UTC, whole seconds)."""
    if not value:
        return "-"
    try:
        ts = datetime.fromisoformat(value)
    except ValueError:
        return value
    if ts.tzinfo is not None:
        ts = ts.astimezone(UTC)
    return ts.strftime("%Y-%m-%d %H:%M:%S") + "Z"


def gpu_summary(gpus: Sequence[dict[str, Any]]) -> str:
    """``8x H100-80GB (2 MIG)``; mixed nodes list one group per model."""
    if not gpus:
        return "-"
    counts: Counter[str] = Counter()
    mig: Counter[str] = Counter()
    for g in gpus:
        counts[g["model"]] += 1
        mig[g["model"]] += bool(g.get("mig_enabled"))
    parts = []
    for model, n in counts.items():
        part = f"{n}x {model}"
        if mig[model]:
            part += f" ({mig[model]} MIG)"
        parts.append(part)
    return ", ".join(parts)


def request_summary(gpus: dict[str, Any]) -> str:
    """A workload's GPU request in words: ``2x H100-80GB``, ``1x MIG 3g.40gb``, ``0.25 GPU``."""
    count = gpus.get("count") or 1
    model = gpus.get("model")
    if gpus.get("mig_profile"):
        out = f"{count}x MIG {gpus['mig_profile']}"
        return f"{out} on {model}" if model else out
    if gpus.get("share_milli") is not None:
        out = f"{gpus['share_milli'] / 1000:g} GPU (shared)"
        return f"{out} of {model}" if model else out
    nodes = gpus.get("nodes") or 1
    if nodes > 1:
        return f"{count}x {model or 'GPU'} ({count // nodes} on each of {nodes} nodes)"
    return f"{count}x {model or 'GPU'}"


def device_summary(device: dict[str, Any]) -> str:
    if device.get("mig_profile"):
        return f"MIG {device['mig_profile']} @ slot {device.get('mig_start')}"
    if device.get("share_milli") is not None:
        return f"{device['share_milli'] / 1000:g} of the GPU (shared)"
    return "whole GPU"


def _device_short(device: dict[str, Any]) -> str:
    if device.get("mig_profile"):
        return f"GPU {device['gpu_index']} MIG {device['mig_profile']}@{device.get('mig_start')}"
    if device.get("share_milli") is not None:
        return f"GPU {device['gpu_index']} ({device['share_milli'] / 1000:g} share)"
    return f"GPU {device['gpu_index']}"


def short_details(details: dict[str, Any] | None, width: int = 70) -> str:
    """An event's details on one line, cut to ``width`` characters."""
    parts = []
    for key, value in (details or {}).items():
        shown = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        parts.append(f"{key}={shown}")
    line = " ".join(parts)
    return line if len(line) <= width else line[: width - 1] + "…"


def print_list(table: Table, count: int, noun: str, next_cursor: str | None) -> None:
    """A list table with its count; when there is more, how to get the next page."""
    table.caption = f"{count} {noun}{'' if count == 1 else 's'}"
    out = console()
    out.print(table)
    if next_cursor:
        out.print(
            Text(f"more: add --cursor {next_cursor} for the next page, or --all for everything"),
            soft_wrap=True,
        )


def _table(*columns: str, wrap: Iterable[str] = ()) -> Table:
    """A table whose columns stay on one line, except those in ``wrap`` (free text), which
    give way first when the terminal is narrow."""
    table = Table(header_style="bold", caption_justify="left")
    free = set(wrap)
    for col in columns:
        if col in free:
            table.add_column(col, overflow="fold")
        else:
            table.add_column(col, no_wrap=True, overflow="ellipsis")
    return table


def _kv(title: str, rows: Sequence[tuple[str, RenderableType]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.title = title
    grid.title_justify = "left"
    grid.title_style = "bold"
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(overflow="fold")
    for key, value in rows:
        grid.add_row(key, value)
    return grid


# --- nodes -------------------------------------------------------------------------------------


def node_state(node: dict[str, Any]) -> Text:
    return text(node["state"], NODE_STATE_STYLES.get(node["state"]))


def nodes_table(nodes: Sequence[dict[str, Any]]) -> Table:
    table = _table(
        "NAME",
        "REGION",
        "ZONE",
        "STATE",
        "GPUS",
        "CERTIFICATIONS",
        wrap=("GPUS", "CERTIFICATIONS"),
    )
    for n in nodes:
        table.add_row(
            text(n["name"]),
            text(n["region"]),
            text(n["zone"]),
            node_state(n),
            text(gpu_summary(n.get("gpus", []))),
            text(pairs(n.get("certifications"))),
        )
    return table


def show_node(node: dict[str, Any]) -> None:
    state = node_state(node)
    if node.get("state_reason"):
        state.append(f"  ({node['state_reason']})", style="")
    out = console()
    out.print(
        _kv(
            f"Node {node['name']}",
            [
                ("state", state),
                ("region", text(node["region"])),
                ("zone", text(node["zone"])),
                ("rack", text(node.get("rack"))),
                ("topology", text(pairs(node.get("topology")))),
                ("labels", text(pairs(node.get("labels")))),
                ("certifications", text(pairs(node.get("certifications")))),
                ("gpus", text(gpu_summary(node.get("gpus", [])))),
                ("created", text(timestamp(node.get("created_at")))),
                ("updated", text(timestamp(node.get("updated_at")))),
            ],
        )
    )
    gpus = node.get("gpus") or []
    if gpus:
        out.print()
        table = _table("#", "MODEL", "MEMORY", "MIG", "UUID", "VBIOS", "DRIVER", wrap=("MIG",))
        for g in gpus:
            mig = (
                ", ".join(f"{i['profile']}@{i['start']}" for i in g.get("mig_instances", []))
                if g.get("mig_enabled")
                else ""
            )
            table.add_row(
                text(g["index"]),
                text(g["model"]),
                text(f"{g['memory_mb'] // 1024} GiB" if g.get("memory_mb") else None),
                text(mig or ("enabled" if g.get("mig_enabled") else None)),
                text(g["uuid"]),
                text(g.get("vbios_version")),
                text(g.get("driver_version")),
            )
        out.print(table)


# --- tenants -----------------------------------------------------------------------------------


def _rules(profile: dict[str, Any]) -> str:
    return ", ".join(f"{k} → {v}" for k, v in sorted(profile.get("isolation_rules", {}).items()))


def _co_residency(profile: dict[str, Any]) -> str:
    if profile.get("co_residency", True):
        return "allowed with tenants that allow it"
    return "refused: its MIG slices and shares have physical GPUs to themselves"


def tenants_table(tenants: Sequence[dict[str, Any]]) -> Table:
    table = _table(
        "NAME",
        "REQUIRED TAGS",
        "MIN ISOLATION",
        "ISOLATION RULES",
        "DESCRIPTION",
        wrap=("REQUIRED TAGS", "ISOLATION RULES", "DESCRIPTION"),
    )
    for t in tenants:
        profile = t.get("profile") or {}
        table.add_row(
            text(t["name"]),
            text(pairs(profile.get("required_tags"))),
            text(profile.get("min_isolation")),
            text(_rules(profile)),
            text(t.get("description")),
        )
    return table


def quota_summary(quota: dict[str, Any] | None) -> str:
    q = quota or {}
    gpus, mig = q.get("gpus"), q.get("mig_slices")
    return (
        f"GPUs: {'no limit' if gpus is None else gpus}, "
        f"MIG slices: {'no limit' if mig is None else mig}"
    )


def show_tenant(tenant: dict[str, Any]) -> None:
    profile = tenant.get("profile") or {}
    console().print(
        _kv(
            f"Tenant {tenant['name']}",
            [
                ("description", text(tenant.get("description"))),
                ("required tags", text(pairs(profile.get("required_tags")))),
                ("min isolation", text(profile.get("min_isolation"))),
                ("isolation rules", text(_rules(profile))),
                ("GPU co-residency", text(_co_residency(profile))),
                ("quota", text(quota_summary(tenant.get("quota")))),
                ("created", text(timestamp(tenant.get("created_at")))),
                ("updated", text(timestamp(tenant.get("updated_at")))),
            ],
        )
    )


# --- workloads ---------------------------------------------------------------------------------


def workload_status(w: dict[str, Any]) -> Text:
    return text(w["status"], WORKLOAD_STATUS_STYLES.get(w["status"]))


def workloads_table(workloads: Sequence[dict[str, Any]]) -> Table:
    table = _table(
        "NAME",
        "TENANT",
        "STATUS",
        "ISOLATION",
        "REQUEST",
        "NODE",
        "REASON",
        wrap=("REQUEST", "REASON"),
    )
    for w in workloads:
        placement = w.get("placement") or {}
        table.add_row(
            text(w["name"]),
            text(w["tenant"]),
            workload_status(w),
            text(w.get("isolation")),
            text(request_summary(w.get("gpus") or {})),
            text(placement.get("node")),
            text(w.get("reason")),
        )
    return table


def command_summary(command: Sequence[str]) -> str:
    """A command on one line: an inline script argument (``python3 -c "…"``) shows as its
    first line and an ellipsis (``--json`` has it whole)."""
    parts = []
    for arg in command:
        if "\n" in arg:
            arg = arg.split("\n", 1)[0] + " …"
        parts.append(f'"{arg}"' if " " in arg else arg)
    return " ".join(parts)


def engine_job(jobs: Sequence[dict[str, Any]]) -> Text:
    """The latest engine job of a workload: ``local job ID (running: pid 42)``."""
    if not jobs:
        return text(None)
    j = jobs[-1]
    line = Text(f"{j['backend']} job {j['job_id']} (")
    line.append(j["state"], JOB_STATE_STYLES.get(j["state"], ""))
    line.append(f": {j['message']})" if j.get("message") else ")")
    if len(jobs) > 1:
        line.append(f"; {len(jobs) - 1} earlier job(s)", style="dim")
    return line


JOB_STATE_STYLES = {
    "submitted": "yellow",
    "running": "green",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "dim",
}


def show_workload(w: dict[str, Any], jobs: Sequence[dict[str, Any]] | None = None) -> None:
    """One workload; ``jobs`` (GET /workloads/{name}/jobs) adds the engine job running it."""
    out = console()
    out.print(
        _kv(
            f"Workload {w['name']}",
            [
                ("tenant", text(w["tenant"])),
                ("status", workload_status(w)),
                ("isolation", text(w.get("isolation"))),
                ("request", text(request_summary(w.get("gpus") or {}))),
                ("priority", text(w.get("priority"))),
                ("tags", text(pairs(w.get("tags")))),
                ("command", text(command_summary(w.get("command") or []))),
                *([("engine", engine_job(jobs))] if jobs is not None else []),
                ("created", text(timestamp(w.get("created_at")))),
                ("updated", text(timestamp(w.get("updated_at")))),
            ],
        )
    )
    placement = w.get("placement")
    if placement:
        # a gang holds devices on several nodes: one table per node
        for part in placement.get("members") or [placement]:
            out.print()
            table = _table("GPU", "DEVICE", "UUID")
            table.title = f"Placed on {part['node']}"
            table.title_justify = "left"
            for d in part.get("devices", []):
                table.add_row(text(d["gpu_index"]), text(device_summary(d)), text(d["gpu_uuid"]))
            out.print(table)
    if w.get("reason"):
        details = w.get("reason_details") or {}
        rows: list[tuple[str, RenderableType]] = [("reason", text(w["reason"], "yellow"))]
        if details.get("message"):
            rows.append(("message", text(details["message"])))
        if details.get("from_node"):
            rows.append(("from node", text(details["from_node"])))
        out.print()
        out.print(_kv("Why it is " + w["status"], rows))
        rejections = details.get("rejections") or {}
        if rejections:
            table = _table("NODES REJECTED BECAUSE", "COUNT")
            for code, n in sorted(rejections.items(), key=lambda kv: (-kv[1], kv[0])):
                table.add_row(text(code), text(n))
            out.print(table)


def workload_outcome(w: dict[str, Any], verb: str) -> None:
    """One line after a submit or cancel: what happened to the workload."""
    line = Text(f"workload {w['name']} {verb}")
    if w["status"] != verb:
        line.append(": ")
        line.append_text(workload_status(w))
    placement = w.get("placement")
    message = (w.get("reason_details") or {}).get("message")
    if placement:
        devices = ", ".join(_device_short(d) for d in placement.get("devices", []))
        line.append(f" on {placement['node']} [{devices}]")
    elif w["status"] == verb:
        line.append(f": {message}" if message else "")
    elif w.get("reason"):
        line.append(f" — {w['reason']}" + (f": {message}" if message else ""))
    console().print(line, soft_wrap=True)


# --- events ------------------------------------------------------------------------------------


def events_table(events: Sequence[dict[str, Any]]) -> Table:
    table = _table(
        "SEQ",
        "TIME (UTC)",
        "ACTOR",
        "ACTION",
        "TARGET",
        "OUTCOME",
        "DETAILS",
        wrap=("TARGET", "DETAILS"),
    )
    for e in events:
        table.add_row(
            text(e["seq"]),
            text(timestamp(e["ts"])),
            text(e["actor"]),
            text(e["action"]),
            text(f"{e['target_type']}/{e['target_id']}"),
            text(e["outcome"], OUTCOME_STYLES.get(e["outcome"])),
            text(short_details(e.get("details"))),
        )
    return table


def show_event(e: dict[str, Any]) -> None:
    out = console()
    out.print(
        _kv(
            f"Event {e['seq']}",
            [
                ("time", text(timestamp(e["ts"]))),
                ("actor", text(e["actor"])),
                ("action", text(e["action"])),
                ("target", text(f"{e['target_type']}/{e['target_id']}")),
                ("outcome", text(e["outcome"], OUTCOME_STYLES.get(e["outcome"]))),
            ],
        )
    )
    out.print()
    out.print(Text("details", style="bold cyan"))
    out.print(Text(json.dumps(e.get("details") or {}, indent=2, ensure_ascii=False)))


# --- users and tokens --------------------------------------------------------------------------


def user_status(u: dict[str, Any], *, short: bool = False) -> Text:
    """``disabled``, ``locked until …`` (``locked`` when ``short``) or ``active``."""
    if u.get("disabled"):
        return Text("disabled", style="red")
    if u.get("locked_until"):
        until = "" if short else f" until {timestamp(u['locked_until'])}"
        return Text(f"locked{until}", style="yellow")
    return Text("active", style="green")


def users_table(users: Sequence[dict[str, Any]]) -> Table:
    table = _table(
        "USERNAME",
        "ROLES",
        "TENANTS",
        "SOURCE",
        "MFA",
        "STATUS",
        wrap=("ROLES", "TENANTS"),
    )
    for u in users:
        table.add_row(
            text(u["username"]),
            text(", ".join(u.get("roles") or [])),
            text(", ".join(u.get("tenants") or [])),
            text(u.get("source")),
            text("on" if u.get("mfa_enabled") else "off"),
            user_status(u, short=True),
        )
    return table


def show_user(u: dict[str, Any]) -> None:
    console().print(
        _kv(
            f"User {u['username']}",
            [
                ("roles", text(", ".join(u.get("roles") or []))),
                ("tenants", text(", ".join(u.get("tenants") or []))),
                ("source", text(u.get("source"))),
                ("mfa", text("on" if u.get("mfa_enabled") else "off")),
                ("status", user_status(u)),
                ("failed logins", text(u.get("failed_logins"))),
                ("created", text(timestamp(u.get("created_at")))),
                ("updated", text(timestamp(u.get("updated_at")))),
            ],
        )
    )


def token_status(t: dict[str, Any], now: datetime | None = None) -> Text:
    if t.get("revoked_at"):
        return Text("revoked", style="red")
    try:
        expires = datetime.fromisoformat(t["expires_at"])
    except (KeyError, TypeError, ValueError):
        return Text("-", style="dim")
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)
    if expires <= (now or datetime.now(UTC)):
        return Text("expired", style="yellow")
    return Text("active", style="green")


def scope(roles: Sequence[str] | None, tenants: Sequence[str] | None) -> str:
    """``developer on research-lab``: roles, and the tenants they act on."""
    out = ", ".join(roles or []) or "no roles"
    return f"{out} on {', '.join(tenants)}" if tenants else out


def tokens_table(tokens: Sequence[dict[str, Any]]) -> Table:
    """Tokens without their secrets (the API never returns them again). The name tells the
    kind apart (login sessions, agents); kind, exact expiry, revocation and last use are in
    --json."""
    table = _table(
        "ID",
        "NAME",
        "OWNER",
        "SCOPE",
        "EXPIRES",
        "STATUS",
        wrap=("NAME", "OWNER", "SCOPE"),
    )
    for t in tokens:
        expires = timestamp(t.get("expires_at"))  # the day here; the instant in --json
        table.add_row(
            text(t["id"]),
            text(t.get("name") or f"({t.get('kind')})"),
            text(t.get("owner")),
            text(scope(t.get("roles"), t.get("tenants")) if t.get("kind") != "agent" else None),
            text(expires[:10]),
            token_status(t),
        )
    return table


def issued_token(t: dict[str, Any], what: str) -> None:
    """A freshly issued credential: the secret on a line of its own (shown this once), then its
    id and expiry."""
    out = console()
    out.print(Text(f"{what} (shown only this once; store it now):", style="bold yellow"))
    out.print(Text(t["token"]), soft_wrap=True)
    out.print(_kv("", [("id", text(t["id"])), ("expires", text(timestamp(t["expires_at"])))]))


def show_me(me: dict[str, Any], server: str) -> None:
    """``whoami``: the identity behind the current credentials."""
    rows: list[tuple[str, RenderableType]] = [
        ("server", text(server)),
        ("roles", text(", ".join(me.get("roles") or []))),
        ("tenants", text(", ".join(me.get("tenants") or []))),
        ("token", text(me.get("token_id"))),
    ]
    if me.get("mfa_enrollment_required"):
        rows.append(
            ("note", Text("MFA enrollment required: run 'proofplane mfa enroll'", style="yellow"))
        )
    console().print(_kv(f"User {me['username']}", rows))


# --- network segmentation (issue 14) -----------------------------------------------------------


def segments_table(segments: Sequence[dict[str, Any]]) -> Table:
    table = _table("TENANT", "WORKLOAD", "VNI", "PKEY", "STATE", "NODES", wrap=("NODES",))
    for s in segments:
        state = s["state"] + (f" until {timestamp(s['reusable_after'])}"
                              if s.get("reusable_after") else "")  # fmt: skip
        table.add_row(
            text(s["tenant"]),
            text(s.get("workload") or "-"),
            text(str(s["vni"])),
            text(s["pkey"]),
            text(state, "green" if s["state"] == "active" else "dim"),
            text(", ".join(s.get("nodes") or []) or "-"),
        )
    return table


def network_drift(status: dict[str, Any]) -> Text:
    if not status.get("managed"):
        return text("not reporting", "dim")
    if status.get("network_drift"):
        return text("drift: " + ", ".join(status.get("drift") or []), "bold red")
    return text("in sync", "green")


def network_nodes_table(nodes: Sequence[dict[str, Any]]) -> Table:
    table = _table(
        "NODE", "VTEP", "SEGMENTS", "DESIRED", "APPLIED", "REPORTED", "NETWORK", wrap=("NETWORK",)
    )
    for n in nodes:
        vtep = n["vtep"] + (" (simulated)" if n.get("simulated") else "")
        applied = n.get("applied_generation")
        table.add_row(
            text(n["node"]),
            text(vtep),
            text(str(len(n.get("segments") or []))),
            text(str(n["desired_generation"])),
            text("-" if applied is None else str(applied)),
            text(timestamp(n.get("reported_at"))),
            network_drift(n),
        )
    return table


def topology_summary(topo: dict[str, Any]) -> str:
    """One line on a gang's topology request, as ``workloads explain`` judges it now."""
    level, mode = topo.get("level"), topo.get("mode")
    head = f"topology: {level} ({mode})"
    placed = topo.get("placed_domains")
    parts = []
    if placed:
        parts.append(f"placed across {len(placed)} {level}(s): {', '.join(placed)}")
    if topo.get("satisfiable_now"):
        parts.append(f"one {level} holds it now")
    elif topo.get("domains_used"):
        fewest = topo.get("fewest_possible")
        parts.append(f"now it would take {topo['domains_used']} {level}(s), at least {fewest}")
    elif "most_in_one_domain" in topo:
        parts.append(f"no {level} holds it now (at most {topo['most_in_one_domain']} members)")
    return head + (": " + "; ".join(parts) if parts else "")


def mig_layout_lines(m: dict[str, Any] | None) -> list[str]:
    """What ``workloads explain`` prints of its ``mig_layout`` field (issue 17 §2): one line per
    GPU whose MIG layout its placement changed, or why a waiting request's layout change is
    off."""
    if not m:
        return []
    mode = f"PROOFPLANE_MIG_AUTO_LAYOUT={m.get('auto_layout')}"
    if m.get("message"):
        return [f"MIG layout: {m['message']}"]
    lines = []
    for c in m.get("changes") or []:
        where = f"{c['node']} GPU {c['gpu_index']}"
        if c.get("step") == "carve":
            lines.append(
                f"MIG layout: carved {', '.join(c.get('carved') or [])} into the free slices "
                f"of {where} ({mode})"
            )
        else:
            before = ", ".join(c.get("before") or []) or "no instances"
            after = ", ".join(c.get("after") or [])
            how = (
                f"re-laid {where} after defragmentation moved its work"
                if c.get("freed_by_defragmentation")
                else f"reclaimed idle instances of {where}"
                if c.get("step") == "reclaim"
                else f"re-laid idle {where}"
            )
            lines.append(f"MIG layout: {how}: {before} → {after} ({mode})")
    return lines
