"""The evidence artifacts: each one a query over the live record for the period, with the
audit entries it cites (their log indices) and the exceptions it found.

Placement compliance is computed from the log alone: certifications, attestation verdicts and
node states are replayed in log order up to each ``workload.place``, so the answer is the one
an auditor would get from the entries themselves (and the entries it rests on are cited).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select, type_coerce

from proofplane.access import SYSTEM
from proofplane.access.credentials import MIN_PASSWORD
from proofplane.access.roles import MFA_REQUIRED, ROLE_PERMISSIONS, Permission
from proofplane.service import audit as audit_svc
from proofplane.service import change_register, key_inventory
from proofplane.service import network as network_svc
from proofplane.service import sinks as sinks_svc
from proofplane.service.access import LOCK_AFTER, LOCK_FOR, MAX_TOKEN_TTL, THROTTLE_FREE
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, JsonType, TokenRow, UserRow

MAX_CITED = 2_000  # per artifact: exceptions first, then the newest
MAX_LISTED = 1_000  # exceptions spelled out per artifact (all are counted)
PLACEMENT_INPUTS = (
    "node.certification.grant",
    "node.certification.revoke",
    "node.attest",
    "node.state",
    "workload.place",
)


@dataclass
class Artifact:
    name: str
    title: str
    summary: str
    data: dict[str, Any]
    cited: list[int] = field(default_factory=list)  # log indices (seq - 1)
    exceptions: list[str] = field(default_factory=list)
    cited_total: int = 0  # before the MAX_CITED cap

    def cite(self, indices: list[int], first: list[int] | None = None) -> None:
        """Cite ``first`` (exceptions) and then ``indices``, at most MAX_CITED in all."""
        ordered = list(dict.fromkeys([*(first or []), *indices]))
        self.cited_total = len(ordered)
        self.cited = sorted(ordered[:MAX_CITED])


@dataclass(frozen=True, slots=True)
class Period:
    start: datetime
    end: datetime
    tenant: str | None
    now: datetime
    session_ttl: timedelta


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _in_period(p: Period) -> Any:
    return (EventRow.ts >= p.start) & (EventRow.ts < p.end)


def accounts(store: Store, p: Period) -> Artifact:
    required = {r.value for r in MFA_REQUIRED}
    with store.read() as s:
        rows = list(s.scalars(select(UserRow).order_by(UserRow.username)))
        last_change = dict(
            s.execute(
                select(EventRow.target_id, func.max(EventRow.seq))
                .where(EventRow.target_type == "user", EventRow.ts < p.end)
                .group_by(EventRow.target_id)
            ).all()
        )
    users = []
    exceptions = []
    for r in rows:
        if p.tenant is not None and p.tenant not in r.tenants and not _global(r.roles):
            continue
        needs = sorted(set(r.roles) & required)
        users.append(
            {
                "username": r.username,
                "roles": r.roles,
                "tenants": r.tenants,
                "source": r.source,
                "mfa_enabled": r.totp_enabled,
                "mfa_required_by": needs,
                "disabled": r.disabled,
                "locked_until": _iso(r.locked_until),
                "created_at": _iso(r.created_at),
            }
        )
        if needs and not r.totp_enabled and not r.disabled and r.source == "local":
            exceptions.append(
                f"{r.username} holds {', '.join(needs)} (MFA required) and has not enrolled a "
                "second factor: it can only enroll until it does"
            )
    art = Artifact(
        "accounts",
        "Account inventory with roles and MFA status",
        f"{len(users)} accounts; {sum(u['mfa_enabled'] for u in users)} with TOTP enrolled",
        {"accounts": users},
        exceptions=exceptions,
    )
    art.cite([seq - 1 for name, seq in last_change.items() if any(u["username"] == name
              for u in users)])  # fmt: skip
    return art


def _global(roles: list[str]) -> bool:
    return any(r in ("admin", "operator", "auditor", "security-officer") for r in roles)


def role_permissions(store: Store, p: Period) -> Artifact:
    matrix = {
        role.value: sorted(perm.value for perm in perms) for role, perms in ROLE_PERMISSIONS.items()
    }
    return Artifact(
        "role-permissions",
        "Role to permission matrix",
        f"{len(matrix)} roles over {len(Permission)} permissions",
        {
            "roles": matrix,
            "permissions": sorted(x.value for x in Permission),
            "mfa_required": sorted(r.value for r in MFA_REQUIRED),
        },
    )


def auth_settings(store: Store, p: Period) -> Artifact:
    return Artifact(
        "auth-settings",
        "Lockout, session and credential settings",
        f"lock after {LOCK_AFTER} failures for {LOCK_FOR}; sessions last {p.session_ttl}",
        {
            "lock_after_failures": LOCK_AFTER,
            "lock_for_seconds": int(LOCK_FOR.total_seconds()),
            "throttle_after_failures_per_address": THROTTLE_FREE,
            "session_ttl_seconds": int(p.session_ttl.total_seconds()),
            "max_token_ttl_seconds": int(MAX_TOKEN_TTL.total_seconds()),
            "password_min_length": MIN_PASSWORD,
            "password_hash": "argon2id",
            "mfa": "TOTP (RFC 6238), single-use recovery codes",
        },
    )


def tokens(store: Store, p: Period) -> Artifact:
    with store.read() as s:
        rows = s.execute(
            select(TokenRow, UserRow.username)
            .outerjoin(UserRow, UserRow.id == TokenRow.user_id)
            .where(TokenRow.created_at < p.end)
            .order_by(TokenRow.created_at)
        ).all()
    items = []
    for t, owner in rows:
        if p.tenant is not None and p.tenant not in t.tenants and not _global(t.roles):
            continue
        items.append(
            {
                "id": t.id,
                "kind": t.kind,
                "name": t.name,
                "owner": owner or t.node_name or "bootstrap",
                "roles": t.roles,
                "tenants": t.tenants,
                "created_at": _iso(t.created_at),
                "expires_at": _iso(t.expires_at),
                "revoked_at": _iso(t.revoked_at),
                "last_used_at": _iso(t.last_used_at),
                "active_at_end": t.revoked_at is None and t.expires_at > p.end,
            }  # fmt: skip
        )
    active = sum(1 for i in items if i["active_at_end"])
    return Artifact(
        "tokens",
        "Token inventory (no secrets: ids and scopes)",
        f"{len(items)} credentials issued before the end of the period, {active} active then",
        {"tokens": items},
    )


def _events(store: Store, p: Period, where: Any, limit: int | None = None) -> list[Any]:
    with store.read() as s:
        q = (
            select(EventRow.seq, EventRow.ts, EventRow.actor, EventRow.action,
                   EventRow.target_type, EventRow.target_id, EventRow.outcome, EventRow.details)
            .where(where).order_by(EventRow.seq)
        )  # fmt: skip
        if limit is not None:
            q = q.limit(limit)
        return list(s.execute(q).all())


def _stream(store: Store, where: Any, details: Any = None) -> Iterator[Any]:
    """The matching events in log order, read in batches (a month holds millions);
    ``details``: what to read as the details column (default: the details)."""
    column = (EventRow.details if details is None else type_coerce(details, JsonType)).label(
        "details"
    )
    with store.read(streaming=True) as s:
        q = (
            select(EventRow.seq, EventRow.ts, EventRow.actor, EventRow.action,
                   EventRow.target_type, EventRow.target_id, EventRow.outcome, column)
            .where(where).order_by(EventRow.seq).execution_options(yield_per=20_000)
        )  # fmt: skip
        yield from s.execute(q)


def _mentions(row: Any, tenant: str | None) -> bool:
    if tenant is None:
        return True
    if row.target_type == "tenant" and row.target_id == tenant:
        return True
    return bool((row.details or {}).get("tenant") == tenant)


def account_changes(store: Store, p: Period) -> Artifact:
    rows = sorted(  # one index range per prefix (SQLite scans the table for an OR of them)
        (
            r
            for x in ("user.", "token.", "mfa.")
            for r in _events(store, p, _in_period(p) & _prefix(x))
        ),
        key=lambda r: r.seq,
    )
    counts = Counter(r.action for r in rows)
    art = Artifact(
        "account-changes",
        "Account, credential and MFA changes in the period",
        f"{len(rows)} changes: " + (", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
                                    or "none"),
        {
            "by_action": dict(sorted(counts.items())),
            "changes": [_brief(r) for r in rows[-MAX_CITED:]],
        },
    )  # fmt: skip
    art.cite([r.seq - 1 for r in reversed(rows)])
    return art


def _prefix(prefix: str) -> Any:
    """action starts with ``prefix``, as a range the action index serves (LIKE does not)."""
    return (EventRow.action >= prefix) & (EventRow.action < prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _brief(r: Any) -> dict[str, Any]:
    return {
        "index": r.seq - 1, "ts": _iso(r.ts), "actor": r.actor, "action": r.action,
        "target": f"{r.target_type}/{r.target_id}", "outcome": r.outcome,
    }  # fmt: skip


def login_failures(store: Store, p: Period) -> Artifact:
    rows = _events(
        store,
        p,
        _in_period(p) & (EventRow.action == "auth.login") & (EventRow.outcome == "failure"),
    )
    by_user = Counter(r.target_id for r in rows)
    art = Artifact(
        "login-failures",
        "Failed sign-ins and lockouts",
        f"{len(rows)} failed sign-ins for {len(by_user)} account names",
        {"by_account": dict(by_user.most_common()), "failures": [_brief(r) for r in rows[-500:]]},
    )
    art.cite([r.seq - 1 for r in reversed(rows)])
    return art


def attestation(store: Store, p: Period) -> Artifact:
    """Counted in SQL (a month holds millions of attestations); the details read are those of
    each node's latest verdict and of the failures (the first MAX_LISTED)."""
    where = _in_period(p) & (EventRow.action == "node.attest")
    nodes: dict[str, dict[str, Any]] = {}
    latest: dict[str, int] = {}
    failures: list[int] = []

    def entry(name: str) -> dict[str, Any]:
        return nodes.setdefault(
            name, {"passed": 0, "failed": 0, "reasons": Counter(), "simulated": False,
                   "last": None},
        )  # fmt: skip

    with store.read() as s:
        for name, outcome, n, last in s.execute(
            select(EventRow.target_id, EventRow.outcome, func.count(), func.max(EventRow.seq))
            .where(where)
            .group_by(EventRow.target_id, EventRow.outcome)
        ):
            entry(name)["passed" if outcome == "success" else "failed"] += n
            latest[name] = max(latest.get(name, -1), last - 1)
        for seq, name, d in s.execute(
            select(EventRow.seq, EventRow.target_id, EventRow.details)
            .where(where, EventRow.outcome != "success")
            .order_by(EventRow.seq)
            .limit(MAX_LISTED)
        ):
            failures.append(seq - 1)
            d = d or {}
            for reason in d.get("reasons") or [d.get("reason") or "failed"]:
                entry(name)["reasons"][str(reason)] += 1
        seqs = sorted(i + 1 for i in latest.values())
        for k in range(0, len(seqs), 500):
            for seq, name, ts, outcome, d in s.execute(
                select(EventRow.seq, EventRow.target_id, EventRow.ts, EventRow.outcome,
                       EventRow.details).where(EventRow.seq.in_(seqs[k : k + 500]))
            ):  # fmt: skip
                d = d or {}
                n = entry(name)
                n["simulated"] = bool(d.get("simulated"))
                n["last"] = {"at": _iso(ts), "ok": outcome == "success", "index": seq - 1,
                             "evidence_hash": d.get("evidence_hash")}  # fmt: skip
    count = sum(n["passed"] + n["failed"] for n in nodes.values())
    exceptions = [
        f"{name}: {n['failed']} failed attestation(s) ({', '.join(n['reasons'])})"
        for name, n in sorted(nodes.items())
        if n["failed"]
    ]
    simulated = sorted(name for name, n in nodes.items() if n["simulated"])
    if simulated:
        exceptions.append(
            f"{len(simulated)} node(s) attested by a simulated attester (no hardware TPM): "
            + ", ".join(simulated[:20]) + (" …" if len(simulated) > 20 else "")
        )  # fmt: skip
    for n in nodes.values():
        n["reasons"] = dict(n["reasons"])
    art = Artifact(
        "attestation",
        "Every node's attestation results (simulated attesters marked)",
        f"{count} attestations of {len(nodes)} nodes: "
        f"{sum(n['failed'] for n in nodes.values())} failed; {len(simulated)} simulated nodes",
        {"nodes": dict(sorted(nodes.items())), "simulated_nodes": simulated},
        exceptions=exceptions,
    )
    art.cite(sorted(latest.values()), first=failures)
    return art


