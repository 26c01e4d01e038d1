"""Issue 21: every OCSF event proofplane exports conforms to the published OCSF 1.1.0 schema
(``../shared/data/ocsf-schema-1.1.0``, unmodified), checked by the validator compiled from it
(``proofplane.audit.export.ocsf_schema``).

Two sweeps: (1) a scenario through the real services — the attested demo cluster (nodes
register, attest, one drifts and fails, is quarantined, its work moves; certifications,
tenants, workloads), then logins that succeed, fail, lock an account and raise alerts, MFA
enrollment, TOTP and recovery-code logins, tokens issued, rotated and revoked, users created,
updated, unlocked, a certification revoked, a sink created and tested — exported through a real
``ocsf-file`` sink and every line validated; (2) every action the code can record (found in
the source by its ``record``/``NewEvent`` calls: literals, named constants, both arms of a
conditional, f-strings over what their placeholders can be), in each outcome. Zero errors in
both; and the README's mapping table lists every one of them.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from ci import REPO
from ocsf_schema_files import schema
from proofplane.access import SYSTEM, totp
from proofplane.audit.export import ocsf, ocsf_schema
from proofplane.demo import attester as demo
from proofplane.errors import ProofplaneError
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.meter.anomaly import EVALUATED_RULES
from proofplane.model import Event, Outcome
from proofplane.service import access
from proofplane.service import sinks as sinks_svc
from proofplane.service.context import Store
from proofplane.service.nodes import revoke_certification
from proofplane.store import migrate

PASSWORD = "correct horse battery staple"
CLIENT = "203.0.113.7"
TTL = timedelta(hours=1)


def _errors(event: dict[str, Any]) -> list[str]:
    return [str(f) for f in ocsf_schema.errors(schema().validate(event))]


# --- the validator itself: it catches what the schema forbids ---------------------------------


def _valid_api_activity() -> dict[str, Any]:
    event = Event(7, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "alice", "tenant.create",
                  "tenant", "acme", Outcome.SUCCESS, {})  # fmt: skip
    return ocsf.to_ocsf(event, b"\x01" * 32, product_version="1.0", hostname="cp-1")


def test_the_validator_accepts_a_conforming_event() -> None:
    assert _errors(_valid_api_activity()) == []


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda e: e.pop("class_uid"), "attribute_required_missing"),
        (lambda e: e.update(class_uid=9999), "class_uid_unknown"),
        (lambda e: e.update(class_uid="6003"), "attribute_wrong_type"),
        (lambda e: e.pop("metadata"), "attribute_required_missing"),
        (lambda e: e["metadata"].pop("product"), "attribute_required_missing"),
        (lambda e: e["metadata"]["product"].pop("vendor_name"), "attribute_required_missing"),
        (lambda e: e.update(type_uid=600399), "type_uid_incorrect"),
        (lambda e: e.update(activity_id=42, type_uid=600342), "attribute_enum_value_unknown"),
        (lambda e: e.update(severity_id=7), "attribute_enum_value_unknown"),
        (lambda e: e.update(time=1.5), "attribute_wrong_type"),
        (lambda e: e.update(time=True), "attribute_wrong_type"),
        (lambda e: e.update(time=2**64), "attribute_wrong_type"),
        (lambda e: e.update(timezone_offset=2**31), "attribute_wrong_type"),
        (lambda e: e.update(resources={"uid": "x"}), "attribute_wrong_type"),
        (lambda e: e.update(resources=[{"type": "tenant"}]), "constraint_failed"),
        (lambda e: e.update(unknown_thing=1), "attribute_unknown"),
        (lambda e: e["actor"]["user"].update(nickname="al"), "attribute_unknown"),
        (lambda e: e.update(src_endpoint={"ip": "999.1.1.1"}), "attribute_value_regex_not_matched"),
        (
            lambda e: e.update(src_endpoint={"hostname": "bad_host!"}),
            "attribute_value_regex_not_matched",
        ),
        (lambda e: e.update(src_endpoint={"port": 70000}), "attribute_value_exceeds_range"),
        (lambda e: e.update(device={"type_id": 1, "name": "n"}), "attribute_unknown"),
        (lambda e: e["metadata"].update(profiles=["nope"]), "profile_unknown"),
        (lambda e: e["metadata"].update(version="1.9.0"), "version_incompatible"),
        (lambda e: e["metadata"].update(version="one"), "version_invalid_format"),
        (lambda e: e["metadata"].update(uid=7), "attribute_wrong_type"),
        # an object none of whose attributes is allowed (they all need an undeclared profile)
        # is not open: what the event puts in it is unknown
        (lambda e: _profile_only("service", "host"), "attribute_unknown"),
    ],
)  # fmt: skip
def test_the_validator_catches(mutate: Any, code: str) -> None:
    event = _valid_api_activity()
    changed = mutate(event)  # a mutated event, or (here and there) a schema to validate against
    against = changed if isinstance(changed, ocsf_schema.Schema) else schema()
    found = [f.code for f in ocsf_schema.errors(against.validate(event))]
    assert code in found, found


def _profile_only(name: str, profile: str) -> ocsf_schema.Schema:
    """The 1.1.0 schema, but every attribute of object ``name`` belongs to ``profile``."""
    s = schema()
    item = s.objects[name]
    attributes = {k: replace(a, profile=profile) for k, a in item.attributes.items()}
    objects = {**s.objects, name: replace(item, attributes=attributes)}
    return replace(s, objects=objects)


def test_an_open_object_is_one_that_defines_nothing() -> None:
    event = _valid_api_activity()
    event["api"]["service"] = {"name": "proofplane"}
    with_profile = _profile_only("service", "host")
    found = ocsf_schema.errors(with_profile.validate(event))
    assert [(f.code, f.path) for f in found] == [("attribute_unknown", "api.service.name")]
    assert "'host' profile" in found[0].message
    event["metadata"]["profiles"] = ["host"]
    assert ocsf_schema.errors(with_profile.validate(event)) == []
    # `unmapped` (type object, no attributes) stays open
    event["unmapped"] = {"x": {"y": [1]}}
    assert ocsf_schema.errors(with_profile.validate(event)) == []


def test_unmapped_is_open_and_profiles_unlock_their_attributes() -> None:
    event = _valid_api_activity()
    event["unmapped"]["anything"] = {"goes": [1, "two"]}
    assert _errors(event) == []
    event["cloud"] = {"provider": "aws"}  # a cloud-profile attribute, profile not declared
    assert any("cloud" in e and "profile" in e for e in _errors(event))
    event["metadata"]["profiles"] = ["cloud"]
    assert _errors(event) == []


def test_warnings_for_sibling_captions_and_a_suspicious_other() -> None:
    event = _valid_api_activity()
    event["severity"] = "Critical"  # severity_id 1 is Informational
    event["activity_id"], event["type_uid"], event["activity_name"] = 99, 600399, "Other"
    warnings = {f.code for f in schema().validate(event) if f.severity == ocsf_schema.WARNING}
    assert {"attribute_enum_sibling_incorrect",
            "attribute_enum_sibling_suspicious_other"} <= warnings  # fmt: skip
    assert _errors(event) == []


def test_the_compiled_schema_follows_extends_includes_and_profiles() -> None:
    s = schema()
    assert sorted(s.classes) == [0, 2003, 2004, 3001, 3002, 5001, 6003]
    auth = s.classes[3002]
    assert auth.constraints == {"at_least_one": ("service", "dst_endpoint")}
    assert auth.attributes["actor"].profile is None  # the class lifts the host profile's
    assert auth.attributes["device"].profile == "host"
    assert auth.attributes["time"].requirement == "required"  # from includes/occurrence.json
    assert auth.attributes["type_uid"].enum is not None
    assert auth.attributes["type_uid"].enum["300201"] == "Authentication: Logon"
    finding = s.classes[2003]
    assert finding.attributes["status_id"].enum == {
        "0": "Unknown", "1": "New", "2": "In Progress", "3": "Suppressed", "4": "Resolved",
        "99": "Other"}  # fmt: skip
    assert "resources" not in finding.attributes and "resource" in finding.attributes
    assert s.objects["device"].attributes["hostname"].requirement == "recommended"  # endpoint's
    assert s.objects["user"].constraints == {"at_least_one": ("account", "name", "uid")}


def test_a_broken_schema_is_a_schema_error() -> None:
    with pytest.raises(ocsf_schema.SchemaError):
        ocsf_schema.compile_schema({})
    with pytest.raises(ocsf_schema.SchemaError, match="loop"):
        files = {
            "dictionary.json": {"attributes": {}, "types": {"attributes": {}}},
            "categories.json": {"attributes": {}},
            "version.json": {"version": "1.1.0"},
            "objects/a.json": {"name": "a", "extends": "b", "attributes": {}},
            "objects/b.json": {"name": "b", "extends": "a", "attributes": {}},
        }
        ocsf_schema.compile_schema(files)


# --- sweep 1: the scenario, exported through a real ocsf-file sink -----------------------------


def _access_scenario(store: Store, now: datetime) -> None:
    access.create_user(store, SYSTEM, "dev1", PASSWORD, ["developer"], ["nordbank"])
    access.create_user(store, SYSTEM, "ops1", PASSWORD, ["operator"], [])
    # a developer logs in from a client address, then logs out
    issued = access.login(store, "dev1", PASSWORD, None, session_ttl=TTL, source=CLIENT)
    dev = access.authenticate(store, issued.token, datetime.now(UTC))
    access.logout(store, dev)
    # an operator must enroll a second factor first, then logs in with TOTP, then a recovery code
    enrolling = access.login(store, "ops1", PASSWORD, None, session_ttl=TTL, source=CLIENT)
    ops_enrolling = access.authenticate(store, enrolling.token, datetime.now(UTC))
    secret, _ = access.mfa_begin(store, ops_enrolling)
    step = totp.step_at(datetime.now(UTC).timestamp())
    recovery = access.mfa_confirm(store, ops_enrolling, totp.code_at_step(secret, step))
    later = datetime.now(UTC) + timedelta(seconds=90)
    code = totp.code_at_step(secret, totp.step_at(later.timestamp()))
    ops_session = access.login(store, "ops1", PASSWORD, code, session_ttl=TTL, now=later)
    access.login(store, "ops1", PASSWORD, recovery[0], session_ttl=TTL, now=later)
    with pytest.raises(ProofplaneError):  # a wrong TOTP code
        access.login(store, "ops1", PASSWORD, "000000", session_ttl=TTL, now=later)
    ops = access.authenticate(store, ops_session.token, later)
    # tokens: issued, rotated, revoked
    token = access.issue_token(store, ops, roles=["operator"], tenants=None, expires_in=3600,
                               name="ci")  # fmt: skip
    rotated = access.rotate_token(store, ops, token.id)
    access.revoke_token(store, ops, rotated.id)
    # failures: unknown user, wrong passwords until the account locks (alert, lock), a
    # login while locked, then an admin unlocks and updates the user
    with pytest.raises(ProofplaneError):
        access.login(store, "nobody", "x", None, session_ttl=TTL, source=CLIENT)
    with pytest.raises(ProofplaneError):
        access.login(store, "ops1", "wrong", None, session_ttl=TTL, source="2001:db8::5")
    for _ in range(access.LOCK_AFTER + 1):
        with pytest.raises(ProofplaneError):
            access.login(store, "dev1", "wrong", None, session_ttl=TTL)
    access.unlock_user(store, SYSTEM, "dev1")
    access.update_user(store, SYSTEM, "dev1", disabled=True)
    with pytest.raises(ProofplaneError):  # disabled
        access.login(store, "dev1", PASSWORD, None, session_ttl=TTL)
    # a spray: many accounts, one failure each, within the window
    for i in range(access.SPRAY_ALERT):
        with pytest.raises(ProofplaneError):
            access.login(store, f"spray{i}", "x", None, session_ttl=TTL)


def _spec() -> Any:
    text = (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text("utf-8")
    return parse_cluster(text)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ocsf")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROOFPLANE_SINK_DIR", str(tmp))
    try:
        store = Store(f"sqlite:///{tmp / 'pp.db'}")
        migrate.upgrade(store.engine)
        _, attester = demo.load_attested_demo(store, _spec())
        _access_scenario(store, datetime.now(UTC))
        node = next(n for n in _certified_nodes(store))
        revoke_certification(store, SYSTEM, node[0], node[1])
        sinks_svc.create_sink(store, SYSTEM, "lake", "ocsf-file", {"path": "lake.ocsf.jsonl"})
        sinks_svc.test_sink(store, SYSTEM, "lake")
        sinks_svc.export_once(store, SYSTEM, names=["lake"])
        lines = (tmp / "lake.ocsf.jsonl").read_text("utf-8").splitlines()
        store.dispose()
        del attester
    finally:
        mp.undo()
    return [json.loads(line) for line in lines]


def _certified_nodes(store: Store) -> list[tuple[str, str]]:
    from proofplane.service.nodes import list_nodes

    out = []
    for n in list_nodes(store, SYSTEM, limit=500).items:
        for key in sorted(n.certifications):
            out.append((n.name, key))
    return out


def test_every_exported_event_conforms_to_ocsf_1_1_0(exported: list[dict[str, Any]]) -> None:
    assert len(exported) > 150
    problems = {}
    for event in exported:
        errs = _errors(event)
        if errs:
            problems[event["unmapped"]["proofplane"]["action"]] = errs
    assert problems == {}
    classes = {e["class_uid"] for e in exported}
    assert classes == {2003, 2004, 3001, 3002, 5001, 6003}


def _by_action(exported: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [e for e in exported if e["unmapped"]["proofplane"]["action"] == action]


def test_the_scenario_covers_what_the_issue_lists(exported: list[dict[str, Any]]) -> None:
    actions = {e["unmapped"]["proofplane"]["action"] for e in exported}
    wanted = {
        "auth.login", "auth.logout", "mfa.enroll", "mfa.recovery_code.use", "account.lock",
        "account.unlock", "alert.auth_failure_burst", "alert.auth_failure_spray",
        "token.issue", "token.rotate", "token.revoke", "user.create", "user.update",
        "node.register", "node.state", "node.attest", "node.certification.grant",
        "node.certification.revoke", "workload.submit", "workload.place", "workload.evict",
        "tenant.create", "attest.policy.set", "sink.create", "sink.test",
    }  # fmt: skip
    assert wanted <= actions, wanted - actions
    outcomes = {(e["unmapped"]["proofplane"]["action"], e["unmapped"]["proofplane"]["outcome"])
                for e in exported}  # fmt: skip
    assert {("auth.login", "success"), ("auth.login", "failure"), ("auth.login", "denied"),
            ("node.attest", "success"), ("node.attest", "failure")} <= outcomes  # fmt: skip


def test_logins_are_authentication_events_with_service_and_endpoints(
    exported: list[dict[str, Any]],
) -> None:
    logins = _by_action(exported, "auth.login")
    for e in logins:
        assert e["class_uid"] == 3002 and e["type_uid"] == 300201
        assert e["service"]["name"] == "proofplane"
        assert e["logon_type_id"] == 3 and e["user"]["name"]
    ok_from_client = [e for e in logins if e.get("src_endpoint") == {"ip": CLIENT}
                      and e["status_id"] == 1]  # fmt: skip
    assert ok_from_client and all(e["is_remote"] for e in ok_from_client)
    failed = [e for e in logins if e["status_id"] == 2]
    assert {e["status_detail"] for e in failed} >= {"password", "unknown_user", "account_locked",
                                                    "totp", "disabled"}  # fmt: skip
    assert any(e.get("src_endpoint") == {"ip": "2001:db8::5"} for e in failed)
    totp_login = [e for e in logins if e["unmapped"]["proofplane"]["details"].get("mfa")]
    assert totp_login and all(e["is_mfa"] is True for e in totp_login)
    assert all(e["auth_protocol_id"] == 99 and e["auth_protocol"] == "Password" for e in logins)
    recovery = _by_action(exported, "mfa.recovery_code.use")
    assert recovery and all(e["is_mfa"] and e["class_uid"] == 3002 for e in recovery)


def test_attestation_verdicts_are_compliance_findings(exported: list[dict[str, Any]]) -> None:
    verdicts = _by_action(exported, "node.attest")
    assert verdicts
    for e in verdicts:
        assert e["class_uid"] == 2003 and e["type_uid"] == 200301
        assert "status_id" not in e  # the consumer's triage state
        assert e["metadata"]["profiles"] == ["host"]
        c = e["compliance"]
        assert c["standards"] == ["NIST SP 800-53 Rev. 5"] and c["control"] == "SI-7"
        assert c["requirements"][0].startswith("proofplane attestation policy")
        node = e["unmapped"]["proofplane"]["target_id"]
        assert e["resource"]["uid"] == node and e["device"]["name"] == node
        assert e["resource"]["data"]["gpu_uuids"]
        passed = e["unmapped"]["proofplane"]["outcome"] == "success"
        assert (c["status_id"], c["status"]) == ((1, "Pass") if passed else (3, "Fail"))
        if not passed:
            reasons = e["unmapped"]["proofplane"]["details"]["reasons"]
            assert c["status_detail"] == ", ".join(reasons) and c["status_code"] == reasons[0]
            assert e["severity_id"] == 4  # the demo policy enforces
    assert {e["compliance"]["status"] for e in verdicts} == {"Pass", "Fail"}
    # the node's registration stays Device Inventory Info
    assert {e["class_uid"] for e in _by_action(exported, "node.register")} == {5001}


def test_other_activities_name_the_action(exported: list[dict[str, Any]]) -> None:
    others = [e for e in exported if e["activity_id"] == 99]
    assert others
    for e in others:
        assert e["activity_name"] == e["unmapped"]["proofplane"]["action"]
        assert e["type_name"] == f"{e['class_name']}: Other"
    issue = _by_action(exported, "token.issue")[0]
    assert (issue["class_uid"], issue["type_name"]) == (3001, "Account Change: Other")


def test_recommended_attributes_we_know_are_filled(exported: list[dict[str, Any]]) -> None:
    for e in exported:
        md = e["metadata"]
        assert md["log_provider"] == "proofplane" and md["product"]["vendor_name"] == "proofplane"
        assert md["version"] == "1.1.0" and md["sequence"] == e["unmapped"]["proofplane"]["seq"]
        assert e["timezone_offset"] == 0 and e["severity"]
        for user in (e.get("user"), (e.get("actor") or {}).get("user")):
            if user is not None:
                assert user["type_id"] in (1, 3)
        if e["class_uid"] == 5001:
            assert e["device"]["uid"] == e["unmapped"]["proofplane"]["target_id"]
    # no sibling caption disagrees with its id anywhere
    for e in exported:
        warnings = [f for f in schema().validate(e) if f.severity == ocsf_schema.WARNING]
        assert warnings == [], (e["unmapped"]["proofplane"]["action"], warnings)


# --- sweep 2: every action the code can record -------------------------------------------------


# The calls that write an event, and the recording machinery itself (it passes an action on).
_RECORDERS = frozenset({"record", "_record", "NewEvent"})
_MACHINERY = frozenset({"record", "record_many", "_prepare", "_record"})
# An f-string placeholder the analysis below cannot resolve from the code, and the values it
# takes: (module, the f-string's source) -> actions. Empty while every one resolves.
_KNOWN_EXPANSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    # the alert worker raises alert.<rule> for each rule it evaluates (issue 15)
    ("proofplane.service.alerts", "f'{core.PREFIX}{f.rule}'"): tuple(
        f"alert.{rule}" for rule in EVALUATED_RULES
    ),
}
_DEPTH = 4  # callers of callers of … a helper that passes an action on

_Function = ast.FunctionDef | ast.AsyncFunctionDef


class _Unresolved(Exception):
    pass


class _Forwarded(Exception):
    """The recording machinery passing its caller's action on (resolved at the caller)."""


