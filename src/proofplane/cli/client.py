"""A small synchronous client for the proofplane HTTP API, used by the CLI's client commands.

Every method returns the parsed JSON body or raises a ``CliError`` whose ``exit_code`` the CLI
exits with: 3 when the server cannot be reached, 1 when the API answered with an error, 2 when
the request could not even be built (a malformed ``--server`` URL or ``--token``).

A client built with a ``token`` sends it as ``Authorization: Bearer``; a 401 answer carries a
hint to log in (unless the client is the login command's own).

A server that is overloaded answers 429 (or 503) with ``Retry-After``: the client waits that
long (plus jitter, longer on each try) and asks again, at most :data:`RETRY_BUDGET_S` seconds in
all, for a request that may be repeated: a read (``GET``), or any request the server refused
before running it (its overload refusal, ``too_many_requests``: a node agent's evidence round
too, whose nonce stays unused). Then it gives up with one line saying so.

An ``https://`` server is verified against ``ca_file`` (the global ``--ca-file`` /
``PROOFPLANE_CA_FILE``; httpx's default CAs without one). A certificate that does not verify is
"cannot reach" (exit 3) with the hint to pass the server's CA.
"""

from __future__ import annotations

import json
import random
import re
import ssl
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import click
import httpx

from proofplane.errors import ValidationFailed
from proofplane.pki import tls

DEFAULT_SERVER = "http://127.0.0.1:8470"
TIMEOUT_S = 10.0

#: Overload (issue 20, §4): at most this many seconds of waiting on 429/503 per request, over
#: at most ``RETRY_TRIES`` tries; each wait is the server's Retry-After (or ``RETRY_BASE_S``),
#: doubled on every try, plus up to half again of jitter.
RETRY_BUDGET_S = 30.0
RETRY_TRIES = 6
RETRY_BASE_S = 0.5
#: The server's "refused before running it": any request may be repeated after it.
OVERLOAD_CODE = "too_many_requests"
_RETRY_STATUSES = frozenset({429, 503})
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})

EXIT_API_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

LOGIN_HINT = "run 'proofplane login' (or pass --token / set PROOFPLANE_TOKEN)"
ENROLL_HINT = "run 'proofplane mfa enroll' to set up your authenticator, then log in again"


class CliError(Exception):
    """An error the CLI reports as a message (plus optional detail lines) and an exit code."""

    def __init__(self, message: str, *, lines: list[str] | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.lines = lines or []
        self.exit_code = exit_code


CA_HINT = "pass the CA that signed the server's certificate with --ca-file / PROOFPLANE_CA_FILE"
START_HINT = "start it with 'proofplane up' or set --server / PROOFPLANE_SERVER"


class ServerUnreachable(CliError):
    def __init__(self, server: str, why: str, hint: str = START_HINT) -> None:
        super().__init__(
            f"proofplane: cannot reach the proofplane server at {server} ({why}); {hint}",
            exit_code=EXIT_UNREACHABLE,
        )
        self.server = server
        self.why = why


def unreachable(server: str, exc: httpx.TransportError) -> ServerUnreachable:
    """The CliError for a transport failure, with the hint that fits it: a TLS failure names
    what to change (the CA, the scheme), anything else how to start or name the server."""
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        reason = text.split("certificate verify failed:", 1)[-1].split("(_ssl.c", 1)[0].strip()
        why = f"certificate verify failed: {reason}" if reason else "certificate verify failed"
        return ServerUnreachable(server, why, CA_HINT)
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return ServerUnreachable(
            server,
            "the TLS handshake failed: the server does not speak TLS on this port",
            "use an http:// --server URL, or start the server with TLS",
        )
    if "CERTIFICATE_REQUIRED" in text or "HANDSHAKE_FAILURE" in text:
        return ServerUnreachable(
            server,
            "the server refused the TLS handshake (it may require a client certificate)",
            "the CLI cannot present one yet; reach the API through an endpoint without "
            "--tls-client-ca",
        )
    return ServerUnreachable(server, _why(exc))


def invocation_ca_file() -> str | None:
    """The global ``--ca-file`` of the running CLI invocation (None outside one)."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    value = getattr(obj, "ca_file", None)
    return value if isinstance(value, str) and value else None


def verify_context(ca_file: str) -> ssl.SSLContext:
    """The context a client verifies servers with: ``ca_file``'s CAs only (like curl's
    ``--cacert``), TLS 1.2+; an unreadable or malformed file is a usage error (exit 2)."""
    try:
        tls.check_ca_file(ca_file, "CA file")
        return tls.client_context(ca_file)
    except ValidationFailed as exc:
        raise CliError(f"proofplane: --ca-file: {exc.message}", exit_code=EXIT_USAGE) from exc
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"proofplane: --ca-file {ca_file}: {exc}", exit_code=EXIT_USAGE) from exc


class ApiError(CliError):
    """The API answered with an error status; ``code`` is its machine-readable error code."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        # A detail that only repeats the message (a single validation problem) is left out.
        lines = [line for line in format_details(details) if line.lstrip(" -") != message]
        super().__init__(f"error ({code}): {message}", lines=lines, exit_code=EXIT_API_ERROR)
        self.status = status
        self.code = code
        self.api_message = message
        self.details = details


