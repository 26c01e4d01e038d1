"""Where a sink may connect: host names resolved and every address checked (issue 19, §5).

The rule itself is pure (``proofplane.audit.export.config.refusal``: loopback, link-local,
unspecified and metadata addresses are refused unless allow-listed); this module does the
I/O half. A host is checked twice: when the sink is configured (``check``: a name that
resolves to a refused address is a 422, a name that does not resolve yet is accepted) and at
every connection (``connect_addresses``: the transport then connects to the addresses it
checked, never to a second resolution a DNS-rebinding server could answer differently).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from proofplane.audit.export.config import (
    SinkPolicy,
    check_literal_host,
    forbidden,
    literal_address,
    refusal,
)
from proofplane.errors import ProofplaneError


class DestinationRefused(ProofplaneError):
    """A sink's host resolved to an address it may not connect to."""

    code = "forbidden_sink_destination"


class Unresolvable(ProofplaneError):
    """A sink's host name does not resolve (now)."""

    code = "unresolvable_sink_host"


@dataclass(frozen=True, slots=True)
class Address:
    family: int
    ip: str  # the textual address, without brackets


def resolve(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to (TCP), in the resolver's order."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise Unresolvable(f"cannot resolve {host!r}: {exc}") from exc
    seen: dict[str, Address] = {}
    for family, _type, _proto, _canon, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            ip = str(sockaddr[0]).split("%", 1)[0]
            seen.setdefault(ip, Address(family, ip))
    if not seen:
        raise Unresolvable(f"{host!r} has no IPv4 or IPv6 address")
    return list(seen.values())


def connect_addresses(host: str, port: int, policy: SinkPolicy) -> list[Address]:
    """The addresses to connect to for ``host``: all of them checked; one refused address
    refuses the host (a name that answers both a public and a loopback address is a rebinding
    attempt, or a mistake)."""
    addresses = resolve(host, port)
    for address in addresses:
        why = refusal(ipaddress.ip_address(address.ip), host, policy)
        if why is not None:
            shown = host if literal_address(host) else f"{host} ({address.ip})"
            raise DestinationRefused(
                f"sink destination {shown} is {why}; allow it with PROOFPLANE_SINK_ALLOW_HOSTS"
            )
    return addresses


def check(host: str, port: int, policy: SinkPolicy) -> None:
    """At configuration: ValidationFailed when ``host`` is, or resolves to, a refused address.
    A name that does not resolve now passes (it is checked again at every connection)."""
    check_literal_host(host, policy)
    try:
        addresses = resolve(host, port)
    except Unresolvable:
        return
    for address in addresses:
        why = refusal(ipaddress.ip_address(address.ip), host, policy)
        if why is not None:
            raise forbidden(host, f"{why} ({address.ip})")


def open_connection(host: str, port: int, policy: SinkPolicy, timeout_s: float) -> socket.socket:
    """A TCP connection to the first checked address of ``host`` that answers."""
    last: OSError | None = None
    for address in connect_addresses(host, port, policy):
        try:
            return socket.create_connection((address.ip, port), timeout=timeout_s)
        except OSError as exc:
            last = exc
    assert last is not None
    raise last
