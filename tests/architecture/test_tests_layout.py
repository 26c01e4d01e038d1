"""Rules for the test tree itself."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imports_conftest(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "conftest":
            return True
        if isinstance(node, ast.Import) and any(a.name == "conftest" for a in node.names):
            return True
    return False


def test_no_test_module_imports_conftest() -> None:
    """Several folders have a conftest.py, so ``conftest`` names whichever loaded first:
    an import of it passes alone and fails in a full run. Shared helpers live in named
    modules (dbtest, ci, live_server, …)."""
    offenders = sorted(
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if "node_modules" not in path.parts
        and _imports_conftest(ast.parse(path.read_text("utf-8")))
    )
    assert offenders == []


def _imports_a_test_module(tree: ast.AST) -> bool:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    # another folder's test module (``api.test_oidc``); a sibling in the same folder
    # (``from test_cli import …``) shares that folder's fixtures on purpose
    return any(
        "." in name and any(part.startswith("test_") for part in name.split(".")) for name in names
    )


def test_no_test_module_imports_another_folders_test_module() -> None:
    """A test module imported by another runs its fixtures twice (a second OIDC provider, a
    second server) and ties two folders together; shared helpers live in named modules at
    the top of tests/ (siem_checks, live_server, swtpm, …)."""
    offenders = sorted(
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if "node_modules" not in path.parts
        and _imports_a_test_module(ast.parse(path.read_text("utf-8")))
    )
    assert offenders == []


def test_the_rule_sees_both_import_forms() -> None:
    assert _imports_a_test_module(ast.parse("from api.test_oidc import sso"))
    assert _imports_a_test_module(ast.parse("import cli.test_x"))
    assert not _imports_a_test_module(ast.parse("from test_cli import ok"))
    assert not _imports_a_test_module(ast.parse("from siem_checks import events_of"))
    assert _imports_conftest(ast.parse("from conftest import x"))
    assert _imports_conftest(ast.parse("def f():\n    import conftest\n"))
    assert not _imports_conftest(ast.parse("from dbtest import demo_text"))
