"""The CLI's access commands (login, logout, whoami, mfa, users, tokens, agent credentials)
against a real API server: uvicorn in a background thread, on a SQLite database with the demo
cluster loaded and a bootstrap admin token.

Every test gets its own config directory (so its own credentials file, never the real home) and
no PROOFPLANE_* variables from the environment it runs in. Passwords are given on stdin or to
hidden prompts, and no test output may contain them.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from live_server import free_port, serve
from proofplane.access import SYSTEM, totp
from proofplane.cli import credentials as cli_credentials
from proofplane.cli.main import app
from proofplane.cli.tokens import parse_duration
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

runner = CliRunner()
ADMIN_TOKEN = "ppt_cli-auth-admin-token-0123456789abcdef"
PASSWORD = "correct horse battery staple"
LOGIN_HINT = "run 'proofplane login'"
PROOFPLANE_ENV = (
    "PROOFPLANE_TOKEN",
    "PROOFPLANE_SERVER",
    "PROOFPLANE_ADMIN_TOKEN",
    "PROOFPLANE_DATABASE_URL",
)


@pytest.fixture(autouse=True)
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI's config directory for this test (never the real home), and a clean env."""
    for var in PROOFPLANE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    where = tmp_path / "xdg-config" / "proofplane"
    monkeypatch.setattr(cli_credentials, "config_dir", lambda: where)
    return where


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a real proofplane server: demo cluster, bootstrap admin token."""
    db = tmp_path_factory.mktemp("cli-auth") / "auth.db"
    store = Store(f"sqlite:///{db}")
    migrate.upgrade(store.engine)
    text = (resources.files("proofplane") / "data" / "demo-cluster.yaml").read_text()
    load_cluster(store, SYSTEM, parse_cluster(text))
    assert bootstrap_admin(store, ADMIN_TOKEN)
    with serve(store) as url:
        yield url


# --- helpers -----------------------------------------------------------------------------------


def run(server: str, *args: str, token: str | None = None, input: str | None = None) -> Any:
    """The CLI against ``server``; with ``token``, as its holder, else with stored credentials."""
    pre = ["--server", server] + (["--token", token] if token else [])
    return runner.invoke(app, [*pre, *args], input=input)


def admin(server: str, *args: str, input: str | None = None) -> Any:
    return run(server, *args, token=ADMIN_TOKEN, input=input)


def ok(result: Any) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def as_json(result: Any) -> Any:
    return json.loads(ok(result).stdout)


def no_traceback(result: Any) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def flat(text: str) -> str:
    for ch in "│╭╮╰╯─":
        text = text.replace(ch, " ")
    return " ".join(text.split())


def no_secret(result: Any, *secrets: str) -> Any:
    """Neither stdout nor stderr contains any of ``secrets``."""
    for s in secrets:
        assert s not in result.stdout and s not in result.stderr, f"secret {s!r} printed"
    return result


def create_user(server: str, name: str, *flags: str, password: str = PASSWORD) -> dict[str, Any]:
    result = admin(
        server, "users", "create", name, *flags, "--password-stdin", "--json", input=password + "\n"
    )
    no_secret(result, password)
    return as_json(result)


def login(server: str, name: str, *, password: str = PASSWORD, extra: str = "") -> Any:
    result = run(
        server, "login", "--username", name, "--password-stdin", input=f"{password}\n{extra}"
    )
    no_secret(result, password)
    return result


def stored(server: str) -> dict[str, Any] | None:
    return cli_credentials.lookup(server)


def now_code(secret: str, ahead: int = 0) -> str:
    return totp.code_at_step(secret, totp.step_at(time.time()) + ahead)


# --- login, whoami, logout ---------------------------------------------------------------------


def test_login_developer_stores_private_credentials(server: str, config_dir: Path) -> None:
    create_user(server, "dev-alice", "--role", "developer", "--tenant", "research-lab")
    result = ok(login(server, "dev-alice"))
    assert f"logged in to {server} as dev-alice (developer on research-lab)" in flat(result.stdout)

    path = config_dir / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in config_dir.iterdir()) == ["credentials.json"]  # no leftovers
    entry = json.loads(path.read_text())[server]
    assert entry["username"] == "dev-alice" and entry["kind"] == "session"
    assert entry["token"].startswith("ppt_") and entry["expires_at"]
    no_secret(result, entry["token"])  # the session token is stored, never printed

    who = ok(run(server, "whoami")).stdout
    assert "User dev-alice" in who and "developer" in who and "research-lab" in who
    me = as_json(run(server, "whoami", "--json"))
    assert (me["username"], me["roles"], me["tenants"]) == (
        "dev-alice",
        ["developer"],
        ["research-lab"],
    )
    # The stored session is what every command sends, with the developer's rights.
    assert as_json(run(server, "workloads", "list", "--json"))["items"]
    denied = run(server, "users", "list")
    assert denied.exit_code == 1
    assert denied.stderr.startswith("error (forbidden): ")
    assert LOGIN_HINT not in denied.stderr  # signed in, just not allowed

    out = ok(run(server, "logout")).stdout
    assert f"logged out of {server} (dev-alice)" in out
    assert stored(server) is None
    again = run(server, "whoami")
    assert again.exit_code == 1 and LOGIN_HINT in again.stderr
    revoked = run(server, "whoami", token=entry["token"])  # ended on the server too
    assert revoked.exit_code == 1
    assert revoked.stderr.startswith("error (invalid_token): ")
    assert LOGIN_HINT in revoked.stderr


def test_login_prompts_for_username_and_hidden_password(server: str) -> None:
    create_user(server, "dev-bob", "--role", "developer", "--tenant", "research-lab")
    result = no_secret(run(server, "login", input=f"dev-bob\n{PASSWORD}\n"), PASSWORD)
    assert "as dev-bob" in flat(ok(result).stdout)
    assert "Password" in result.output  # it was asked for, and not echoed
    assert stored(server)["username"] == "dev-bob"


def test_login_rewrites_a_too_open_credentials_file(server: str, config_dir: Path) -> None:
    create_user(server, "dev-open", "--role", "developer", "--tenant", "research-lab")
    config_dir.mkdir(parents=True, mode=0o755)
    os.chmod(config_dir, 0o755)
    path = config_dir / "credentials.json"
    path.write_text(json.dumps({"http://elsewhere:1": {"token": "ppt_keep", "username": "x"}}))
    os.chmod(path, 0o644)
    ok(login(server, "dev-open"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    data = json.loads(path.read_text())
    assert data["http://elsewhere:1"]["token"] == "ppt_keep"  # other servers' entries stay
    assert data[server]["username"] == "dev-open"


def test_credentials_file_is_created_0600(
    server: str, config_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Created with mode 0600 by os.open, exclusively: never a moment world-readable."""
    create_user(server, "dev-mode", "--role", "developer", "--tenant", "research-lab")
    calls: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        calls.append((str(path), flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(cli_credentials.os, "open", spy)
    ok(login(server, "dev-mode"))
    mine = [c for c in calls if str(config_dir) in c[0]]
    assert mine, calls
    for _path, flags, mode in mine:
        assert mode == 0o600
        assert flags & os.O_CREAT and flags & os.O_EXCL


def test_wrong_password(server: str, config_dir: Path) -> None:
    create_user(server, "dev-carl", "--role", "developer", "--tenant", "research-lab")
    wrong = "not the right password"
    result = login(server, "dev-carl", password=wrong)
    assert result.exit_code == 1
    assert result.stderr.startswith("error (invalid_credentials): ")
    assert result.stdout == ""
    no_traceback(result)
    assert not (config_dir / "credentials.json").exists()
    unknown = login(server, "nobody-here")
    assert unknown.exit_code == 1 and "invalid_credentials" in unknown.stderr


def test_login_without_password_on_stdin_exits_2(server: str) -> None:
    result = run(server, "login", "--username", "dev-x", "--password-stdin", input="")
    assert result.exit_code == 2
    assert "no password on stdin" in flat(result.output)


def test_logout_when_the_server_is_down(config_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    cli_credentials.store(dead, token="ppt_old-session", username="dev", expires_at=None)
    result = runner.invoke(app, ["--server", dead, "logout"])
    assert result.exit_code == 0
    assert "could not be reached" in result.stderr
    assert f"removed the stored credentials for {dead} locally" in result.stderr
    no_secret(result, "ppt_old-session")
    assert cli_credentials.lookup(dead) is None
    assert "not logged in" in ok(runner.invoke(app, ["--server", dead, "logout"])).stdout


def test_corrupt_credentials_file(server: str, config_dir: Path) -> None:
    config_dir.mkdir(parents=True)
    (config_dir / "credentials.json").write_text("{nope")
    result = run(server, "whoami")
    assert result.exit_code == 1
    assert "is not valid JSON" in result.stderr
    no_traceback(result)
    # An explicit token does not need the file.
    assert as_json(run(server, "whoami", "--json", token=ADMIN_TOKEN))["username"] == "admin"


# --- MFA ---------------------------------------------------------------------------------------


def test_operator_enrolls_mfa_then_logs_in_with_totp(server: str) -> None:
    create_user(server, "op-carol", "--role", "operator")
    first = ok(login(server, "op-carol"))
    assert "proofplane mfa enroll" in flat(first.stdout)
    entry = stored(server)
    assert entry is not None and entry["kind"] == "enrollment"
    no_secret(first, entry["token"])

    who = ok(run(server, "whoami")).stdout
    assert "MFA enrollment required" in who
    blocked = run(server, "nodes", "list")
    assert blocked.exit_code == 1
    assert blocked.stderr.startswith("error (mfa_enrollment_required): ")
    assert "proofplane mfa enroll" in blocked.stderr

    begun = as_json(run(server, "mfa", "enroll", "--json"))
    assert set(begun) == {"secret", "otpauth_uri"}
    secret = begun["secret"]
    assert f"secret={secret}" in begun["otpauth_uri"]
    assert "op-carol" in begun["otpauth_uri"]
    assert stored(server) == entry  # not confirmed yet: the enrollment session stays

    bad = run(server, "mfa", "confirm", "000000" if now_code(secret) != "000000" else "111111")
    assert bad.exit_code == 1 and "invalid_totp" in bad.stderr

    confirmed = as_json(run(server, "mfa", "confirm", now_code(secret), "--json"))
    codes = confirmed["recovery_codes"]
    assert len(codes) == 10 and len(set(codes)) == 10
    assert stored(server) is None  # the enrollment session ended with the confirmation

    # No code given: the CLI asks for it (after the password, which it does not ask again).
    second = ok(login(server, "op-carol", extra=f"{now_code(secret, ahead=1)}\n"))
    assert "TOTP code" in second.output
    assert second.output.count("Password") == 0  # read from stdin, never prompted
    assert "as op-carol (operator)" in flat(second.stdout)
    assert stored(server)["kind"] == "session"
    assert as_json(run(server, "nodes", "list", "--json"))["items"]

    # A recovery code works once, in place of a TOTP code.
    ok(run(server, "logout"))
    third = run(
        server,
        "login",
        "--username",
        "op-carol",
        "--password-stdin",
        "--totp",
        codes[0],
        input=PASSWORD + "\n",
    )
    assert "as op-carol" in flat(ok(no_secret(third, PASSWORD)).stdout)
    reused = run(
        server,
        "login",
        "--username",
        "op-carol",
        "--password-stdin",
        "--totp",
        codes[0],
        input=PASSWORD + "\n",
    )
    assert reused.exit_code == 1
    assert reused.stderr.startswith("error (invalid_totp): ")

    wrong = login(server, "op-carol", extra="12345x\n")
    assert wrong.exit_code == 1 and "invalid_totp" in wrong.stderr


def test_mfa_enroll_interactive_with_qr(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = totp.new_secret()
    monkeypatch.setattr(totp, "new_secret", lambda: secret)  # the server runs in this process
    create_user(server, "aud-dora", "--role", "auditor")
    ok(login(server, "aud-dora"))
    result = ok(run(server, "mfa", "enroll", input=f"000000\n{now_code(secret)}\n"))
    out = result.stdout
    assert "█" in out or "▀" in out  # a QR code drawn in the terminal
    assert secret in out
    assert "otpauth://totp/proofplane%3Aaud-dora?" in out
    assert "not valid" in result.stderr  # the wrong first code, then a retry
    assert "STORE THESE NOW" in out
    codes = [line.strip() for line in out.splitlines() if line.strip().count("-") == 3]
    assert len(codes) == 10
    assert "proofplane login" in flat(out)
    assert stored(server) is None
    ok(login(server, "aud-dora", extra=f"{now_code(secret, ahead=1)}\n"))


def test_mfa_enroll_json_with_code(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = totp.new_secret()
    monkeypatch.setattr(totp, "new_secret", lambda: secret)
    create_user(server, "ta-erin", "--role", "tenant-admin", "--tenant", "research-lab")
    ok(login(server, "ta-erin"))
    result = as_json(run(server, "mfa", "enroll", "--json", "--code", now_code(secret)))
    assert result["secret"] == secret
    assert result["otpauth_uri"].startswith("otpauth://totp/")
    assert len(result["recovery_codes"]) == 10
    assert stored(server) is None
    again = login(server, "ta-erin", extra=f"{now_code(secret, ahead=1)}\n")
    assert "tenant-admin on research-lab" in flat(ok(again).stdout)


# --- users -------------------------------------------------------------------------------------


def test_users_create_list_show_update(server: str) -> None:
    created = create_user(server, "dev-dave", "--role", "developer", "-t", "research-lab")
    assert (created["roles"], created["tenants"], created["mfa_enabled"]) == (
        ["developer"],
        ["research-lab"],
        False,
    )
    table = ok(admin(server, "users", "list")).stdout
    row = next(line for line in table.splitlines() if "dev-dave" in line)
    assert "developer" in row and "research-lab" in row and "active" in row
    page = as_json(admin(server, "users", "list", "--json"))
    assert {"admin", "dev-dave"} <= {u["username"] for u in page["items"]}
    assert "password" not in json.dumps(page).lower()

    shown = ok(admin(server, "users", "show", "dev-dave")).stdout
    assert "User dev-dave" in shown and "research-lab" in shown
    assert as_json(admin(server, "users", "show", "dev-dave", "--json"))["source"] == "local"
    missing = admin(server, "users", "show", "nobody")
    assert missing.exit_code == 1 and missing.stderr.startswith("error (not_found): ")

    updated = as_json(
        admin(
            server,
            "users",
            "update",
            "dev-dave",
            "--role",
            "developer",
            "--role",
            "tenant-admin",
            "--tenant",
            "research-lab",
            "--json",
        )
    )
    assert updated["roles"] == ["developer", "tenant-admin"]
    out = ok(admin(server, "users", "update", "dev-dave", "--disable")).stdout
    assert "dev-dave updated (disabled)" in out
    assert "disabled" in ok(admin(server, "users", "show", "dev-dave")).stdout
    refused = login(server, "dev-dave")
    assert refused.exit_code == 1 and "invalid_credentials" in refused.stderr
    ok(admin(server, "users", "update", "dev-dave", "--enable", "--role", "developer"))
    ok(login(server, "dev-dave"))

    new_password = "another long passphrase"
    changed = admin(
        server, "users", "update", "dev-dave", "--password-stdin", input=new_password + "\n"
    )
    assert "(password)" in ok(no_secret(changed, new_password)).stdout
    ok(login(server, "dev-dave", password=new_password))

    nothing = admin(server, "users", "update", "dev-dave")
    assert nothing.exit_code == 2 and "nothing to change" in flat(nothing.output)


def test_users_create_prompts_twice(server: str) -> None:
    result = admin(
        server,
        "users",
        "create",
        "dev-fay",
        "-r",
        "developer",
        "-t",
        "research-lab",
        input=f"{PASSWORD}\n{PASSWORD}\n",
    )
    assert "user dev-fay created (developer on research-lab)" in ok(result).stdout
    assert result.output.count("Password for dev-fay") == 1
    assert "Repeat for confirmation" in result.output
    no_secret(result, PASSWORD)
    ok(login(server, "dev-fay"))

    mismatch = admin(
        server,
        "users",
        "create",
        "dev-gus",
        "-r",
        "developer",
        "-t",
        "research-lab",
        input=f"{PASSWORD}\nsomething else entirely\n",
    )
    assert mismatch.exit_code == 1
    assert "do not match" in mismatch.output
    no_secret(mismatch, PASSWORD, "something else entirely")
    assert admin(server, "users", "show", "dev-gus").exit_code == 1  # never created


def test_users_create_refusals(server: str) -> None:
    both = admin(
        server,
        "users",
        "create",
        "x-user",
        "-r",
        "developer",
        "--password-stdin",
        "--no-password",
        input="whatever-password\n",
    )
    assert both.exit_code == 2
    unknown_role = admin(server, "users", "create", "x-user", "-r", "wizard", "--no-password")
    assert unknown_role.exit_code == 2 and "'wizard' is not a role" in flat(unknown_role.output)
    no_role = admin(server, "users", "create", "x-user", "--no-password")
    assert no_role.exit_code == 2
    weak = admin(
        server, "users", "create", "x-user", "-r", "auditor", "--password-stdin", input="short1\n"
    )
    assert weak.exit_code == 1 and weak.stderr.startswith("error (weak_password): ")
    no_secret(weak, "short1")
    dup = admin(server, "users", "create", "admin", "-r", "auditor", "--no-password")
    assert dup.exit_code == 1 and "error (conflict)" in dup.stderr

    sso = as_json(
        admin(server, "users", "create", "sso-hal", "-r", "auditor", "--no-password", "--json")
    )
    assert sso["username"] == "sso-hal"
    # No password: there is nothing to log in with locally.
    assert login(server, "sso-hal", password="any password at all").exit_code == 1


def test_users_unlock(server: str) -> None:
    create_user(server, "dev-ivy", "--role", "developer", "--tenant", "research-lab")
    for i in range(10):
        # from ten addresses (a proxy on the loopback says which; uvicorn trusts it), so that
        # this one's failures do not make the CLI's own address wait
        r = httpx.post(
            f"{server}/api/v1/auth/login",
            json={"username": "dev-ivy", "password": "wrong password here"},
            headers={"X-Forwarded-For": f"198.51.100.{i + 1}"},
        )
        assert r.status_code == 401
    assert "locked until" in ok(admin(server, "users", "show", "dev-ivy")).stdout
    locked = login(server, "dev-ivy")
    assert locked.exit_code == 1
    assert locked.stderr.startswith("error (account_locked): ")
    out = ok(admin(server, "users", "unlock", "dev-ivy")).stdout
    assert "user dev-ivy unlocked" in out
    user = as_json(admin(server, "users", "show", "dev-ivy", "--json"))
    assert (user["locked_until"], user["failed_logins"]) == (None, 0)
    ok(login(server, "dev-ivy"))


# --- tokens ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3600", 3600),
        ("60", 60),
        ("90s", 90),
        ("30m", 1800),
        ("12h", 43200),
        ("7d", 604800),
        ("90d", 7776000),
        (" 2H ", 7200),
    ],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["91d", "2161h", "7776001", "59", "0", "0d", "", "abc", "-5m", "1w", "1.5h", "7 d"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(typer.BadParameter):
        parse_duration(text)


def _tokens_but_last_used(server: str) -> list[dict[str, object]]:
    """Every token as listed, without ``last_used_at``: the server writes the uses it noted up
    to two seconds later (``service/access/last_used.py``), so an earlier test's use may land
    between two lists of this one."""
    items = as_json(admin(server, "tokens", "list", "--all", "--json"))["items"]
    return [{k: v for k, v in t.items() if k != "last_used_at"} for t in items]


def test_tokens_round_trip(server: str) -> None:
    before = _tokens_but_last_used(server)

    too_long = admin(server, "tokens", "create", "--expires-in", "91d")
    assert too_long.exit_code == 2 and "longer than 90 days" in flat(too_long.output)
    assert _tokens_but_last_used(server) == before  # the refused create left no token

    created = as_json(admin(server, "tokens", "create", "-e", "12h", "--name", "ci", "--json"))
    t1, id1 = created["token"], created["id"]
    assert created["kind"] == "api" and t1.startswith("ppt_")
    listed = as_json(admin(server, "tokens", "list", "--json"))["items"]
    mine = next(t for t in listed if t["id"] == id1)
    assert (mine["name"], mine["owner"], mine["roles"]) == ("ci", "admin", ["admin"])
    assert "token" not in mine  # the secret is never listed
    table = ok(admin(server, "tokens", "list")).stdout
    assert id1 in table and t1 not in table
    assert as_json(run(server, "whoami", "--json", token=t1))["token_id"] == id1

    rotated = as_json(admin(server, "tokens", "rotate", id1, "--expires-in", "2h", "--json"))
    t2, id2 = rotated["token"], rotated["id"]
    assert id2 != id1 and t2 != t1
    old = run(server, "nodes", "list", token=t1)
    assert old.exit_code == 1
    assert old.stderr.startswith("error (invalid_token): ")
    assert LOGIN_HINT in old.stderr
    assert as_json(run(server, "whoami", "--json", token=t2))["token_id"] == id2

    active = {t["id"] for t in as_json(admin(server, "tokens", "list", "--json"))["items"]}
    everything = {
        t["id"]: t for t in as_json(admin(server, "tokens", "list", "--all", "--json"))["items"]
    }
    assert id2 in active and id1 not in active
    assert everything[id1]["revoked_at"] is not None

    out = ok(admin(server, "tokens", "revoke", id2)).stdout
    assert f"token {id2} revoked" in out
    gone = run(server, "whoami", token=t2)
    assert gone.exit_code == 1 and LOGIN_HINT in gone.stderr
    assert "revoked" in ok(admin(server, "tokens", "list", "--all")).stdout

    again = admin(server, "tokens", "rotate", id2)
    assert again.exit_code == 1 and again.stderr.startswith("error (invalid_state): ")
    missing = admin(server, "tokens", "revoke", "tok_nope")
    assert missing.exit_code == 1 and "error (not_found)" in missing.stderr


def test_tokens_text_output_shows_the_secret_once(server: str) -> None:
    result = ok(admin(server, "tokens", "create", "--expires-in", "30m"))
    lines = [line.strip() for line in result.stdout.splitlines()]
    secret = next(line for line in lines if line.startswith("ppt_"))
    assert result.stdout.count(secret) == 1
    assert "shown only this once" in result.stdout
    token_id = next(line.split()[-1] for line in lines if line.startswith("id "))
    assert as_json(run(server, "whoami", "--json", token=secret))["token_id"] == token_id
    rotated = ok(admin(server, "tokens", "rotate", token_id)).stdout
    assert f"token {token_id} revoked and replaced by tok_" in rotated
    assert secret not in rotated


def test_token_scope_cannot_exceed_the_owner(server: str) -> None:
    result = admin(server, "tokens", "create", "-e", "1h", "--role", "developer")
    assert result.exit_code == 1 and result.stderr.startswith("error (forbidden): ")


def test_developer_tokens_and_others_tokens(server: str) -> None:
    create_user(server, "dev-jo", "--role", "developer", "--tenant", "research-lab")
    ok(login(server, "dev-jo"))
    created = as_json(run(server, "tokens", "create", "-e", "7d", "--json"))
    assert as_json(run(server, "whoami", "--json", token=created["token"]))["username"] == "dev-jo"
    mine = as_json(run(server, "tokens", "list", "--json"))["items"]
    assert {t["owner"] for t in mine} == {"dev-jo"}
    theirs = as_json(admin(server, "tokens", "list", "--owner", "dev-jo", "--json"))["items"]
    assert created["id"] in {t["id"] for t in theirs}
    nosy = run(server, "tokens", "list", "--owner", "admin")
    assert nosy.exit_code == 1 and "not_found" in nosy.stderr


# --- node agents -------------------------------------------------------------------------------


def test_nodes_agent_credential(server: str) -> None:
    issued = as_json(
        admin(server, "nodes", "agent-credential", "fra-h100-01", "--ttl-days", "7", "--json")
    )
    assert issued["kind"] == "agent" and issued["token"].startswith("ppa_")
    text = ok(admin(server, "nodes", "agent-credential", "fra-h100-02")).stdout
    assert "agent credential for fra-h100-02" in text and "ppa_" in text
    missing = admin(server, "nodes", "agent-credential", "no-such-node")
    assert missing.exit_code == 1 and missing.stderr.startswith("error (not_found): ")
    assert admin(server, "nodes", "agent-credential", "x", "--ttl-days", "91").exit_code == 2
