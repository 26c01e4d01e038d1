"""Property-based fuzzing of every route in the application's route table (issue 19, §2):
whatever arrives, the answer is never a 5xx, and an error is in the usual shape.

Beside the schemathesis run (``test_api_fuzz.py``, which generates from the OpenAPI document
and so stays near what the schema describes), this one aims at the input classes that made
500s before: JSON nested far deeper than any body is, lone UTF-16 surrogates (escaped in JSON,
as raw CESU-8 bytes, percent-encoded in paths and queries, inside base64 cursors), NUL
characters, times at and beyond the ends of the calendar, integers and floats beyond every
column (2**63, 2**64, 1e308, NaN, Infinity), and the wrong JSON type at every level of a
realistic body. Each body route mutates an example of its own (``EXAMPLES``, which must cover
every route that takes a body), each path parameter is either an object that exists or
garbage, and every request is sent both as the admin and without credentials.

Runs against one prepared database per store kind (SQLite and PostgreSQL; built once per
module and worker): no example is allowed to 5xx, and none needs to see the others' effects.
The network is closed (a sink test connects nowhere), and examples are bounded so the whole
module takes well under a minute on two cores.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, cast
from urllib.parse import quote

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.api.deps import access_rule
from proofplane.api.request_body import MAX_JSON_DEPTH
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

API = "/api/v1"
ADMIN_TOKEN = "ppt_route-fuzz-admin-token-0123456789ab"
PASSWORD = "correct horse battery staple"
IDENTITIES = ("admin", "anonymous")


# --- the route table ---------------------------------------------------------------------------


def _route_contexts(app: FastAPI) -> list[Any]:
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI: included routes are in app.routes directly
        return list(app.routes)
    return list(iter_route_contexts(app.routes))


def api_routes(app: FastAPI) -> dict[tuple[str, str], APIRoute]:
    out: dict[tuple[str, str], APIRoute] = {}
    for context in _route_contexts(app):
        route = getattr(context, "original_route", context)
        if isinstance(route, APIRoute):
            for method in sorted(context.methods or ()):
                out.setdefault((method, context.path), route)
    return out


ROUTES = api_routes(create_app(cast(Store, None)))


# --- what exists in the prepared database ------------------------------------------------------

NODE = "fra-h100-01"
TENANT = "st-marys-hospital"
WORKLOAD = "fuzz-w1"
SINK = "fuzz-s1"
USER = "fuzz-user"  # never the admin: a mutated PATCH must not lock the fuzzer out
CERT = "tier"

ADMISSION = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {
        "uid": "fuzz-0001",
        "kind": {"group": "batch", "version": "v1", "kind": "Job"},
        "operation": "CREATE",
        "subResource": None,
        "object": {
            "metadata": {"name": "j", "labels": {"a": "b"}},
            "spec": {
                "template": {
                    "metadata": {"labels": {"compliance.proofplane.io/tier": "gold"}},
                    "spec": {
                        "nodeName": NODE,
                        "nodeSelector": {"kubernetes.io/hostname": NODE},
                        "containers": [{"name": "c", "image": "i", "command": ["true"]}],
                    },
                }
            },
        },
    },
}

#: A valid body for every route that takes one; the fuzzer mutates it.
EXAMPLES: dict[tuple[str, str], Any] = {
    ("POST", f"{API}/tenants"): {
        "name": "fuzz-t2",
        "description": "d",
        "profile": {
            "required_tags": {"hipaa": "true"},
            "min_isolation": "shared",
            "isolation_rules": {"hipaa=true": "dedicated-gpu"},
            "co_residency": True,
        },
    },
    ("PATCH", f"{API}/tenants/{{name}}"): {"description": "d", "profile": {"required_tags": {}}},
    ("PUT", f"{API}/tenants/{{name}}/quota"): {"gpus": 4, "mig_slices": None},
    ("POST", f"{API}/nodes"): {
        "name": "fuzz-n2",
        "region": "eu-frankfurt",
        "zone": "eu-frankfurt-1a",
        "rack": "r1",
        "labels": {"a": "b"},
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-fuzz-0",
                "model": "H100-80GB",
                "memory_mb": 0,
                "mig_enabled": True,
                "mig_instances": [{"profile": "3g.40gb", "start": 0}],
            }
        ],
    },
    ("PATCH", f"{API}/nodes/{{name}}"): {"labels": {"a": "b"}, "rack": "r2"},
    ("POST", f"{API}/nodes/{{name}}/state"): {"state": "cordoned", "reason": "fuzz"},
    ("POST", f"{API}/nodes/{{name}}/certifications"): {"key": "tier", "value": "gold"},
    ("POST", f"{API}/workloads"): {
        "name": "fuzz-w2",
        "tenant": TENANT,
        "tags": {"hipaa": "true"},
        "isolation": "shared",
        "gpus": {"count": 1, "model": "H100-80GB", "nodes": 1},
        "priority": 0,
        "command": ["python", "train.py"],
    },
    ("POST", f"{API}/workloads/batch"): {
        "items": [{"name": "fuzz-w3", "tenant": TENANT, "gpus": {"mig_profile": "1g.10gb"}}]
    },
    ("POST", f"{API}/workloads/{{name}}/cancel"): {"reason": "fuzz"},
    ("POST", f"{API}/auth/login"): {"username": USER, "password": "wrong", "totp": "123456"},
    ("POST", f"{API}/auth/mfa/confirm"): {"totp": "123456"},
    ("POST", f"{API}/users"): {
        "username": "fuzz-u2",
        "password": PASSWORD,
        "roles": ["developer"],
        "tenants": [TENANT],
    },
    ("PATCH", f"{API}/users/{{username}}"): {"roles": ["developer"], "tenants": [TENANT]},
    ("POST", f"{API}/tokens"): {"name": "t", "expires_in": 3600},
    ("POST", f"{API}/tokens/{{token_id}}/rotate"): {"expires_in": 600},
    ("POST", f"{API}/nodes/{{name}}/agent-credentials"): {"ttl_days": 1},
    ("POST", f"{API}/nodes/{{name}}/telemetry"): {
        "simulated": False,
        "samples": [
            {
                "gpu_uuid": "GPU-fuzz-0",
                "gi_id": None,
                "ts": "2026-01-01T00:00:00Z",
                "values": {"DCGM_FI_DEV_GPU_TEMP": 40, "DCGM_FI_DEV_XID_ERRORS": 79},
            }
        ],
    },
    ("PUT", f"{API}/tenants/{{name}}/idle-policy"): {
        "action": "reclaim",
        "window_s": 1800,
        "threshold": 0.05,
        "preemptible_priority": 0,
    },
    ("POST", f"{API}/sinks"): {"name": "fuzz-s2", "type": "ocsf-file", "config": {"path": "x"}},
    ("POST", f"{API}/keys"): {"name": "fuzz-k1", "purpose": "encrypt"},
    ("POST", f"{API}/nodes/{{name}}/agent-certificate"): {
        "csr": "-----BEGIN CERTIFICATE REQUEST-----"
    },
    ("POST", f"{API}/nodes/{{name}}/sanitisation"): {
        "mig_instances_destroyed": True,
        "gpu_memory_cleared": True,
        "method": "nvidia-smi -r",
    },
    ("POST", f"{API}/changes"): {
        "type": "quota.set",
        "payload": {"tenant": TENANT, "gpus": 4, "mig_slices": None},
        "reason": "fuzz",
        "emergency": False,
    },
    ("PATCH", f"{API}/changes/{{change_id}}"): {
        "payload": {"tenant": TENANT, "gpus": 2, "mig_slices": None}
    },
    ("POST", f"{API}/changes/{{change_id}}/approve"): {"comment": "ok"},
    ("POST", f"{API}/changes/{{change_id}}/deny"): {"comment": "no"},
    ("POST", f"{API}/changes/{{change_id}}/review"): {"comment": "reviewed"},
    ("POST", f"{API}/changes/{{change_id}}/apply"): {"comment": "go"},
    ("POST", f"{API}/changes/{{change_id}}/cancel"): {"comment": "withdrawn"},
    ("PUT", f"{API}/changes/rules/{{change_type}}"): {"approvals": 2, "roles": ["admin"]},
    ("POST", f"{API}/incidents"): {"subject": TENANT, "reason": "fuzz", "severity": "low"},
    ("PATCH", f"{API}/incidents/{{incident_id}}"): {"severity": "high", "note": "n"},
    ("POST", f"{API}/incidents/{{incident_id}}/close"): {"postmortem": "done"},
    ("POST", f"{API}/k8s/admission"): ADMISSION,
    ("POST", f"{API}/nodes/{{name}}/attestation/enroll"): {"ek_public": "AAAA", "ak_public": "AA"},
    ("POST", f"{API}/nodes/{{name}}/attestation/activate"): {"secret": "AAAA"},
    ("POST", f"{API}/nodes/{{name}}/attestation/evidence"): {
        "nonce": "00" * 32,
        "evidence": {"quote": "AAAA", "signature": "AAAA", "pcrs": {"sha256": {"0": "00"}}},
    },
    ("PUT", f"{API}/attestation/policy"): {
        "policy": {"node_class": "fuzz", "pcrs": {"sha256": {"0": "00" * 32}}},
        "enforce": False,
    },
    # network segmentation (issue 14)
    ("PUT", f"{API}/nodes/{{name}}/network/underlay"): {
        "vtep": "10.250.9.1",
        "underlay_dev": "ul0",
        "hca_guids": ["0x0002c90300a1b2c3", "0002:c903:00a1:b2c4"],
    },
    ("POST", f"{API}/nodes/{{name}}/network/report"): {
        "applied_generation": 1,
        "applied_sha256": "0" * 64,
        "ruleset_sha256": "1" * 64,
        "self_check": {"ok": True, "segments": {"10000": True}, "errors": []},
    },
    ("PUT", f"{API}/tenants/{{name}}/network-policy"): {
        "policy": {
            "subnet": "10.10.0.0/24",
            "allow": [
                {"proto": "tcp", "ports": 29500, "source": "tenant"},
                {"proto": "tcp", "ports": "22", "source": "10.10.0.250/32"},
            ],
            "egress": [{"proto": "tcp", "ports": [443, 443], "destination": "192.0.2.0/24"}],
        }
    },  # fmt: skip
    # evidence packages (issue 16): a period before anything happened, so that each job the
    # fuzzer starts ends at once (empty_period) in the background
    ("POST", f"{API}/evidence/packages"): {
        "framework": "hipaa",
        "from": "2020-01-01T00:00:00Z",
        "to": "2020-02-01T00:00:00Z",
        "tenant": None,
    },
}


# --- the input classes -------------------------------------------------------------------------


def nest(depth: int, leaf: Any = 1, as_object: bool = False) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value} if as_object else [value]
    return value


EXTREME_TIMES = [
    "9999-12-31T23:59:59-14:00",
    "9999-12-31T23:59:59.999999-00:01",
    "0001-01-01T00:00:00+14:00",
    "0001-01-01T00:00:00",
    "9999-12-31T23:59:59",
    "10000-01-01T00:00:00Z",
    "2024-02-30T00:00:00Z",
    "1970-01-01T00:00:00Z",
    "-0001-01-01T00:00:00Z",
]
EXTREME_NUMBERS: list[Any] = [
    0,
    -1,
    2**31,
    -(2**31) - 1,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    2**64,
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e308,
    -1e308,
    5e-324,
    float("inf"),
    float("-inf"),
    float("nan"),
]
SURROGATES = ["\ud800", "a\udfffb", "\udc80\ud800", "x\ud83d"]
ODD_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ufeff",
    "\u202e",
    "\U0001f642" * 3,
    "x" * 5000,
    "../../etc/passwd",
    "%00",
    "null",
    "1e400",
    "NaN",
]
WRONG_TYPES: list[Any] = [None, True, 0, 1.5, "", [], {}, [None], {"": None}]

#: The input classes; a value is drawn from one class at a time, so that each is exercised.
VALUE_CLASSES: dict[str, st.SearchStrategy[Any]] = {
    "deep nesting": st.builds(
        nest,
        # near the bound, and far past it (deeper than ~900 levels json.dumps cannot write:
        # RAW_BODIES has those)
        st.integers(MAX_JSON_DEPTH - 10, MAX_JSON_DEPTH + 2) | st.integers(100, 800),
        st.sampled_from([1, "x", None, {}]),
        st.booleans(),
    ),
    "lone surrogates": st.sampled_from(SURROGATES)
    | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
    | st.builds(lambda a, b: a + b, st.text(max_size=3), st.sampled_from(SURROGATES)),
    "extreme numbers": st.sampled_from(EXTREME_NUMBERS)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True),
    "extreme dates": st.sampled_from(EXTREME_TIMES),
    "odd text": st.sampled_from(ODD_TEXT) | st.text(max_size=12),
    "wrong types": st.sampled_from(WRONG_TYPES)
    | st.recursive(
        st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=6,
    ),
}
fuzz_values = st.sampled_from(sorted(VALUE_CLASSES)).flatmap(lambda c: VALUE_CLASSES[c])
fuzz_keys = st.sampled_from(SURROGATES + ODD_TEXT[:10]) | st.text(max_size=10)


def json_paths(value: Any) -> Iterator[tuple[Any, ...]]:
    """Every path into ``value``, in pre-order; iterative: an earlier mutation may have put a
    value hundreds of levels deep into the document (the "deep nesting" class)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        prefix, inner = stack.pop()
        yield prefix
        if isinstance(inner, dict):
            children = [((*prefix, k), v) for k, v in inner.items()]
        elif isinstance(inner, list):
            children = [((*prefix, i), v) for i, v in enumerate(inner)]
        else:
            continue
        stack.extend(reversed(children))


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of ``doc`` with the value at ``path`` replaced (the root, for ``()``): only the
    containers on the path are copied, the rest shared; a deep copy of a document holding a
    deeply nested value ran out of recursion (a flaky failure of the fuzzer itself)."""
    if not path:
        return value
    root = copy.copy(doc)
    parent, original = root, doc
    for step in path[:-1]:
        original = original[step]
        parent[step] = copy.copy(original)
        parent = parent[step]
    parent[path[-1]] = value
    return root


MAX_PATH = 16  # deeper than any example body


@st.composite
def mutated(draw: st.DrawFn, example: Any) -> Any:
    """The example with 1-3 mutations: a value anywhere (the root included) replaced by one of
    an input class, or an odd key added to an object."""
    doc = example
    for _ in range(draw(st.integers(1, 3))):
        # not inside a deeply nested value an earlier mutation put there: two of them, one in
        # the other, would be deeper than a JSON encoder writes
        path = draw(st.sampled_from([p for p in json_paths(doc) if len(p) <= MAX_PATH]))
        value = draw(fuzz_values)
        target = doc
        for step in path:
            target = target[step]
        if isinstance(target, dict) and draw(st.booleans()):
            value = {**target, draw(fuzz_keys): value}
        doc = replaced(doc, path, value)
    return doc


RAW_BODIES = [
    b"",
    b"{",
    b"\xff\xfe\x00",
    b"null",
    b"[]",
    b'"\\ud800"',
    b'{"a": "\xed\xa0\x80"}',  # a surrogate as (CESU-8) bytes
    b"1" * 5000,  # past Python's int-parsing limit
    b"[" * 400 + b"]" * 400,  # parses; recursive validators do not survive it
    b'{"a": ' + b"[" * 900 + b"]" * 900 + b"}",
    b"[" * 100_000,
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 2000 + b"1" + b"}" * 2000,
    b"NaN",
    b"-Infinity",
    b"1e999999",
]
CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json; charset=utf-8",
    "application/merge-patch+json",
    "text/plain",
    None,
]


def cursor(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursors(kind: str) -> list[str]:
    """Forged cursors of a list route's own kind (and garbage)."""
    afters = [json.dumps(s).encode() for s in SURROGATES]  # "\\ud800": escaped, as JSON
    afters += [b'"\xed\xa0\x80"', b"18446744073709551616", b"-1", b"1e400", b"[]", b"null"]
    afters += [b'"' + b"x" * 300 + b'"', b'"a\\u0000b"']
    return [
        "!!!",
        "A" * 20_000,
        cursor(b"null"),
        cursor(b"\xff\xfe"),
        cursor(b"[" * 5000 + b"]" * 5000),
        *(cursor(b'{"k":"' + kind.encode() + b'","after":' + after + b"}") for after in afters),
    ]