def segment(value: str | int) -> str:
    """One URL path segment, percent-encoded (a name can never reach another route)."""
    return quote(str(value), safe="")


def format_details(details: Any) -> list[str]:
    """Error details as short indented lines: one per validation problem or per key."""
    if details is None or details == {} or details == []:
        return []
    if isinstance(details, str):
        return [f"  {line}" for line in details.splitlines() if line.strip()]
    if isinstance(details, list):
        return [f"  - {_detail_item(item)}" for item in details]
    if isinstance(details, dict):
        out = []
        for key, value in details.items():
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                out.append(f"  {key}: " + "; ".join(value))
            else:
                out.append(f"  {key}: {_compact(value)}")
        return out
    return [f"  {_compact(details)}"]


def _detail_item(item: Any) -> str:
    if isinstance(item, dict) and "msg" in item:
        loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
        return f"{loc}: {item['msg']}" if loc else str(item["msg"])
    return item if isinstance(item, str) else _compact(item)


def _compact(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "), default=str)


def _why(exc: httpx.TransportError) -> str:
    """A short reason for a transport failure: 'connection refused', 'timed out after 10s'…"""
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out after {TIMEOUT_S:g}s"
    text = str(exc) or type(exc).__name__
    if "refused" in text.lower():
        return "connection refused"
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", text.splitlines()[0]).strip()
    return text[:1].lower() + text[1:] if text else type(exc).__name__


def retry_after_s(resp: httpx.Response, now: float | None = None) -> float | None:
    """The answer's ``Retry-After`` in seconds (a number, or an HTTP date), else None."""
    raw = resp.headers.get("retry-after", "").strip()
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def may_retry(method: str, resp: httpx.Response) -> bool:
    """Whether ``resp`` asks to come back later for a request that may be sent again: a 429 or
    503 with ``Retry-After`` to a read, or the server's overload refusal to any request (it
    never ran: the body says ``too_many_requests``)."""
    if resp.status_code not in _RETRY_STATUSES or "retry-after" not in resp.headers:
        return False
    if method.upper() in _IDEMPOTENT:
        return True
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") == OVERLOAD_CODE


def backoff_s(resp: httpx.Response, tries: int, rng: Callable[[], float] = random.random) -> float:
    """How long to wait before try ``tries + 1``: at least the server's Retry-After, doubled
    for every try after the first, plus up to half again of jitter (so the clients a refusal
    sent away do not all come back in the same instant)."""
    base = max(retry_after_s(resp) or RETRY_BASE_S, RETRY_BASE_S)
    return base * 2 ** (tries - 1) * (1 + 0.5 * rng())


class ApiClient:
    """get/post/patch/delete against ``server``; each returns parsed JSON or raises CliError."""

    #: How the client waits between tries (tests replace it).
    sleep: Callable[[float], None] = staticmethod(time.sleep)

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        timeout: float = TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        auth_hints: bool = True,
        ca_file: str | None = None,
        client_cert: tuple[str, str] | None = None,
    ) -> None:
        """``ca_file``: verify an https server against these CAs (default: the invocation's
        global ``--ca-file`` / PROOFPLANE_CA_FILE; without one, httpx's default CAs).
        ``client_cert``: (certificate, key) files to show the server (mutual TLS: a node
        agent's channel certificate)."""
        self.server = server.rstrip("/") or server
        self.auth_hints = auth_hints
        headers = {"Accept": "application/json", "User-Agent": "proofplane-cli"}
        if token is not None:
            token = token.strip()
            if not token or not token.isprintable() or any(c.isspace() for c in token):
                raise CliError(
                    "proofplane: the token is empty or contains spaces or control characters",
                    exit_code=EXIT_USAGE,
                )
            headers["Authorization"] = f"Bearer {token}"
        verify: ssl.SSLContext | bool = True  # httpx's default: the certifi CAs
        ca_file = ca_file or (invocation_ca_file() if transport is None else None)
        if ca_file:
            verify = verify_context(ca_file)
        if client_cert is not None:
            try:
                verify = tls.client_context(ca_file or None, *client_cert)
            except (OSError, ssl.SSLError) as exc:
                raise CliError(
                    f"proofplane: cannot load the client certificate {client_cert[0]}: {exc}",
                    exit_code=EXIT_USAGE,
                ) from exc
        try:
            self._http = httpx.Client(
                base_url=self.server,
                timeout=timeout,
                transport=transport,
                headers=headers,
                verify=verify,
            )
        except (httpx.InvalidURL, ValueError, TypeError) as exc:
            raise CliError(
                f"proofplane: invalid --server URL {server!r}: {exc}", exit_code=EXIT_USAGE
            ) from exc

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body=body)

    def text(self, method: str, path: str) -> str:
        """A ``text/plain`` endpoint (signed notes, keys): the body, or CliError."""
        resp, gave_up = self._send(method, path, headers={"Accept": "text/plain"})
        if resp.is_success:
            return resp.text
        self._parse(resp, gave_up)
        raise AssertionError("unreachable")  # _parse raises for every non-success

    def content(self, path: str, params: dict[str, Any] | None = None) -> bytes:
        """A ``GET`` answered with a body to pass on as it is (a CSV export): its bytes, or
        CliError."""
        clean = {k: v for k, v in (params or {}).items() if v is not None and v != []}
        resp, gave_up = self._send("GET", path, params=clean, headers={"Accept": "*/*"})
        if resp.is_success:
            return resp.content
        self._parse(resp, gave_up)
        raise AssertionError("unreachable")  # _parse raises for every non-success

    def patch(self, path: str, body: Any = None) -> Any:
        return self.request("PATCH", path, body=body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        clean = {k: v for k, v in (params or {}).items() if v is not None and v != []}
        return self._parse(*self._send(method, path, params=clean, json=body))

    def _send(
        self, method: str, path: str, **kw: Any
    ) -> tuple[httpx.Response, tuple[int, float] | None]:
        """The server's answer, asking again (after a wait) while it says it is overloaded and
        the request may be repeated (:func:`may_retry`), within the retry budget; with (tries,
        seconds waited) when it gave up on an overloaded server."""
        waited = 0.0
        tries = 0
        while True:
            tries += 1
            try:
                resp = self._http.request(method, path, **kw)
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
                raise CliError(
                    f"proofplane: invalid --server URL {self.server!r}: {exc}",
                    exit_code=EXIT_USAGE,
                ) from exc
            except httpx.TransportError as exc:
                raise unreachable(self.server, exc) from exc
            if not may_retry(method, resp):
                return resp, None
            wait = min(backoff_s(resp, tries), RETRY_BUDGET_S - waited)
            if tries >= RETRY_TRIES or wait < (retry_after_s(resp) or 0.0) or wait <= 0:
                return resp, (tries, waited)
            self.sleep(wait)
            waited += wait

    def pages(self, path: str, params: dict[str, Any], *, follow: bool) -> Iterator[dict[str, Any]]:
        """The pages of a list endpoint, starting at ``params['cursor']``; with ``follow``, keep
        requesting the ``next`` cursor until the last page."""
        params = dict(params)
        while True:
            page = self.get(path, params)
            if not isinstance(page, dict) or not isinstance(page.get("items"), list):
                raise CliError(
                    f"proofplane: the server at {self.server} answered {path} with an unexpected "
                    "body (is it a proofplane server?)"
                )
            yield page
            if not follow or not page.get("next"):
                return
            params["cursor"] = page["next"]

    def _parse(self, resp: httpx.Response, gave_up: tuple[int, float] | None = None) -> Any:
        if resp.is_success:
            if resp.status_code == 204 or not resp.content:
                return None
            try:
                return resp.json()
            except ValueError as exc:
                raise CliError(
                    f"proofplane: the server at {self.server} did not answer with JSON "
                    f"(HTTP {resp.status_code}, {resp.headers.get('content-type', 'no type')}); "
                    "is it a proofplane server?"
                ) from exc
        try:
            data = resp.json()
        except ValueError:
            data = None
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and isinstance(err.get("code"), str):
            error = ApiError(
                resp.status_code, err["code"], str(err.get("message", "")), err.get("details")
            )
        else:
            error = ApiError(resp.status_code, f"HTTP {resp.status_code}", _summary(resp, data))
        if gave_up is not None:  # one line: what the server said, and how long we tried
            tries, waited = gave_up
            error.message += (
                f" (the server is overloaded: gave up after {tries} tries over {waited:.0f} s;"
                " try again later)"
            )
            error.lines = []
        if self.auth_hints and resp.status_code == 401:
            error.lines.append(f"hint: {LOGIN_HINT}")
        elif self.auth_hints and error.code == "mfa_enrollment_required":
            error.lines.append(f"hint: {ENROLL_HINT}")
        raise error


def _summary(resp: httpx.Response, data: Any) -> str:
    """A one-line description of an error body that is not the API's error shape (a proxy's
    HTML page, a plain-text message, someone else's JSON)."""
    reason = resp.reason_phrase or "error"
    if data is not None:
        text = _compact(data)
    else:
        text = re.sub(r"<[^>]+>", " ", resp.text)  # an HTML error page: keep its words
        text = " ".join(text.split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{reason}: {text}" if text and text != reason else reason
