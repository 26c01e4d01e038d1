"""Sink configurations: what each sink type accepts, checked before anything is stored.

``validate(kind, config)`` returns the normalized configuration (defaults filled in) or raises
``ValidationFailed`` with a code a program can match:

* ``unknown_sink_type``: not one of ``SINK_TYPES``;
* ``invalid_sink_config``: an unknown or missing field, or a value of the wrong type or range;
* ``invalid_sink_url``: a URL that is not ``tls://host:port`` (syslog) or ``http(s)://host…``;
* ``insecure_sink_url``: an ``http://`` URL (tokens in clear) while the policy wants HTTPS;
* ``forbidden_sink_destination``: a host that is a loopback, link-local, unspecified or cloud
  metadata address (and not allow-listed);
* ``invalid_sink_path``: an ``ocsf-file`` path that is not a plain file name in the sink
  directory;
* ``tls_file_outside_dir``: a CA, certificate or key file outside the TLS directory
  (``PROOFPLANE_SINK_TLS_DIR``): refused before anything is looked up, so a sink cannot be
  used to learn which files exist on the server;
* ``tls_file_missing``: a CA, certificate or key file (in that directory) that is not a file.

Sinks must not become a way into the host (issue 19, §5). What the deployment allows comes in
as a ``SinkPolicy`` (read from ``PROOFPLANE_SINK_*`` at the edge, never here): file sinks write
only under ``sink_dir``, by name; HTTP sinks need ``https://`` unless ``allow_insecure``; and
``refusal(address, host, policy)`` says why an address may not be connected to. Only literal
addresses are checked here; ``proofplane.siem.guard`` resolves host names, at configuration
and again at every connection (DNS rebinding).

``redact(config)`` is what may be shown: secrets (tokens, private-key paths) are replaced.
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from proofplane.audit.export import hec
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

# The cloud instance metadata service (AWS, GCP, Azure, OpenStack: IPv4; AWS Nitro: IPv6):
# refused even when a network around it is allow-listed; only the exact address unlocks it.
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # "this host": 0.0.0.0 reaches loopback
FILE_NAME_MAX = 255

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class SinkPolicy:
    """What the deployment lets sinks reach (``PROOFPLANE_SINK_DIR``,
    ``PROOFPLANE_SINK_ALLOW_INSECURE``, ``PROOFPLANE_SINK_ALLOW_HOSTS``).

    ``sink_dir``: the directory file sinks write to (absolute; None: not known here, so only a
    bare file name is accepted). ``allow_hosts``: host names (matched as written in the URL,
    case-insensitively), addresses and networks (CIDR) that may be connected to although they
    are loopback, link-local or unspecified; the metadata addresses need their exact address.
    """

    sink_dir: str | None = None
    allow_insecure: bool = False
    allow_hosts: tuple[str, ...] = ()
    #: where sinks' CA, certificate and key files must live (``PROOFPLANE_SINK_TLS_DIR``);
    #: None: not known here, no confinement
    tls_dir: str | None = None
    #: the OCSF schema version OCSF sinks write (``PROOFPLANE_OCSF_VERSION``)
    ocsf_version: str = "1.1.0"

    def host_listed(self, host: str) -> bool:
        """Whether the host name as written is on the allow-list (not an address entry)."""
        name = host.strip("[]").rstrip(".").lower()
        return any(_is_name(e) and e.rstrip(".").lower() == name for e in self.allow_hosts)

    def address_listed(self, address: IpAddress, *, exact: bool = False) -> bool:
        for entry in self.allow_hosts:
            if _is_name(entry):
                continue
            network = ipaddress.ip_network(entry, strict=False)
            if exact and network.num_addresses != 1:
                continue
            if address.version == network.version and address in network:
                return True
        return False


def _is_name(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return True
    return False


def refusal(address: IpAddress, host: str, policy: SinkPolicy) -> str | None:
    """Why a sink may not connect to ``address`` (reached through ``host`` as written in its
    URL), or None. Loopback, link-local and unspecified addresses reach the server itself or
    its neighbourhood, not a SIEM: refused unless allow-listed; the metadata address hands out
    cloud credentials: refused unless that exact address is listed."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in METADATA_ADDRESSES:
        if policy.address_listed(address, exact=True):
            return None
        return "the cloud metadata address"
    if address.is_loopback:
        what = "a loopback address"
    elif address.is_link_local:
        what = "a link-local address"
    elif address.is_unspecified or (address.version == 4 and address in _THIS_NETWORK):
        what = "an unspecified address"
    else:
        return None
    if policy.host_listed(host) or policy.address_listed(address):
        return None
    return what