def _callee(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None)


class _ActionFinder:
    """Every action ``record(...)``/``NewEvent(...)`` can be given anywhere in src/, derived
    from the source: a literal; a module-level constant passed by name (``SANITISE_ACTION``,
    ``rules.APPROVE``, resolved in the imported module); both arms of a conditional; an
    f-string over the values of its placeholders; a helper's parameter over the values a guard
    admits (``if p not in (A, B): raise``) or else its callers pass; a local assignment."""

    def __init__(self, root: Path) -> None:
        self.parents: dict[ast.AST, ast.AST] = {}
        self.module_of: dict[ast.AST, str] = {}
        self.calls: list[ast.Call] = []
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            tree = ast.parse(path.read_text("utf-8"))
            self.module_of[tree] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for parent in ast.walk(tree):
                for child in ast.iter_child_nodes(parent):
                    self.parents[child] = parent
                if isinstance(parent, ast.Call):
                    self.calls.append(parent)

    def module(self, node: ast.AST) -> str:
        while node not in self.module_of:
            node = self.parents[node]
        return self.module_of[node]

    def function(self, node: ast.AST) -> _Function | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, _Function):
                return node
        return None

    def actions(self) -> tuple[set[str], list[str]]:
        """(the actions found, the recording calls whose action could not be resolved)."""
        found: set[str] = set()
        unresolved: list[str] = []
        for call in self.calls:
            if _callee(call) not in _RECORDERS:
                continue
            keyword = next((k.value for k in call.keywords if k.arg == "action"), None)
            arg = call.args[0] if call.args else keyword
            if arg is None or (
                isinstance(arg, ast.Constant)
                and not (isinstance(arg.value, str) and "." in arg.value)
            ):
                continue  # some other record(): not an action
            where = f"{self.module(call)}:{call.lineno}: {ast.unparse(arg)}"
            try:
                values = self.values(arg, 0)
            except _Forwarded:
                continue
            except _Unresolved as exc:
                unresolved.append(f"{where} ({exc})")
                continue
            for value in values:
                if isinstance(value, str) and "." in value:
                    found.add(str(value))
                else:
                    unresolved.append(f"{where} ({value!r} is no action)")
        return found, unresolved

    def values(self, expr: ast.expr, depth: int) -> list[Any]:
        if depth > _DEPTH:
            raise _Unresolved("passed on too often")
        if isinstance(expr, ast.Constant):
            return [expr.value]
        if isinstance(expr, ast.IfExp):
            return self.values(expr.body, depth) + self.values(expr.orelse, depth)
        if isinstance(expr, ast.JoinedStr):
            return self._fstring(expr, depth)
        if isinstance(expr, ast.Attribute):
            try:
                return [getattr(v, expr.attr) for v in self.values(expr.value, depth)]
            except AttributeError as exc:
                raise _Unresolved(str(exc)) from None
        if isinstance(expr, ast.Name):
            return self._name(expr, depth)
        func = self.function(expr)
        if isinstance(expr, ast.Starred) and func is not None and func.name in _MACHINERY:
            raise _Forwarded
        raise _Unresolved(f"a {type(expr).__name__}")

    def _fstring(self, expr: ast.JoinedStr, depth: int) -> list[Any]:
        known = _KNOWN_EXPANSIONS.get((self.module(expr), ast.unparse(expr)))
        if known is not None:
            return list(known)
        choices: list[list[str]] = []
        for part in expr.values:
            if isinstance(part, ast.FormattedValue):
                if part.format_spec is not None or part.conversion != -1:
                    raise _Unresolved("a format spec or conversion")
                choices.append([format(v) for v in self.values(part.value, depth)])
            else:
                assert isinstance(part, ast.Constant)
                choices.append([str(part.value)])
        return ["".join(p) for p in itertools.product(*choices)]

    def _name(self, expr: ast.Name, depth: int) -> list[Any]:
        func = self.function(expr)
        if func is not None:
            a = func.args
            if expr.id in {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}:
                if func.name in _MACHINERY:
                    raise _Forwarded
                return self._parameter(func, expr.id, depth)
            assigned = [
                n.value
                for n in ast.walk(func)
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)
            ]
            if assigned:
                return [v for value in assigned for v in self.values(value, depth)]
        namespace = vars(importlib.import_module(self.module(expr)))
        if expr.id in namespace:
            return [namespace[expr.id]]
        raise _Unresolved(f"{expr.id} is no module-level name")

    def _parameter(self, func: _Function, name: str, depth: int) -> list[Any]:
        # a guard naming the values it admits: `if name not in (A, B, C): raise …`
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Name)
                and node.left.id == name
                and [type(op) for op in node.ops] == [ast.NotIn]
                and isinstance(node.comparators[0], ast.Tuple | ast.List | ast.Set)
            ):
                return [v for e in node.comparators[0].elts for v in self.values(e, depth + 1)]
        # else what its callers pass (by position or name), or its default
        a = func.args
        positional = [p.arg for p in (*a.posonlyargs, *a.args)]
        if isinstance(self.parents.get(func), ast.ClassDef) and positional[:1] in (
            ["self"],
            ["cls"],
        ):
            positional = positional[1:]
        defaults: dict[str, ast.expr] = dict(
            zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True)
        )
        defaults |= {k.arg: d for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d}
        index = positional.index(name) if name in positional else None
        out: list[Any] = []
        callers = 0
        for call in self.calls:
            if _callee(call) != func.name:
                continue
            arg = next((k.value for k in call.keywords if k.arg == name), None)
            if arg is None and index is not None and index < len(call.args):
                arg = call.args[index]
            arg = arg if arg is not None else defaults.get(name)
            if arg is None:
                continue  # another function of the same name
            callers += 1
            out.extend(self.values(arg, depth + 1))
        if not callers:
            raise _Unresolved(f"no caller passes {func.name}({name}=…)")
        return out