def _placement_inputs(store: Store, p: Period) -> Iterator[tuple[Any, ...]]:
    """The events placement compliance replays, in log order, with only the detail fields it
    reads, extracted by the database (an attestation's verdict is its outcome)."""
    d, action = EventRow.details, EventRow.action
    place = action == "workload.place"
    cert = action.in_(("node.certification.grant", "node.certification.revoke"))

    def text(when: Any, key: str) -> Any:
        return case((when, d[key].as_string()))

    def obj(when: Any, key: str) -> Any:
        return type_coerce(case((when, d[key])), JsonType)

    q = (
        select(
            # in the period, as a flag (decoding millions of times costs more than the check)
            EventRow.seq, case((EventRow.ts >= p.start, 1), else_=0), action,
            EventRow.target_id, EventRow.outcome,
            text(place, "node"), text(place, "tenant"), obj(place, "tags"),
            obj(place, "members"), text(cert, "key"), text(cert, "value"),
            text(action == "node.state", "to"),
        )
        .where(action.in_(PLACEMENT_INPUTS), EventRow.ts < p.end)
        .order_by(EventRow.seq)
        .execution_options(yield_per=20_000)
    )  # fmt: skip
    with store.read(streaming=True) as s:
        yield from s.execute(q)


def placement_compliance(store: Store, p: Period) -> Artifact:
    """Every placement in the period, checked against the log as it stood: each of the
    workload's tags certified on each node it went to, the node admitted, and its latest
    attestation before the placement a pass."""
    certs: dict[str, dict[str, tuple[str, int]]] = {}
    attested: dict[str, tuple[bool, int]] = {}
    state: dict[str, str] = {}
    checked = 0
    by_tag: Counter[str] = Counter()
    exceptions: list[str] = []
    bad: list[int] = []
    supporting: deque[int] = deque(maxlen=4 * MAX_CITED)  # the newest are cited
    for (
        seq,
        in_period,
        action,
        node,
        outcome,
        on,
        tenant,
        tags,
        members,
        key,
        value,
        to,
    ) in _placement_inputs(store, p):
        if action == "node.attest":
            attested[node] = (outcome == "success", seq - 1)
        elif action == "node.certification.grant":
            certs.setdefault(node, {})[str(key)] = (str(value), seq - 1)
        elif action == "node.certification.revoke":
            certs.setdefault(node, {}).pop(str(key), None)
        elif action == "node.state":
            state[node] = str(to)
        elif tags and in_period and (p.tenant is None or tenant == p.tenant):
            checked += 1
            placed_on = [m["node"] for m in members or []] or [on]
            problems = _placement_problems(
                placed_on, tags, certs, attested, state, supporting, len(exceptions) < MAX_LISTED
            )
            for k, v in tags.items():
                by_tag[f"{k}={v}"] += 1
            if problems:
                bad.append(seq - 1)
                if len(exceptions) < MAX_LISTED:  # all are counted, the first listed
                    exceptions.append(
                        f"entry {seq - 1}: {tenant}/{node} placed on "
                        f"{', '.join(map(str, placed_on))}: {'; '.join(problems)}"
                    )
            else:
                supporting.append(seq - 1)
    art = Artifact(
        "placement-compliance",
        "Placement compliance computed from the log",
        f"{checked} placements of tagged workloads checked; {len(bad)} exceptions",
        {
            "rule": "every workload tagged k=v was placed only on nodes certified k=v, admitted, "
            "whose latest attestation before the placement passed",
            "placements_checked": checked,
            "by_tag": dict(sorted(by_tag.items())),
            "exceptions_total": len(bad),
            "exceptions_listed": len(exceptions),
        },
        exceptions=exceptions,
    )
    art.cite(list(reversed(supporting)), first=bad)
    return art


