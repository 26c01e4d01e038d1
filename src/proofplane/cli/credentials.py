"""The CLI's stored credentials: one bearer token per server, in the user's config directory.

``credentials.json`` maps a server URL to ``{"token", "username", "expires_at"}`` (plus
``"kind"``: ``session``, ``enrollment`` or ``api``). The file is created with mode 0600 inside
a 0700 directory and replaced atomically, so it is never readable by anyone else, not even for
a moment, and a crash mid-write never leaves half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

import platformdirs

from proofplane.cli.client import CliError

FILE_NAME = "credentials.json"


def config_dir() -> Path:
    """The directory holding the credentials file (platformdirs' user config directory)."""
    return Path(platformdirs.user_config_dir("proofplane"))


def credentials_path() -> Path:
    return config_dir() / FILE_NAME


def server_key(server: str) -> str:
    """The key a server's entry is stored under: its URL without a trailing slash."""
    return server.rstrip("/") or server


def load_all() -> dict[str, dict[str, Any]]:
    """Every stored entry; an absent file is no entries, an unreadable one an error (exit 1)."""
    path = credentials_path()
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CliError(f"proofplane: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CliError(
            f"proofplane: {path} is not valid JSON; remove it and run 'proofplane login'"
        ) from exc
    if not isinstance(data, dict):
        raise CliError(f"proofplane: {path} is not a JSON object; remove it and log in again")
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def lookup(server: str) -> dict[str, Any] | None:
    """The stored entry for ``server``, or None."""
    entry = load_all().get(server_key(server))
    if entry is None or not isinstance(entry.get("token"), str) or not entry["token"]:
        return None
    return entry


def _write_all(entries: dict[str, dict[str, Any]]) -> Path:
    """Write the file: a 0600 temporary file in a 0700 directory, then an atomic rename."""
    path = credentials_path()
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # a directory we do not own stays as it is
            os.chmod(directory, 0o700)
        tmp = directory / f".{FILE_NAME}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, flags, 0o600)
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fd = -1
                json.dump(entries, fh, indent=2, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise CliError(f"proofplane: cannot write {path}: {exc.strerror or exc}") from exc
    return path


def store(
    server: str,
    *,
    token: str,
    username: str | None,
    expires_at: str | None,
    kind: str = "session",
) -> Path:
    """Remember ``token`` for ``server`` (replacing what was there); returns the file's path."""
    entries = load_all()
    entries[server_key(server)] = {
        "token": token,
        "username": username,
        "expires_at": expires_at,
        "kind": kind,
    }
    return _write_all(entries)


def remove(server: str) -> bool:
    """Forget ``server``'s entry; whether there was one."""
    entries = load_all()
    if entries.pop(server_key(server), None) is None:
        return False
    _write_all(entries)
    return True
