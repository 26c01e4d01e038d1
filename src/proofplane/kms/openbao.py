"""The OpenBao (or Vault) transit backend: key material is generated inside OpenBao and never
leaves it; proofplane keeps only the transit key's name.

Each version of one of our keys is its own transit key, ``proofplane-<name>-v<version>``
(``aes256-gcm96`` for ``encrypt``, ``ed25519`` for ``sign``, never exportable); the handle is
``b"bao:" + <transit key name>``. The inventory versions keys itself, so a proofplane rotation
creates a new transit key; a transit-level ``rotate`` of one of ours is harmless too (transit
ciphertexts carry their version, so old wraps still open).

* ``wrap``: transit ``encrypt`` of the data key with ``associated_data`` = the AAD, so the
  wrapped key opens only for its row; the transit ciphertext (``vault:v1:…``) is returned.
  ``unwrap``: transit ``decrypt``; a refusal (wrong AAD, tampered, another version's) is
  ``DecryptFailed``.
* ``sign``: transit ``sign`` with the key's first version, the one whose public key
  ``public_key`` reported when the version was created (a transit-level rotate of a signing
  key must not silently make the published public key stale).
* ``destroy``: allow deletion, then delete the transit key.
* ``check``: the seal status and the token.

Errors: nothing from hvac or requests escapes. Unreachable or timed out, sealed, 429 or 5xx:
``KmsUnavailable`` naming the URL (never the token); 403: ``KmsError`` code
``kms_permission_denied``; any other refusal: ``KmsError`` with the HTTP status.

Settings (``backend_from_env``): ``PROOFPLANE_KMS_URL`` (https, or http on loopback only),
``PROOFPLANE_KMS_TOKEN_FILE`` (refused when other users can read it),
``PROOFPLANE_KMS_MOUNT`` (default ``transit``), ``PROOFPLANE_KMS_CA_FILE`` (optional) and
``PROOFPLANE_KMS_TIMEOUT`` (seconds, default 5). The token needs the policy
:func:`policy_hcl` prints: it grants ``update`` but not ``create`` on ``encrypt/``, so a wrap
with the handle of a deleted key cannot quietly create a fresh one (transit upserts otherwise).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import hvac
import hvac.exceptions
import requests

from proofplane.keys import ENCRYPT, PURPOSES, SIGN, DecryptFailed, KmsError, KmsUnavailable

HANDLE_PREFIX = b"bao:"
KEY_PREFIX = "proofplane-"
DEFAULT_MOUNT = "transit"
DEFAULT_TIMEOUT = 5.0
#: the transit key type of each purpose
KEY_TYPES = {ENCRYPT: "aes256-gcm96", SIGN: "ed25519"}
#: the transit version a signing key signs with (see the module's docstring)
SIGN_VERSION = 1

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MOUNT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*$")
_T = TypeVar("_T")


def policy_hcl(mount: str = DEFAULT_MOUNT) -> str:
    """The least an OpenBao token needs for this backend on ``mount`` (write it with
    ``bao policy write proofplane-kms -`` and issue the token with ``-policy=proofplane-kms``)."""
    keys = f"{mount}/keys/{KEY_PREFIX}*"
    return "\n".join(
        [
            f'path "{keys}" {{ capabilities = ["create", "read", "update", "delete"] }}',
            f'path "{mount}/encrypt/{KEY_PREFIX}*" {{ capabilities = ["update"] }}',
            f'path "{mount}/decrypt/{KEY_PREFIX}*" {{ capabilities = ["update"] }}',
            f'path "{mount}/sign/{KEY_PREFIX}*" {{ capabilities = ["update"] }}',
            "",
        ]
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _invalid(setting: str, why: str) -> KmsError:
    return KmsError(f"{setting}: {why}", code="invalid_setting", details={"setting": setting})


def check_url(url: str) -> str:
    """``url`` without a trailing slash: https, or plain http only to a loopback address (a
    token and data keys never cross a network in the clear)."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise _invalid("PROOFPLANE_KMS_URL", f"{url!r} is not a URL") from None
    if parts.scheme not in ("https", "http") or not host:
        raise _invalid("PROOFPLANE_KMS_URL", f"{url!r} is not an https:// URL")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise _invalid("PROOFPLANE_KMS_URL", "give the server's address only (no user, query)")
    if parts.scheme == "http" and not _is_loopback(host):
        raise _invalid(
            "PROOFPLANE_KMS_URL",
            f"plain http is allowed to a loopback address only, not {host}: use https://",
        )
    return url.strip().rstrip("/")