def _placement_problems(
    placed_on: list[Any],
    tags: dict[str, str],
    certs: dict[str, dict[str, tuple[str, int]]],
    attested: dict[str, tuple[bool, int]],
    state: dict[str, str],
    supporting: deque[int],
    describe: bool,
) -> list[str]:
    """What was wrong with a placement on ``placed_on`` as the log stood (nothing: it
    complied, and the entries that show it are added to ``supporting``); without
    ``describe`` one word per problem (a month may hold a million exceptions: the listed
    ones are spelled out)."""
    problems = []
    for n in placed_on:
        held_by = certs.get(n, {})
        for k, v in sorted(tags.items()):
            held = held_by.get(k)
            if held is None or held[0] != v:
                problems.append(f"{n} was not certified {k}={v}" if describe else "cert")
            else:
                supporting.append(held[1])
        ok, at = attested.get(n, (False, -1))
        if not ok:
            problems.append(f"{n} had not passed its latest attestation" if describe else "att")
        else:
            supporting.append(at)
        if state.get(n) != "admitted":
            problems.append(
                f"{n} was {state.get(n, 'unknown')}, not admitted" if describe else "state"
            )
    return problems


def siem_sinks(store: Store, p: Period) -> Artifact:
    items = sinks_svc.list_sinks(store, SYSTEM, limit=500).items
    sinks = [
        {
            "name": v.name,
            "type": v.type,
            "enabled": v.enabled,
            "cursor": v.cursor,
            "head": v.head,
            "lag": v.head - v.cursor,
            "consecutive_failures": v.consecutive_failures,
            "last_error": v.last_error,
            "last_success_at": _iso(v.last_success_at),
        }  # fmt: skip
        for v in items
    ]
    exceptions = [
        f"sink {s['name']}: {s['consecutive_failures']} consecutive delivery failures "
        f"({s['last_error']})"
        for s in sinks
        if s["enabled"] and s["consecutive_failures"]
    ]
    if not any(s["enabled"] for s in sinks):
        exceptions.append("no SIEM sink is enabled: events are not exported to a SIEM")
    return Artifact(
        "siem-sinks",
        "SIEM sinks and their delivery state",
        f"{len(sinks)} sinks, {sum(s['enabled'] for s in sinks)} enabled",
        {"sinks": sinks},
        exceptions=exceptions,
    )