def _discover() -> tuple[set[str], list[str]]:
    return _ActionFinder(REPO / "src" / "proofplane").actions()


def _recorded_actions() -> set[str]:
    """Every action the code can record (see ``_ActionFinder``)."""
    return _discover()[0]


def test_every_recording_call_resolves_to_its_actions() -> None:
    found, unresolved = _discover()
    # a new kind of dynamic action: teach _ActionFinder, or name its values in _KNOWN_EXPANSIONS
    assert unresolved == []
    # the dynamic forms the finder must see through, each with one action it yields
    assert {
        "workload.succeeded",  # f"workload.{status.value}" over finish()'s callers
        "node.engine_drain",  # f"node.engine_{what}" over _node_call()'s callers
        "change.approve",  # f"change.{decision}" over the guard's rules.APPROVE, …
        "key.disable",  # "key.disable" if disabled else "key.enable"
        "key.enable",
    } <= found
    # constants passed by name resolve to their module-level values
    for module, constant in (
        ("proofplane.service.runbooks", "PUBLISH_ACTION"),
        ("proofplane.service.decommission", "SANITISE_ACTION"),
    ):
        value = getattr(importlib.import_module(module), constant, None)
        if value is not None:
            assert value in found, constant


def test_every_action_the_code_records_maps_to_a_valid_event() -> None:
    actions = _recorded_actions()
    assert len(actions) >= 40 and "auth.login" in actions and "node.attest" in actions
    ts = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    problems = {}
    for action in sorted(actions):
        for outcome in Outcome:
            for target_type, details in (
                ("user", {}),
                ("node", {"reason": "r", "reasons": ["pcr_mismatch"], "ok": False,
                          "source_ip": "not an address", "severity": "bogus"}),
            ):  # fmt: skip
                event = Event(1, ts, "system", action, target_type, "x-1", outcome, details)
                out = ocsf.to_ocsf(event, b"\x02" * 32, product_version="1", hostname="h_1")
                errs = _errors(out)
                if errs:
                    problems[(action, outcome.value, target_type)] = errs
    assert problems == {}


