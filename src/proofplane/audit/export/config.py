"""Sink configurations: what each sink type accepts, checked before anything is stored.

``validate(kind, config)`` returns the normalized configuration (defaults filled in) or raises
``ValidationFailed`` with a code a program can match:

* ``unknown_sink_type``: not one of ``SINK_TYPES``;
* ``invalid_sink_config``: an unknown or missing field, or a value of the wrong type or range;
* ``invalid_sink_url``: a URL that is not ``tls://host:port`` (syslog) or ``http(s)://host…``;
* ``tls_file_missing``: a CA, certificate or key file that is not a readable file.

``redact(config)`` is what may be shown: secrets (tokens, private-key paths) are replaced.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from proofplane.errors import ValidationFailed

SYSLOG = "syslog"
OCSF_FILE = "ocsf-file"
OCSF_HTTP = "ocsf-http"
SPLUNK_HEC = "splunk-hec"
SINK_TYPES = (SYSLOG, OCSF_FILE, OCSF_HTTP, SPLUNK_HEC)

SECRET_FIELDS = frozenset({"token", "bearer_token", "key_file"})
REDACTED = "<redacted>"
TLS_FILE_FIELDS = ("ca_file", "cert_file", "key_file")
MAX_BATCH = 5000

# field → (type, required, default)
_Spec = dict[str, tuple[type | tuple[type, ...], bool, Any]]
_COMMON: _Spec = {"batch_size": (int, False, 500)}
_SPECS: dict[str, _Spec] = {
    SYSLOG: {
        "url": (str, True, None),
        "ca_file": (str, True, None),
        "cert_file": (str, True, None),
        "key_file": (str, True, None),
        "server_name": (str, False, None),
        "hostname": (str, False, None),
        "facility": (int, False, 13),
        "timeout_s": ((int, float), False, 10),
    },
    OCSF_FILE: {"path": (str, True, None)},
    OCSF_HTTP: {
        "url": (str, True, None),
        "bearer_token": (str, False, None),
        "ca_file": (str, False, None),
        "timeout_s": ((int, float), False, 10),
    },
    SPLUNK_HEC: {
        "url": (str, True, None),
        "token": (str, True, None),
        "index": (str, False, None),
        "source": (str, False, "proofplane"),
        "sourcetype": (str, False, "proofplane:audit"),
        "host": (str, False, None),
        "ca_file": (str, False, None),
        "timeout_s": ((int, float), False, 10),
    },
}


def _bad(message: str, code: str = "invalid_sink_config", **details: Any) -> ValidationFailed:
    return ValidationFailed(message, code=code, details=details or None)


def validate(
    kind: str, config: dict[str, Any], *, is_file: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """The normalized configuration of a ``kind`` sink, or ValidationFailed (nothing stored)."""
    if kind not in _SPECS:
        raise _bad(
            f"unknown sink type {kind!r}; one of {', '.join(SINK_TYPES)}",
            "unknown_sink_type",
            type=kind,
            types=list(SINK_TYPES),
        )
    if not isinstance(config, dict):
        raise _bad("the sink config must be an object")
    spec = {**_COMMON, **_SPECS[kind]}
    unknown = sorted(set(config) - set(spec))
    if unknown:
        raise _bad(f"unknown {kind} sink fields: {', '.join(unknown)}", fields=unknown)
    out: dict[str, Any] = {}
    for name, (typ, required, default) in spec.items():
        value = config.get(name)
        if value is None:
            if required:
                raise _bad(f"a {kind} sink needs {name!r}", field=name)
            if default is not None:
                out[name] = default
            continue
        if isinstance(value, bool) or not isinstance(value, typ):
            raise _bad(f"{name!r} has the wrong type", field=name)
        if isinstance(value, str) and (not value.strip() or "\x00" in value):
            raise _bad(f"{name!r} must not be empty", field=name)
        out[name] = value
    if not 1 <= out["batch_size"] <= MAX_BATCH:
        raise _bad(f"batch_size must be 1..{MAX_BATCH}", field="batch_size")
    if "timeout_s" in out and not 0 < out["timeout_s"] <= 300:
        raise _bad("timeout_s must be in (0, 300]", field="timeout_s")
    if kind == SYSLOG:
        _syslog_url(out["url"])
        if not 0 <= out["facility"] <= 23:
            raise _bad("facility must be 0..23", field="facility")
    elif kind in (OCSF_HTTP, SPLUNK_HEC):
        _http_url(out["url"])
    elif kind == OCSF_FILE:
        path = out["path"]
        if not os.path.isabs(path):
            raise _bad("path must be absolute", field="path")
    check = is_file or os.path.isfile
    for name in TLS_FILE_FIELDS:
        if name in out and not check(out[name]):
            # The key's path is a secret: it is not echoed back.
            shown = name if name in SECRET_FIELDS else f"{name} {out[name]!r}"
            raise _bad(f"{shown} is not a readable file", "tls_file_missing", field=name)
    return out


def _split(url: str) -> tuple[str, str | None, int | None, str, bool]:
    """(scheme, host, port, path, has credentials); a malformed URL is invalid_sink_url."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _bad(f"{url!r} is not a valid URL: {exc}", "invalid_sink_url", field="url") from exc
    creds = bool(parts.username or parts.password)
    return parts.scheme, parts.hostname, port, parts.path, creds


def _syslog_url(url: str) -> tuple[str, int]:
    scheme, host, port, path, _ = _split(url)
    if scheme != "tls" or not host or port is None or path not in ("", "/"):
        raise _bad(
            f"{url!r} is not tls://HOST:PORT (syslog is sent over mutual TLS only)",
            "invalid_sink_url",
            field="url",
        )
    return host, port


def syslog_address(url: str) -> tuple[str, int]:
    """(host, port) of a syslog sink's ``tls://HOST:PORT``."""
    return _syslog_url(url)


def _http_url(url: str) -> None:
    scheme, host, _, _, creds = _split(url)
    if creds:  # checked first: such a URL is not echoed back
        raise _bad(
            "put credentials in token fields, not in the URL", "invalid_sink_url", field="url"
        )
    if scheme not in ("http", "https") or not host:
        raise _bad(f"{url!r} is not an http(s):// URL", "invalid_sink_url", field="url")


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as it may be shown or recorded: secrets replaced."""
    return {k: (REDACTED if k in SECRET_FIELDS and v is not None else v) for k, v in config.items()}