def read_token(path: str | Path) -> str:
    """The OpenBao token in ``path``; the file must be readable by its owner only."""
    p = Path(path)
    setting = "PROOFPLANE_KMS_TOKEN_FILE"
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise _invalid(setting, f"{p} is not a regular file")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KmsError(
                f"the OpenBao token file {p} can be read by other users: run chmod 600 {p}",
                code="kms_token_insecure",
                details={"setting": setting, "path": str(p)},
            )
        token = p.read_text("utf-8").strip()
    except FileNotFoundError:
        raise _invalid(setting, f"the token file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _invalid(setting, f"cannot read the token file {p}: {exc}") from None
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise _invalid(setting, f"the token file {p} does not hold one token")
    return token


class OpenBaoBackend:
    """Key versions as transit keys in OpenBao (see the module's docstring)."""

    kind = "openbao"

    def __init__(
        self,
        url: str,
        token: str,
        *,
        mount: str = DEFAULT_MOUNT,
        ca_file: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.url = check_url(url)
        if not _MOUNT.fullmatch(mount):
            raise _invalid("PROOFPLANE_KMS_MOUNT", f"{mount!r} is not a mount path")
        self.mount = mount
        self.timeout = timeout
        session = requests.Session()
        # Settings come from PROOFPLANE_KMS_*, never from the process's proxy or CA variables;
        # redirects are not followed, since the token travels in a header requests would
        # carry to another host.
        session.trust_env = False
        # hvac takes a given session's ``verify`` over its own argument: set both.
        session.verify = ca_file if ca_file else True
        self._client = hvac.Client(
            url=self.url,
            token=token,
            verify=session.verify,
            timeout=timeout,
            allow_redirects=False,
            session=session,
        )
        self._known: dict[str, str] = {}  # transit key name -> its type, as read from OpenBao

    # --- calls ----------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], _T], *, decrypt: bool = False) -> _T:
        """``fn()`` with every failure turned into one of our errors (``decrypt``: a 400 is
        ``DecryptFailed``)."""
        try:
            return fn()
        except hvac.exceptions.VaultError as exc:
            self._refused(what, exc, decrypt=decrypt)
        except requests.exceptions.SSLError:
            raise KmsError(
                f"OpenBao at {self.url}: the TLS handshake failed while trying to {what} "
                "(is PROOFPLANE_KMS_CA_FILE the CA that issued its certificate?)",
                code="kms_tls_failed",
                details={"url": self.url},
            ) from None
        except requests.exceptions.InvalidJSONError:
            raise KmsError(
                f"{self.url} did not answer as OpenBao does while trying to {what} "
                "(PROOFPLANE_KMS_URL)",
                details={"url": self.url},
            ) from None
        except requests.exceptions.Timeout:
            raise KmsUnavailable(
                f"OpenBao at {self.url} did not answer within {self.timeout:g} s "
                f"(trying to {what})",
                details={"url": self.url},
            ) from None
        except (requests.exceptions.RequestException, OSError) as exc:
            reason = "connection refused" if "refused" in str(exc).lower() else "unreachable"
            raise KmsUnavailable(
                f"OpenBao at {self.url} cannot be reached ({reason}) while trying to {what}",
                details={"url": self.url},
            ) from None
        except (ValueError, KeyError, TypeError) as exc:  # a reply that is not what we asked
            raise KmsError(
                f"OpenBao at {self.url} answered unexpectedly while trying to {what}: "
                f"{type(exc).__name__}",
                details={"url": self.url},
            ) from None

    def _refused(self, what: str, exc: hvac.exceptions.VaultError, *, decrypt: bool) -> NoReturn:
        status = _STATUS.get(type(exc))
        errors = "; ".join(str(e) for e in (exc.errors or []))
        if not errors and exc.args and exc.args[0]:
            errors = str(exc.args[0])
        said = f": {errors}" if errors else ""
        details = {"url": self.url, "status": status}
        if isinstance(exc, hvac.exceptions.Forbidden):
            raise KmsError(
                f"OpenBao at {self.url} denied the token permission to {what} (a wrong or "
                "expired PROOFPLANE_KMS_TOKEN_FILE, or a policy without this path)",
                code="kms_permission_denied",
                details=details,
            ) from None
        if decrypt and isinstance(exc, hvac.exceptions.InvalidRequest):
            raise DecryptFailed(
                "the data key does not unwrap (tampered, another row's or another version's)"
            ) from None
        if status is None or status == 429 or status >= 500:
            sealed = isinstance(exc, hvac.exceptions.VaultDown)
            raise KmsUnavailable(
                f"OpenBao at {self.url} " + ("is sealed" if sealed else "cannot serve now")
                + f" (HTTP {status or 'error'}) while trying to {what}{said}",
                details=details,
            ) from None  # fmt: skip
        raise KmsError(
            f"OpenBao at {self.url} refused to {what} (HTTP {status}){said}", details=details
        ) from None

    def _field(self, reply: Any, *path: str) -> Any:
        """``reply[path[0]][path[1]]…``, or a ``KmsError`` when the reply lacks it."""
        value = reply
        try:
            for part in path:
                value = value[part]
        except (KeyError, TypeError, IndexError):
            raise KmsError(
                f"{self.url} did not answer as OpenBao does (no {'.'.join(path)} in its reply; "
                "PROOFPLANE_KMS_URL)",
                details={"url": self.url},
            ) from None
        return value

    def _name(self, handle: bytes) -> str:
        if not isinstance(handle, bytes) or not handle.startswith(HANDLE_PREFIX):
            raise DecryptFailed("not a key handle of the OpenBao backend")
        name = handle[len(HANDLE_PREFIX) :].decode("ascii", "replace")
        if not _NAME.fullmatch(name):
            raise DecryptFailed("not a key handle of the OpenBao backend")
        return name

    def _read_key(self, name: str) -> dict[str, Any]:
        reply = self._call(
            f"read the transit key {name}",
            lambda: self._client.secrets.transit.read_key(name, mount_point=self.mount),
        )
        data = self._field(reply, "data")
        if not isinstance(data, dict):
            raise KmsError(f"{self.url} did not answer as OpenBao does (PROOFPLANE_KMS_URL)",
                           details={"url": self.url})  # fmt: skip
        return data

    def _typed(self, handle: bytes, purpose: str) -> str:
        """The transit key of ``handle``, checked (once per process) to exist with the type
        of ``purpose``: transit would create a missing key on encrypt."""
        name = self._name(handle)
        ktype = self._known.get(name)
        if ktype is None:
            try:
                ktype = str(self._read_key(name)["type"])
            except KmsError as exc:
                if (exc.details or {}).get("status") == 404:
                    raise KmsError(f"the transit key {name} does not exist in OpenBao at "
                                   f"{self.url} (destroyed?)", code="kms_key_missing",
                                   details={"url": self.url, "key": name}) from None  # fmt: skip
                raise
            self._known[name] = ktype
        if ktype != KEY_TYPES[purpose]:
            raise KmsError(
                f"the transit key {name} is {ktype}, not a {purpose} key",
                code="key_wrong_purpose",
                details={"key": name},
            )
        return name

    # --- Backend --------------------------------------------------------------------------------

    def generate(self, purpose: str, label: str) -> bytes:
        if purpose not in PURPOSES:
            raise KmsError(f"unknown key purpose {purpose!r}", code="key_wrong_purpose")
        name = KEY_PREFIX + label
        if not _NAME.fullmatch(name):
            raise KmsError(f"{label!r} cannot name a transit key", code="invalid_key_name")
        ktype = KEY_TYPES[purpose]
        transit = self._client.secrets.transit
        self._call(
            f"create the transit key {name}",
            lambda: transit.create_key(name, key_type=ktype, exportable=False,
                                       allow_plaintext_backup=False, mount_point=self.mount),
        )  # fmt: skip
        # Creating a key that exists is no error in transit, and keeps the existing key as it
        # is: use it only when it is what we would have made (a retry after a rolled-back
        # transaction finds its own orphan), never another type or an exportable one.
        info = self._read_key(name)
        if info.get("type") != ktype or info.get("exportable") or info.get("derived"):
            raise KmsError(
                f"the transit key {name} already exists in OpenBao at {self.url} and is not "
                f"a non-exportable {ktype} key: another installation's? (PROOFPLANE_KMS_MOUNT)",
                code="kms_key_conflict",
                details={"url": self.url, "key": name},
            )
        self._known[name] = ktype
        return HANDLE_PREFIX + name.encode("ascii")

    def wrap(self, handle: bytes, data_key: bytes, aad: bytes) -> bytes:
        name = self._typed(handle, ENCRYPT)
        reply = self._call(
            f"encrypt with the transit key {name}",
            lambda: self._client.secrets.transit.encrypt_data(
                name, plaintext=_b64(data_key), associated_data=_b64(aad),
                mount_point=self.mount),
        )  # fmt: skip
        return str(self._field(reply, "data", "ciphertext")).encode("ascii")

    def unwrap(self, handle: bytes, wrapped: bytes, aad: bytes) -> bytes:
        name = self._name(handle)
        try:
            ciphertext = wrapped.decode("ascii")
        except UnicodeDecodeError:
            raise DecryptFailed("the data key does not unwrap (not a transit ciphertext)") from None
        if not ciphertext.startswith("vault:v"):
            raise DecryptFailed("the data key does not unwrap (not a transit ciphertext)")
        reply = self._call(
            f"decrypt with the transit key {name}",
            lambda: self._client.secrets.transit.decrypt_data(
                name, ciphertext=ciphertext, associated_data=_b64(aad), mount_point=self.mount),
            decrypt=True,
        )  # fmt: skip
        try:
            return base64.b64decode(reply["data"]["plaintext"], validate=True)
        except (binascii.Error, ValueError, KeyError, TypeError):
            raise DecryptFailed("the data key does not unwrap") from None

    def sign(self, handle: bytes, message: bytes) -> bytes:
        name = self._typed(handle, SIGN)
        reply = self._call(
            f"sign with the transit key {name}",
            lambda: self._client.secrets.transit.sign_data(
                name, hash_input=_b64(message), key_version=SIGN_VERSION,
                mount_point=self.mount),
        )  # fmt: skip
        text = str(self._field(reply, "data", "signature"))
        prefix, _, body = text.rpartition(":")
        try:
            signature = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            signature = b""
        if not prefix.startswith("vault:v") or len(signature) != 64:
            raise KmsError(f"OpenBao at {self.url} returned a malformed Ed25519 signature",
                           details={"url": self.url, "key": name})  # fmt: skip
        return signature

    def public_key(self, handle: bytes) -> bytes:
        name = self._typed(handle, SIGN)
        info = self._read_key(name)
        try:
            raw = base64.b64decode(info["keys"][str(SIGN_VERSION)]["public_key"], validate=True)
        except (binascii.Error, ValueError, KeyError, TypeError):
            raw = b""
        if len(raw) != 32:
            raise KmsError(f"OpenBao at {self.url} returned no Ed25519 public key for {name}",
                           details={"url": self.url, "key": name})  # fmt: skip
        return raw

    def destroy(self, handle: bytes) -> None:
        name = self._name(handle)
        transit = self._client.secrets.transit
        try:
            self._read_key(name)
        except KmsError as exc:
            if (exc.details or {}).get("status") == 404:  # already gone (another replica's)
                self._known.pop(name, None)
                return
            raise
        self._call(
            f"allow deleting the transit key {name}",
            lambda: transit.update_key_configuration(
                name, deletion_allowed=True, mount_point=self.mount),
        )  # fmt: skip
        self._call(
            f"delete the transit key {name}",
            lambda: transit.delete_key(name, mount_point=self.mount),
        )
        self._known.pop(name, None)

    def check(self) -> None:
        status = self._call("read the seal status", self._client.sys.read_seal_status)
        if not isinstance(status, dict):
            raise KmsError(f"{self.url} did not answer as OpenBao does (PROOFPLANE_KMS_URL)",
                           details={"url": self.url})  # fmt: skip
        if not status.get("initialized", False):
            raise KmsUnavailable(f"OpenBao at {self.url} is not initialized",
                                 details={"url": self.url})  # fmt: skip
        if status.get("sealed", True):
            raise KmsUnavailable(f"OpenBao at {self.url} is sealed", details={"url": self.url})
        self._call("look up its own token", self._client.auth.token.lookup_self)


_STATUS: dict[type, int] = {
    hvac.exceptions.InvalidRequest: 400,
    hvac.exceptions.Unauthorized: 401,
    hvac.exceptions.Forbidden: 403,
    hvac.exceptions.InvalidPath: 404,
    hvac.exceptions.UnsupportedOperation: 405,
    hvac.exceptions.PreconditionFailed: 412,
    hvac.exceptions.RateLimitExceeded: 429,
    hvac.exceptions.InternalServerError: 500,
    hvac.exceptions.VaultNotInitialized: 501,
    hvac.exceptions.BadGateway: 502,
    hvac.exceptions.VaultDown: 503,
}


def backend_from_env(env: Mapping[str, str]) -> OpenBaoBackend:
    """The backend ``PROOFPLANE_KMS_*`` describe (see the module's docstring)."""
    url = (env.get("PROOFPLANE_KMS_URL") or "").strip()
    if not url:
        raise _invalid("PROOFPLANE_KMS_URL", "not set (the OpenBao server, https://…)")
    token_file = (env.get("PROOFPLANE_KMS_TOKEN_FILE") or "").strip()
    if not token_file:
        raise _invalid("PROOFPLANE_KMS_TOKEN_FILE", "not set (a file holding the token, 0600)")
    mount = (env.get("PROOFPLANE_KMS_MOUNT") or DEFAULT_MOUNT).strip().strip("/")
    if not _MOUNT.fullmatch(mount):
        raise _invalid("PROOFPLANE_KMS_MOUNT", f"{mount!r} is not a mount path")
    ca_file = (env.get("PROOFPLANE_KMS_CA_FILE") or "").strip() or None
    if ca_file is not None and not Path(ca_file).is_file():
        raise _invalid("PROOFPLANE_KMS_CA_FILE", f"{ca_file} is not a file")
    raw_timeout = (env.get("PROOFPLANE_KMS_TIMEOUT") or "").strip()
    timeout = DEFAULT_TIMEOUT
    if raw_timeout:
        try:
            timeout = float(raw_timeout)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= 300:
            raise _invalid("PROOFPLANE_KMS_TIMEOUT", f"{raw_timeout!r} is not 0-300 seconds")
    url = check_url(url)
    return OpenBaoBackend(url, read_token(token_file), mount=mount, ca_file=ca_file,
                          timeout=timeout)  # fmt: skip