def test_an_incident_is_one_detection_finding_from_open_to_close() -> None:
    ts = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    steps = [
        ("incident.open", {"severity": "high", "subject": "gpu-node-3"}),
        ("incident.update", {"severity": {"from": "high", "to": "critical"}}),
        ("incident.update", {"owner": {"from": None, "to": "ops1"}}),
        ("incident.close", {"from": "mitigated", "to": "closed", "postmortem": "…"}),
    ]
    out = [
        ocsf.to_ocsf(Event(i, ts, "ops1", action, "incident", "42", Outcome.SUCCESS, details),
                     b"\x03" * 32, product_version="1", hostname="cp-1")
        for i, (action, details) in enumerate(steps, 1)
    ]  # fmt: skip
    assert [e["class_uid"] for e in out] == [2004] * 4
    assert [e["type_uid"] for e in out] == [200401, 200402, 200402, 200403]
    assert {e["finding_info"]["uid"] for e in out} == {"proofplane-incident-42"}
    assert [e["severity_id"] for e in out] == [4, 5, 0, 0]  # Unknown when not carried
    assert [e["severity"] for e in out] == ["High", "Critical", "Unknown", "Unknown"]
    assert all(_errors(e) == [] for e in out)
    alert = ocsf.to_ocsf(Event(9, ts, "system", "alert.change_review_overdue", "change", "7",
                               Outcome.SUCCESS, {}), b"\x03" * 32, product_version="1")  # fmt: skip
    assert alert["severity_id"] == 4 and alert["finding_info"]["uid"] == "proofplane-9"