def literal_address(host: str) -> IpAddress | None:
    """The address when ``host`` is an IP literal (``[v6]`` brackets allowed), else None."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def check_literal_host(host: str, policy: SinkPolicy) -> None:
    """ValidationFailed (``forbidden_sink_destination``) for a refused IP literal; names are
    resolved and checked by ``proofplane.siem.guard``."""
    address = literal_address(host)
    why = None if address is None else refusal(address, host, policy)
    if why is not None:
        raise forbidden(host, why)


def forbidden(host: str, why: str) -> ValidationFailed:
    return ValidationFailed(
        f"sink destination {host!r} is {why}; allow it with PROOFPLANE_SINK_ALLOW_HOSTS",
        code="forbidden_sink_destination",
        details={"host": host, "reason": why},
    )


def tls_file_path(path: str, tls_dir: str | None, field: str) -> str:
    """A sink's CA, certificate or key file: an absolute path inside ``tls_dir`` (normalized,
    so ``..`` cannot leave it), else ``tls_file_outside_dir``; nothing is looked up first, so
    the answer says nothing of files elsewhere. ``tls_dir`` None: no confinement."""
    if tls_dir is None:
        return path
    norm = posixpath.normpath(path)
    root = posixpath.normpath(tls_dir)
    inside = norm.startswith(root.rstrip("/") + "/")
    if not path.startswith("/") or not inside:
        raise _bad(
            f"{field} must be a file in the sinks' TLS directory (PROOFPLANE_SINK_TLS_DIR)",
            "tls_file_outside_dir",
            field=field,
        )
    return norm


def sink_file_name(path: str, sink_dir: str | None) -> str:
    """The file name an ``ocsf-file`` sink writes to in the sink directory: a plain name, or an
    absolute path directly in ``sink_dir``. Anything else (another directory, ``..``, a
    sub-directory, a hidden file) is ``invalid_sink_path``."""
    name = path
    if path.startswith("/"):
        parent, name = posixpath.split(path)
        if sink_dir is None or posixpath.normpath(parent) != posixpath.normpath(sink_dir):
            raise _bad(
                "file sinks write only into the sink directory (PROOFPLANE_SINK_DIR): give a "
                "file name",
                "invalid_sink_path",
                field="path",
            )
    if (
        not name
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or len(name.encode()) > FILE_NAME_MAX
        or not name.isprintable()
    ):
        raise _bad(
            "path must be a file name in the sink directory (no '/', not starting with '.')",
            "invalid_sink_path",
            field="path",
        )
    return name


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
        # indexer acknowledgement (the token's useACK): a batch counts once it is indexed
        "ack": (bool, False, False),
        "channel": (str, False, None),  # a UUID; default: derived from the URL and token
        "ack_timeout_s": ((int, float), False, 30),
    },
}
MAX_ACK_TIMEOUT_S = 600


def _bad(message: str, code: str = "invalid_sink_config", **details: Any) -> ValidationFailed:
    return ValidationFailed(message, code=code, details=details or None)


def validate(
    kind: str,
    config: dict[str, Any],
    *,
    is_file: Callable[[str], bool] | None = None,
    policy: SinkPolicy | None = None,
) -> dict[str, Any]:
    """The normalized configuration of a ``kind`` sink, or ValidationFailed (nothing stored).

    ``policy`` (default: the strict one, ``SinkPolicy()``) says what the deployment allows; an
    ``ocsf-file`` path comes back as the bare file name in the sink directory. ``is_file``
    (the edge passes ``os.path.isfile``) says whether a TLS file exists; None: not checked
    here, since this module does no I/O."""
    policy = policy or SinkPolicy()
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
        if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
            raise _bad(f"{name!r} has the wrong type", field=name)
        if isinstance(value, str) and (not value.strip() or "\x00" in value):
            raise _bad(f"{name!r} must not be empty", field=name)
        out[name] = value
    if not 1 <= out["batch_size"] <= MAX_BATCH:
        raise _bad(f"batch_size must be 1..{MAX_BATCH}", field="batch_size")
    if "timeout_s" in out and not 0 < out["timeout_s"] <= 300:
        raise _bad("timeout_s must be in (0, 300]", field="timeout_s")
    if kind == SYSLOG:
        host, _ = _syslog_url(out["url"])
        check_literal_host(host, policy)
        if not 0 <= out["facility"] <= 23:
            raise _bad("facility must be 0..23", field="facility")
    elif kind in (OCSF_HTTP, SPLUNK_HEC):
        _http_url(out["url"], policy)
    elif kind == OCSF_FILE:
        out["path"] = sink_file_name(out["path"], policy.sink_dir)
    for name in TLS_FILE_FIELDS:
        if name in out:
            out[name] = tls_file_path(out[name], policy.tls_dir, name)
        if name in out and is_file is not None and not is_file(out[name]):
            # The key's path is a secret: it is not echoed back.
            shown = name if name in SECRET_FIELDS else f"{name} {out[name]!r}"
            raise _bad(f"{shown} is not a readable file", "tls_file_missing", field=name)
    if kind == SPLUNK_HEC:
        _hec_ack(out)
    return out


def _hec_ack(out: dict[str, Any]) -> None:
    """A ``splunk-hec`` sink's acknowledgement settings: ``channel`` a UUID (stored in its
    canonical form), ``ack_timeout_s`` in (0, 600], and with ``ack`` a URL whose acknowledgement
    endpoint can be found (a bare ``https://host:8088`` or a ``…/services/collector/event``)."""
    if "channel" in out:
        channel = hec.canonical_channel(out["channel"])
        if channel is None:
            raise _bad("channel must be a UUID (a GUID, 8-4-4-4-12 hex digits)", field="channel")
        out["channel"] = channel
    timeout = out.get("ack_timeout_s")
    if timeout is not None and not 0 < timeout <= MAX_ACK_TIMEOUT_S:
        raise _bad(f"ack_timeout_s must be in (0, {MAX_ACK_TIMEOUT_S}]", field="ack_timeout_s")
    path = urlsplit(out["url"]).path
    if out.get("ack") and path not in ("", "/") and hec.ack_path(path) is None:
        raise _bad(
            "with ack, the URL must be the HEC base (https://host:8088) or its "
            ".../services/collector/event endpoint: the acknowledgement endpoint is beside it",
            field="url",
        )


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


def _http_url(url: str, policy: SinkPolicy) -> str:
    scheme, host, _, _, creds = _split(url)
    if creds:  # checked first: such a URL is not echoed back
        raise _bad(
            "put credentials in token fields, not in the URL", "invalid_sink_url", field="url"
        )
    if scheme not in ("http", "https") or not host:
        raise _bad(f"{url!r} is not an http(s):// URL", "invalid_sink_url", field="url")
    if scheme == "http" and not policy.allow_insecure:
        raise _bad(
            f"{url!r} would send the sink's token in clear: use https:// (or set "
            "PROOFPLANE_SINK_ALLOW_INSECURE=1 for a receiver on a trusted network)",
            "insecure_sink_url",
            field="url",
        )
    check_literal_host(host, policy)
    return host


def destination(kind: str, config: dict[str, Any]) -> tuple[str, int] | None:
    """(host, port) a validated network sink connects to; None for a file sink."""
    if kind == SYSLOG:
        return syslog_address(config["url"])
    if kind in (OCSF_HTTP, SPLUNK_HEC):
        scheme, host, port, _, _ = _split(config["url"])
        assert host is not None
        return host, port or (443 if scheme == "https" else 80)
    return None


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as it may be shown or recorded: secrets replaced."""
    return {k: (REDACTED if k in SECRET_FIELDS and v is not None else v) for k, v in config.items()}
