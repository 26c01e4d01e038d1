"""The import contract (scripts/import_contract.py): the real tree keeps it, and a tree that
breaks each rule is caught, rule by rule — so the check can fail."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ci import REPO

SCRIPT = REPO / "scripts" / "import_contract.py"

_spec = importlib.util.spec_from_file_location("import_contract", SCRIPT)
assert _spec is not None and _spec.loader is not None
contract = importlib.util.module_from_spec(_spec)
sys.modules["import_contract"] = contract
_spec.loader.exec_module(contract)


def tree(root: Path, files: dict[str, str]) -> Path:
    """A miniature proofplane source tree under ``root/src``; every package gets __init__."""
    src = root / "src"
    for rel, body in {"proofplane/__init__.py": "", **files}.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(src).parents:
            if str(parent) != ".":
                (src / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(body))
    return src


def rules(src: Path) -> list[tuple[str, str, str]]:
    return [
        (v.rule, Path(v.path).relative_to(src).as_posix(), v.message) for v in contract.check(src)
    ]


CLEAN = {
    "proofplane/errors.py": "class ProofplaneError(Exception): ...\n",
    "proofplane/model/node.py": "from proofplane.errors import ProofplaneError\n",
    "proofplane/schedule/engine.py": """
        from datetime import datetime
        from proofplane.model import node
        def place(now: datetime) -> datetime:
            return now
    """,
    "proofplane/store/db.py": "import sqlalchemy\nfrom proofplane.model import node\n",
    "proofplane/service/workloads.py": """
        import os
        from datetime import UTC, datetime
        from proofplane.schedule import engine
        from proofplane.store import db
        HOME = os.environ.get("HOME")
        def submit() -> None:
            engine.place(datetime.now(UTC))
    """,
    "proofplane/api/routes.py": "from proofplane.service import workloads\n",
    "proofplane/cli/main.py": "from proofplane.api import routes\nimport subprocess\n",
}


def test_the_real_tree_keeps_the_contract() -> None:
    violations = contract.check(REPO / "src")
    assert not violations, "\n".join(map(str, violations))


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    assert rules(tree(tmp_path, CLEAN)) == []


@pytest.mark.parametrize(
    ("rel", "body", "rule", "needle"),
    [
        ("proofplane/schedule/bad.py", "import subprocess\n", "pure", "imports I/O: subprocess"),
        ("proofplane/schedule/bad.py", "import sqlalchemy.orm\n", "pure", "I/O: sqlalchemy"),
        ("proofplane/model/bad.py", "from socket import socket\n", "pure", "I/O: socket"),
        ("proofplane/model/bad.py", "from http import client\n", "pure", "I/O: http.client"),
        ("proofplane/attest/bad.py", "import os\nX = os.environ['X']\n", "pure", "environment"),
        ("proofplane/attest/bad.py", "import os\nX = os.getenv('X')\n", "pure", "environment"),
        (
            "proofplane/audit/merkle.py",
            "from datetime import datetime\nT = datetime.now()\n",
            "pure",
            "reads the clock",
        ),
        (
            "proofplane/audit/merkle.py",
            "import datetime\nT = datetime.datetime.now()\n",
            "pure",
            "reads the clock (datetime.now()",
        ),
        (
            "proofplane/schedule/bad.py",
            "from datetime import datetime\nT = datetime.today()\n",
            "pure",
            "reads the clock (datetime.today()",
        ),
        (
            "proofplane/schedule/bad.py",
            "import time\nT = time.monotonic()\n",
            "pure",
            "reads the clock (time.monotonic()",
        ),
        (
            "proofplane/schedule/bad.py",
            "from proofplane.store import db\n",
            "pure",
            "imports proofplane.store.db, which is not pure",
        ),
        (
            "proofplane/schedule/bad.py",
            "def f():\n    from proofplane.service import workloads\n",
            "pure",
            "not pure",
        ),
        (
            "proofplane/store/bad.py",
            "from proofplane.service import workloads\n",
            "layer",
            "store (layer 2) imports service (layer 3)",
        ),
        (
            "proofplane/service/bad.py",
            "from ..api import routes\n",
            "layer",
            "service (layer 3) imports api (layer 5)",
        ),
        ("proofplane/gadgets/thing.py", "X = 1\n", "unknown", "'gadgets' is not in the layer"),
        (
            "proofplane/service/bad.py",
            "from proofplane.store.db import _engine\n",
            "private",
            "private name _engine from proofplane.store.db",
        ),
        (
            "proofplane/service/bad.py",
            "from proofplane.store import db\nX = db._engine\n",
            "private",
            "private name _engine of proofplane.store.db",
        ),
        (
            "proofplane/service/bad.py",
            "import proofplane.store.db as d\nX = d._engine\n",
            "private",
            "private name _engine of proofplane.store.db",
        ),
    ],
)
def test_each_rule_catches_its_breach(
    tmp_path: Path, rel: str, body: str, rule: str, needle: str
) -> None:
    found = rules(tree(tmp_path, {**CLEAN, rel: body}))
    assert any(r == rule and needle in msg for r, _, msg in found), found


def test_a_cycle_between_packages_is_named(tmp_path: Path) -> None:
    src = tree(
        tmp_path,
        {
            **CLEAN,
            "proofplane/siem/sink.py": "from proofplane.store import db\n",
            "proofplane/store/db.py": "import sqlalchemy\nfrom proofplane.siem import sink\n",
        },
    )
    cycles = [msg for r, _, msg in rules(src) if r == "cycle"]
    assert cycles == ["packages import each other: siem -> store -> siem"]


def test_a_pure_module_makes_its_package_init_pure(tmp_path: Path) -> None:
    # importing proofplane.audit.merkle runs proofplane/audit/__init__.py
    src = tree(
        tmp_path,
        {
            **CLEAN,
            "proofplane/audit/merkle.py": "X = 1\n",
            "proofplane/audit/__init__.py": "import sqlite3\n",
        },
    )
    found = rules(src)
    assert (
        "pure",
        "proofplane/audit/__init__.py",
        "pure proofplane.audit imports I/O: sqlite3",
    ) in (found)


def test_private_names_inside_one_module_are_fine(tmp_path: Path) -> None:
    src = tree(
        tmp_path,
        {
            **CLEAN,
            "proofplane/service/ok.py": "def _helper():\n    return 1\nX = _helper()\n",
            "proofplane/service/dunder.py": "from proofplane.store import db\nX = db.__name__\n",
        },
    )
    assert rules(src) == []


def test_the_command_exits_non_zero_on_a_breach(tmp_path: Path) -> None:
    src = tree(tmp_path, {**CLEAN, "proofplane/model/bad.py": "import httpx\n"})
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(src)], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "[pure] pure proofplane.model.bad imports I/O: httpx" in bad.stdout
    good = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tree(tmp_path / "ok", CLEAN))],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stdout
    assert "import contract: kept" in good.stdout


def test_pure_paths_lists_the_pure_core_and_its_package_inits(tmp_path: Path) -> None:
    src = tree(tmp_path, CLEAN)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(src), "--pure-paths"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    listed = {Path(p).relative_to(src).as_posix() for p in out}
    assert "proofplane/schedule/engine.py" in listed and "proofplane/__init__.py" in listed
    assert "proofplane/schedule/__init__.py" in listed
    assert not any(p.startswith(("proofplane/store", "proofplane/service")) for p in listed)
