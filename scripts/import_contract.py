#!/usr/bin/env python3
"""The import contract: the shape of the house, checked (ARCHITECTURE.md, rules 2 and 10).

Reads every module under ``src/proofplane`` as source (nothing is imported or executed) and
fails when:

* ``pure``: a module of the pure core imports I/O (a database driver, sockets, TLS, HTTP,
  processes, threads), a proofplane module that is not itself pure (so purity is transitive),
  or reads the environment (``os.environ``, ``os.getenv``) or the wall clock
  (``datetime.now()``, ``time.time()``: rule 2 — the caller passes ``now``);
* ``layer``: a package imports a package of a higher layer (``cli → api → workers/demo →
  service → store/siem/agent/backends → schedule/audit/attest/access/hardware → model``);
* ``cycle``: the packages import each other in a circle;
* ``unknown``: a new top-level package is not in the layer table (decide where it sits);
* ``private``: a module reaches a ``_private`` name of another module
  (``from x import _y`` or ``x._y``): make what is shared public, or move it.

Imports under ``if TYPE_CHECKING:`` count as well: a type is an arrow of the design too.

    python scripts/import_contract.py [--root src] [--graph | --pure-paths]

Exit status 0 when the tree keeps the contract, 1 with one line per violation otherwise.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "proofplane"

# Top-level packages and modules by layer: a module may import its own package and any
# package of a LOWER layer, never a higher one. Same-layer arrows between packages are allowed
# only while the package graph stays free of cycles.
LAYERS: dict[str, int] = {
    # 0: values every layer shares
    "": 0,  # the package root (proofplane/__init__.py: the error tree and the version)
    "errors": 0,
    "model": 0,
    "machine": 0,
    "config": 0,
    # 1: the pure core and its close neighbours
    "hardware": 1,
    "schedule": 1,
    "audit": 1,
    "attest": 1,
    "access": 1,
    "govern": 1,
    "network": 1,
    "meter": 1,
    "keys": 1,
    # 2: storage and the other I/O adapters the services drive
    "store": 2,
    "siem": 2,
    "agent": 2,
    "backends": 2,
    "pki": 2,
    "kms": 2,
    # 3: use cases (one transaction each) and the trace replays
    "service": 3,
    "sim": 3,
    # 4: background loops and the demo cluster
    "workers": 4,
    "demo": 4,
    # 5, 6: the edges
    "api": 5,
    "web": 5,
    "cli": 6,
}

# The pure core: these modules (and everything under a package named here) take values and
# return values. Their package __init__ modules up to the root must be pure too, as importing
# a module runs them.
PURE: tuple[str, ...] = (
    "errors",
    "model",
    "schedule",
    "hardware.skus",
    "audit.merkle",
    "audit.canonical",
    "audit.note",
    "audit.bundle",
    "audit.export.cef",
    "audit.export.syslog",
    "audit.export.ocsf",
    "audit.export.ocsf_schema",
    "audit.export.hec",
    "audit.export.config",
    "audit.export.times",
    "attest",
    "keys",
    "govern.changes",
    "govern.runbooks",
    "network.desired",
    "network.segments",
    "network.policy",
    "network.render.iproute2",
    "network.render.nftables",
    "network.render.partitions",
    "meter",
)

# What a pure module may not import (the module or anything below it).
IO_MODULES: tuple[str, ...] = (
    "sqlalchemy",
    "alembic",
    "psycopg",
    "sqlite3",
    "subprocess",
    "socket",
    "ssl",
    "select",
    "selectors",
    "httpx",
    "requests",
    "urllib.request",
    "http.client",
    "http.server",
    "asyncio",
    "threading",
    "multiprocessing",
    "concurrent",
    "fastapi",
    "starlette",
    "uvicorn",
    "typer",
    "rich",
    "pynvml",
    "kubernetes",
)

# Calls that read the wall clock or the environment.
CLOCK_CALLS = {
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("datetime", "today"),
    ("date", "today"),
    ("time", "time"),
    ("time", "time_ns"),
    ("time", "monotonic"),
    ("time", "monotonic_ns"),
    ("time", "perf_counter"),
    ("time", "perf_counter_ns"),
}
ENV_ATTRS = {("os", "environ"), ("os", "getenv"), ("os", "environb"), ("os", "putenv")}


@dataclass(frozen=True)
class Violation:
    rule: str
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        path = Path(self.path)
        with_cwd = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        return f"{with_cwd}:{self.line}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class Import:
    target: str  # absolute dotted name of the module (or module.attribute) imported
    names: tuple[str, ...]  # for ``from x import a, b``: the names; () for ``import x``
    line: int


@dataclass
class Module:
    name: str  # proofplane.audit.merkle
    path: Path
    is_package: bool
    tree: ast.Module
    imports: list[Import]


def _rel(name: str) -> str:
    """``proofplane.audit.merkle`` -> ``audit.merkle``; the root package -> ``""``."""
    return name[len(ROOT_PACKAGE) + 1 :] if name != ROOT_PACKAGE else ""


def top_package(name: str) -> str:
    return _rel(name).split(".", 1)[0]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def load(src: Path) -> dict[str, Module]:
    """Every module under ``src/proofplane``, parsed, with its imports made absolute."""
    modules: dict[str, Module] = {}
    base = src / ROOT_PACKAGE
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules[name] = Module(name, path, is_package, tree, [])
    for mod in modules.values():
        mod.imports = list(_imports(mod))
    return modules


def _imports(mod: Module) -> Iterator[Import]:
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            yield Import(_absolute(node, mod), tuple(a.name for a in node.names), node.lineno)


def _absolute(node: ast.ImportFrom, mod: Module) -> str:
    """The absolute module a ``from … import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _resolve(target: str, names: tuple[str, ...], modules: dict[str, Module]) -> list[str]:
    """The proofplane modules an import loads: ``from pkg import mod`` names ``pkg.mod``."""
    out = []
    if target in modules:
        out.append(target)
    for n in names:
        if f"{target}.{n}" in modules:
            out.append(f"{target}.{n}")
    return out