def query_values(kind: str) -> list[str]:
    numbers = [str(n) for n in EXTREME_NUMBERS] + ["9" * 50, "-" + "9" * 20, "1_000", "0x10"]
    return [*EXTREME_TIMES, *numbers, *SURROGATES, *ODD_TEXT, *cursors(kind)]


PATH_VALUES = [
    " ",
    "x" * 300,
    "%00",
    "a%00b",
    "%ED%A0%80",
    "%FF%FE",
    "%F0%9F%99%82",
    "..",
    "%2E%2E",
    "%2F",
    "9" * 40,
    "18446744073709551616",
    "-1",
    "0",
    "null",
    "%C3%BC",
]


def _quote(value: str) -> str:
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


# --- the prepared database ---------------------------------------------------------------------


@dataclass
class World:
    client: TestClient
    names: dict[str, str] = field(default_factory=dict)


def _pg_admin() -> psycopg.Connection:
    url = os.environ.get("PROOFPLANE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    return psycopg.connect(url, autocommit=True, connect_timeout=5)


def _pg_url(name: str) -> str:
    url = os.environ.get("PROOFPLANE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    return f"{url.rsplit('/', 1)[0]}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)


def _no_network(*_args: Any, **_kwargs: Any) -> Any:
    raise socket.gaierror(socket.EAI_NONAME, "the route fuzzer has no network")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """The demo cluster, a placed workload, a sink, a user and a spare token, served by one
    app per module and store kind; the network closed."""
    pg_name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('route-fuzz') / 'fuzz.db'}"
    else:
        template = request.getfixturevalue("pg_template")
        pg_name = f"pp_fuzz_{uuid.uuid4().hex[:12]}"
        with _pg_admin() as conn:
            conn.execute(f'CREATE DATABASE "{pg_name}" TEMPLATE "{template}"')
        url = _pg_url(pg_name)
    store = Store(url)
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN_TOKEN)
    demo = (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text()
    load_cluster(store, SYSTEM, parse_cluster(demo))
    with (
        pytest.MonkeyPatch.context() as patch,
        TestClient(create_app(store), raise_server_exceptions=False) as client,
    ):
        patch.setattr(socket, "getaddrinfo", _no_network)
        patch.setattr(socket, "create_connection", _no_network)
        world = World(client)
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        def ok(response: Any, *statuses: int) -> Any:
            assert response.status_code in statuses, response.text
            return response.json() if response.content else None

        sink_dir = os.environ.get("PROOFPLANE_SINK_DIR") or tmp_path_factory.mktemp("sinks")
        sink_path = os.path.join(sink_dir, "fuzz.ocsf")
        sink = {"name": SINK, "type": "ocsf-file", "config": {"path": sink_path}}
        ok(client.post(f"{API}/sinks", json=sink, headers=admin), 201)
        body = {"name": WORKLOAD, "tenant": TENANT, "gpus": {"count": 1}}
        ok(client.post(f"{API}/workloads", json=body, headers=admin), 201)
        user = {"username": USER, "password": PASSWORD, "roles": ["developer"], "tenants": [TENANT]}
        ok(client.post(f"{API}/users", json=user, headers=admin), 201)
        spare = ok(client.post(f"{API}/tokens", json={"expires_in": 3600}, headers=admin), 201)
        ok(client.post(f"{API}/nodes/{NODE}/certifications", json={"key": CERT, "value": "gold"},
                       headers=admin), 200)  # fmt: skip
        world.names = {
            "tenants": TENANT,
            "nodes": NODE,
            "workloads": WORKLOAD,
            "sinks": SINK,
            "users": USER,
            "tokens": spare["id"],
            "key": CERT,
            "events": "1",
        }
        yield world
    store.dispose()
    if pg_name is not None:
        with _pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)')