def audit_log_verification(store: Store, p: Period, keys: audit_svc.AuditKeys) -> Artifact:
    report = audit_svc.verify_log(store, audit_svc.known_verifiers(store, keys))
    data = report.to_dict()
    exceptions = []
    if not report.ok:
        exceptions = [f"the audit log does not verify: {x}" for x in report.problems]
    elif not report.verified_against_checkpoint:
        exceptions = ["no signed checkpoint covers the log yet"]
    return Artifact(
        "audit-log-verification",
        "Audit log verification (the whole tree against the newest signed checkpoint)",
        ("verified" if report.ok else "FAILED")
        + f": {report.events} events, checkpoint of {report.checkpoint_size} entries",
        data,
        exceptions=exceptions,
    )


def events_summary(store: Store, p: Period) -> Artifact:
    with store.read() as s:
        rows = s.execute(
            select(EventRow.action, EventRow.outcome, func.count(), func.min(EventRow.seq),
                   func.max(EventRow.seq))
            .where(_in_period(p)).group_by(EventRow.action, EventRow.outcome)
        ).all()  # fmt: skip
        total_log = s.scalar(select(func.count()).select_from(EventRow)) or 0
    by_action: dict[str, dict[str, int]] = {}
    firsts = []
    for action, outcome, n, first, last in rows:
        by_action.setdefault(action, {})[outcome] = n
        firsts += [first - 1, last - 1]
    total = sum(sum(v.values()) for v in by_action.values())
    art = Artifact(
        "events-summary",
        "Events recorded in the period, by action and outcome",
        f"{total} events in the period ({total_log} in the whole log)",
        {
            "events_in_period": total,
            "events_in_log": total_log,
            "by_action": dict(sorted(by_action.items())),
        },  # fmt: skip
    )
    art.cite(firsts)
    return art