def test_an_unsupported_ocsf_version_is_refused() -> None:
    event = Event(1, datetime(2026, 1, 1, tzinfo=UTC), "a", "x.y", "t", "i", Outcome.SUCCESS, {})
    with pytest.raises(ValueError, match="1.3.0"):
        ocsf.to_ocsf(event, b"\0" * 32, product_version="1", ocsf_version="1.3.0")


def test_the_ocsf_version_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from proofplane import config

    assert config.OCSF_VERSIONS == ocsf.VERSIONS
    assert config.sink_settings_from_env({}).ocsf_version == "1.1.0"
    with pytest.raises(ProofplaneError) as bad:
        config.sink_settings_from_env({"PROOFPLANE_OCSF_VERSION": "1.3.0"})
    assert bad.value.code == "invalid_setting"


# --- the offline check an auditor runs: proofplane sinks validate-ocsf --------------------------


def _validate_cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from proofplane.cli.main import app

    return CliRunner().invoke(app, ["sinks", "validate-ocsf", *args])


def test_validate_ocsf_cli_passes_the_export_and_names_each_error(
    exported: list[dict[str, Any]], tmp_path: Path
) -> None:
    from ocsf_schema_files import SCHEMA_DIRS

    schema_dir = str(SCHEMA_DIRS["1.1.0"])
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(e) + "\n" for e in exported), "utf-8")
    done = _validate_cli(str(good), "--schema", schema_dir)
    assert done.exit_code == 0, done.output
    assert f"{len(exported)} event(s) checked against OCSF 1.1.0: ok" in done.output

    broken = [dict(e) for e in exported[:3]]
    broken[1] = {**broken[1], "type_uid": 1}
    del broken[2]["metadata"]
    array = tmp_path / "broken.json"
    array.write_text(json.dumps(broken), "utf-8")
    failed = _validate_cli(str(array), "--schema", schema_dir, "--json")
    assert failed.exit_code == 1
    report = json.loads(failed.stdout)
    assert report["events"] == 3 and report["schema"] == "1.1.0"
    assert {(f["event"], f["code"]) for f in report["findings"]} >= {
        ("broken.json[1]", "type_uid_incorrect"),
        ("broken.json[2]", "attribute_required_missing"),
    }
    assert all(f["severity"] == "error" for f in report["findings"])
    with_warnings = _validate_cli(str(good), "--schema", schema_dir, "--warnings", "--json")
    assert with_warnings.exit_code == 0  # warnings (missing recommended) do not fail
    codes = {f["code"] for f in json.loads(with_warnings.stdout)["findings"]}
    assert codes <= {"attribute_recommended_missing"}