# --- the requests ------------------------------------------------------------------------------


@dataclass
class Sent:
    method: str
    url: str
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # what a failure shows
        body = None if self.content is None else self.content[:300]
        return f"{self.method} {self.url[:300]} headers={self.headers} body={body!r}"


def _kind(template: str) -> str:
    """The cursor kind of a list route (its collection's name)."""
    return template.removeprefix(API + "/").split("/")[0]


def _path(key: tuple[str, str], names: dict[str, str], given: dict[str, str]) -> str:
    _method, template = key
    path = template
    for param in ROUTES[key].dependant.path_params:
        collection = template.split("/{" + param.name)[0].rsplit("/", 1)[-1]
        value = given.get(param.name, names.get(param.name, names.get(collection, "x")))
        path = path.replace("{" + param.name + "}", value if "%" in value else _quote(value))
    return path


def _body(document: Any) -> bytes:
    return json.dumps(document, allow_nan=True).encode()  # \ud800 stays escaped: valid JSON


JSON = {"content-type": "application/json"}


def single_attacks(key: tuple[str, str], names: dict[str, str]) -> Iterator[Sent]:
    """The valid request, then one attack at a time: every path parameter, every query
    parameter, and every value at every level of the body, each replaced by every value of
    a short list per input class."""
    method, template = key
    route = ROUTES[key]
    example = EXAMPLES.get(key)
    body = None if example is None else _body(example)
    headers = JSON if example is not None else {}
    base = _path(key, names, {})
    yield Sent(method, base, body, headers)
    for param in route.dependant.path_params:
        for value in PATH_VALUES:
            yield Sent(method, _path(key, names, {param.name: value}), body, headers)
    for param in route.dependant.query_params:
        for value in query_values(_kind(template)):
            yield Sent(method, f"{base}?{_quote(param.alias)}={_quote(value)}", body, headers)
    if example is None:
        return
    values = [
        *WRONG_TYPES,
        2**64,
        -(2**63) - 1,
        float("nan"),
        "\ud800",
        "a\x00",
        "9999-12-31T23:59:59-14:00",
        nest(MAX_JSON_DEPTH - 8),  # within the bound: on to validation
        nest(400, as_object=True),
    ]
    for path in json_paths(example):
        for value in values:
            yield Sent(method, base, _body(replaced(example, path, value)), headers)
    for raw in RAW_BODIES:
        yield Sent(method, base, raw, headers)