def key_inventory_artifact(store: Store, p: Period) -> Artifact:
    keys = [k.to_json() for k in key_inventory.list_keys(store, SYSTEM)]
    return Artifact(
        "key-inventory",
        "KMS key inventory: versions, what each key protects, use counts",
        f"{len(keys)} keys",
        {"keys": keys},
    )


def change_register_artifact(store: Store, p: Period) -> Artifact:
    register = change_register.export_register(store, SYSTEM, start=p.start, end=p.end, now=p.now)
    changes = register.get("changes") or register.get("items") or []
    return Artifact(
        "change-register",
        "Change register: change requests and their approvals in the period",
        f"{len(changes)} changes",
        register,
    )


def segmentation(store: Store, p: Period) -> Artifact:
    items = network_svc.list_segments(store, SYSTEM, tenant=p.tenant, limit=500).items
    return Artifact(
        "segmentation",
        "Network segmentation map (segments per tenant)",
        f"{len(items)} active segments",
        {"segments": items},
    )


def collect_all(store: Store, p: Period, keys: audit_svc.AuditKeys) -> dict[str, Artifact]:
    """Every artifact. The two that are one large SQL aggregate each (events by action, the
    attestation counts) run on their own connections while this thread replays placements
    in Python (the database works outside the GIL); the log's verification, which uses a
    process per core, comes after them."""
    with ThreadPoolExecutor(2, thread_name_prefix="evidence") as pool:
        side = [pool.submit(events_summary, store, p), pool.submit(attestation, store, p)]
        arts = [
            placement_compliance(store, p), accounts(store, p), account_changes(store, p),
            role_permissions(store, p), auth_settings(store, p), tokens(store, p),
            login_failures(store, p), siem_sinks(store, p), key_inventory_artifact(store, p),
            change_register_artifact(store, p), segmentation(store, p),
        ]  # fmt: skip
        arts += [f.result() for f in side]
    arts.append(audit_log_verification(store, p, keys))
    order = ("accounts", "account-changes", "role-permissions", "auth-settings", "tokens",
             "login-failures", "attestation", "placement-compliance", "siem-sinks",
             "audit-log-verification", "events-summary", "key-inventory", "change-register",
             "segmentation")  # fmt: skip
    by_name = {a.name: a for a in arts}
    return {name: by_name[name] for name in order}