def is_pure(name: str) -> bool:
    rel = _rel(name)
    return any(_under(rel, p) for p in PURE if p) or name == ROOT_PACKAGE


def _pure_set(modules: dict[str, Module]) -> set[str]:
    pure = {m for m in modules if is_pure(m)}
    # importing a pure module runs its parents' __init__: they must be pure as well
    for m in list(pure):
        parts = m.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules:
                pure.add(parent)
    return pure


def _dotted(node: ast.AST) -> tuple[str, str] | None:
    """``a.b`` (an attribute of a plain name) as ("a", "b")."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def _last_two(node: ast.AST) -> tuple[str, str] | None:
    """The last two names of ``….a.b`` as ("a", "b"): ``datetime.datetime.now`` is
    ("datetime", "now") as ``datetime.now`` is."""
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name):
            return node.value.id, node.attr
        if isinstance(node.value, ast.Attribute):
            return node.value.attr, node.attr
    return None


def check_pure(modules: dict[str, Module]) -> Iterator[Violation]:
    pure = _pure_set(modules)
    for name in sorted(pure):
        mod = modules[name]
        path = str(mod.path)
        for imp in mod.imports:
            loaded = [imp.target, *(f"{imp.target}.{n}" for n in imp.names)]
            for io in IO_MODULES:
                if any(_under(m, io) for m in loaded):
                    yield Violation("pure", path, imp.line, f"pure {name} imports I/O: {io}")
            if not _under(imp.target, ROOT_PACKAGE):
                continue
            for dep in _resolve(imp.target, imp.names, modules):
                if dep not in pure:
                    yield Violation(
                        "pure", path, imp.line, f"pure {name} imports {dep}, which is not pure"
                    )
        for node in ast.walk(mod.tree):
            pair = _dotted(node)
            if isinstance(node, ast.Attribute) and pair in ENV_ATTRS:
                yield Violation("pure", path, node.lineno, f"pure {name} reads the environment")
            if isinstance(node, ast.Call):
                call = _last_two(node.func)
                if call in CLOCK_CALLS:
                    yield Violation(
                        "pure",
                        path,
                        node.lineno,
                        f"pure {name} reads the clock ({'.'.join(call)}()): take `now`",
                    )


def package_graph(modules: dict[str, Module]) -> dict[str, dict[str, tuple[str, int]]]:
    """Top-level package -> imported top-level package -> (an example module, line)."""
    graph: dict[str, dict[str, tuple[str, int]]] = defaultdict(dict)
    for mod in modules.values():
        src = top_package(mod.name)
        for imp in mod.imports:
            if not _under(imp.target, ROOT_PACKAGE):
                continue
            for dep in _resolve(imp.target, imp.names, modules) or [imp.target]:
                dst = top_package(dep)
                if dst != src:
                    graph[src].setdefault(dst, (str(mod.path), imp.line))
    return graph


def check_layers(modules: dict[str, Module]) -> Iterator[Violation]:
    known = set(LAYERS)
    for mod in modules.values():
        top = top_package(mod.name)
        if top not in known:
            yield Violation(
                "unknown",
                str(mod.path),
                1,
                f"package '{top}' is not in the layer table (scripts/import_contract.py LAYERS)",
            )
            known.add(top)
    graph = package_graph(modules)
    for src, deps in sorted(graph.items()):
        for dst, (path, line) in sorted(deps.items()):
            if dst == src or src not in LAYERS or dst not in LAYERS:
                continue
            if LAYERS[dst] > LAYERS[src]:
                yield Violation(
                    "layer",
                    path,
                    line,
                    f"{src or ROOT_PACKAGE} (layer {LAYERS[src]}) imports "
                    f"{dst or ROOT_PACKAGE} (layer {LAYERS[dst]}): imports run downward only",
                )
    for cycle in find_cycles({s: set(d) - {s} for s, d in graph.items()}):
        path, line = graph[cycle[0]][cycle[1]]
        loop = " -> ".join(c or ROOT_PACKAGE for c in [*cycle, cycle[0]])
        yield Violation("cycle", path, line, f"packages import each other: {loop}")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected component with more than one node
    (Tarjan), each as a path through the graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        members = set(comp)
        start = min(comp)
        path, seen, cur = [start], {start}, start
        while True:  # walk inside the component until a node repeats
            nxt = min(w for w in graph[cur] if w in members)
            if nxt in seen:
                cycles.append(path[path.index(nxt) :])
                break
            path.append(nxt)
            seen.add(nxt)
            cur = nxt
    return cycles


def check_private(modules: dict[str, Module]) -> Iterator[Violation]:
    for mod in modules.values():
        path = str(mod.path)
        bound: dict[str, str] = {}  # local name -> proofplane module it is bound to
        for imp in mod.imports:
            if not _under(imp.target, ROOT_PACKAGE):
                continue
            for n in imp.names:
                if _private(n) and imp.target != mod.name:
                    yield Violation(
                        "private", path, imp.line, f"imports private name {n} from {imp.target}"
                    )
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _under(a.name, ROOT_PACKAGE) and a.asname:
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(node, mod)
                for a in node.names:
                    if f"{target}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{target}.{a.name}"
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = bound.get(node.value.id)
                if owner and owner != mod.name and _private(node.attr):
                    yield Violation(
                        "private",
                        path,
                        node.lineno,
                        f"reaches private name {node.attr} of {owner}",
                    )


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def check(src: Path) -> list[Violation]:
    modules = load(src)
    out = [*check_pure(modules), *check_layers(modules), *check_private(modules)]
    return sorted(set(out), key=lambda v: (v.rule, v.path, v.line, v.message))


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=here / "src", help="the folder above proofplane/")
    ap.add_argument("--graph", action="store_true", help="print the package graph and exit 0")
    ap.add_argument(
        "--pure-paths", action="store_true", help="print the pure core's files (for mypy --strict)"
    )
    args = ap.parse_args(argv)
    if args.pure_paths:
        modules = load(args.root)
        print("\n".join(sorted(str(modules[m].path) for m in _pure_set(modules))))
        return 0
    if args.graph:
        for src, deps in sorted(package_graph(load(args.root)).items()):
            print(f"{src or ROOT_PACKAGE} -> {', '.join(sorted(d or ROOT_PACKAGE for d in deps))}")
        return 0
    violations = check(args.root)
    for v in violations:
        print(v)
    if violations:
        print(f"import contract: {len(violations)} violation(s)")
        return 1
    print("import contract: kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