@st.composite
def requests_for(draw: st.DrawFn, key: tuple[str, str], names: dict[str, str]) -> Sent:
    """A request with attacks in several places at once."""
    method, template = key
    route = ROUTES[key]
    given = {
        p.name: draw(st.sampled_from(PATH_VALUES))
        for p in route.dependant.path_params
        if draw(st.booleans())
    }
    url = _path(key, names, given)
    query = [
        f"{_quote(p.alias)}={_quote(draw(st.sampled_from(query_values(_kind(template)))))}"
        for p in route.dependant.query_params
        if draw(st.booleans())
    ]
    url += "?" + "&".join(query) if query else ""
    if route.body_field is None:
        return Sent(method, url)
    if draw(st.integers(0, 5)) == 0:
        content = draw(st.sampled_from(RAW_BODIES))
    else:
        content = _body(draw(mutated(EXAMPLES[key])))
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    return Sent(method, url, content, {"content-type": content_type} if content_type else {})


def _answer_problem(response: Any) -> str | None:
    """What is wrong with an answer (a 5xx, or an error not in the usual shape), or None."""
    if response.status_code >= 500:
        return f"{response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
            assert isinstance(error["code"], str) and error["message"]
            assert set(error) == {"code", "message", "details"}
        except Exception:
            return f"{response.status_code}, not the usual error shape: {response.text[:300]}"
    return None