@pytest.mark.parametrize(
    ("content", "schema_ok", "message"),
    [
        ('{"class_uid": 6003}\nnot json\n', True, "good.jsonl:2: not JSON"),
        ("[1, 2", True, "not JSON"),
        ("{}\n", False, "not an OCSF schema directory"),
    ],
)
def test_validate_ocsf_cli_refuses_bad_input_with_a_message(
    tmp_path: Path, content: str, schema_ok: bool, message: str
) -> None:
    from ocsf_schema_files import SCHEMA_DIRS

    schema()  # skips (locally) or fails (CI) without the schema files
    path = tmp_path / "good.jsonl"
    path.write_text(content, "utf-8")
    schema_dir = str(SCHEMA_DIRS["1.1.0"]) if schema_ok else str(tmp_path)
    result = _validate_cli(str(path), "--schema", schema_dir)
    assert result.exit_code == 1 and message in result.output
    assert "Traceback" not in result.output
    missing = _validate_cli(str(tmp_path / "absent.jsonl"), "--schema", schema_dir)
    assert missing.exit_code == 1 and "Traceback" not in missing.output


def test_the_readme_mapping_table_is_what_the_code_does() -> None:
    text = (REPO / "README.md").read_text("utf-8")
    table = text.split("| OCSF class | activity | our actions |", 1)[1].split("\n\n", 1)[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    listed: set[str] = set()
    for row in rows:
        cls, activity, actions = (c.strip() for c in row.strip("|").split("|"))
        for action in (a.split("`")[1] for a in actions.split(", ")):
            got = ocsf.classify(action)
            want = (int(cls.split()[0]), int(activity.split()[0]))
            assert (got.class_uid, got.activity_id) == want, action
            listed.add(action)
    assert _recorded_actions() <= listed  # every action the code records is in the table