def _is_public(route: APIRoute) -> bool:
    def rules(dependant: Any) -> Iterator[Any]:
        for dep in dependant.dependencies:
            yield access_rule(dep.call)
            yield from rules(dep)

    return "public" in set(rules(route.dependant))


CASES = [
    pytest.param(key, identity, id=f"{key[0]} {key[1]} as {identity}")
    for key in sorted(ROUTES)
    for identity in IDENTITIES
]
# Without credentials a route that is not public stops at authentication: one sweep is enough.
SWEEPS = [
    pytest.param(key, identity, id=f"{key[0]} {key[1]} as {identity}")
    for key in sorted(ROUTES)
    for identity in IDENTITIES
    if identity == "admin" or _is_public(ROUTES[key])
]


def _auth(identity: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"} if identity == "admin" else {}


# --- the properties ----------------------------------------------------------------------------


def test_every_route_that_takes_a_body_has_an_example() -> None:
    takes_body = {key for key, route in ROUTES.items() if route.body_field is not None}
    assert takes_body - set(EXAMPLES) == set()
    assert set(EXAMPLES) - takes_body == set()


@pytest.mark.parametrize(("key", "identity"), SWEEPS)
def test_no_single_attack_gets_a_5xx(world: World, key: tuple[str, str], identity: str) -> None:
    problems = []
    for sent in single_attacks(key, world.names):
        response = world.client.request(
            sent.method, sent.url, content=sent.content, headers={**_auth(identity), **sent.headers}
        )
        problem = _answer_problem(response)
        if problem is not None:
            problems.append(f"{sent!r} -> {problem}")
    assert problems == [], "\n".join(problems[:10])


@pytest.mark.parametrize(("key", "identity"), CASES)
def test_no_combination_of_attacks_gets_a_5xx(
    world: World, key: tuple[str, str], identity: str
) -> None:
    @given(sent=requests_for(key, world.names))
    @settings(
        max_examples=10 if ROUTES[key].body_field is not None else 5,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(sent: Sent) -> None:
        headers = {**_auth(identity), **sent.headers}
        response = world.client.request(
            sent.method, sent.url, content=sent.content, headers=headers
        )
        problem = _answer_problem(response)
        assert problem is None, f"{sent!r} -> {problem}"

    check()
