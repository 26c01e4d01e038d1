"""OpenSM ``partitions.conf`` for the InfiniBand fabric, and a parser of ours for its grammar.

The subnet manager enforces partitions in the HCAs' and switches' PKey tables: a port talks
only to ports sharing a partition, and two *limited* members of a partition cannot talk to
each other (only to its full members). So:

* the default partition ``0x7fff`` holds every port as a limited member (``ALL=limited``) and
  only the subnet manager (``SELF``) and the management GUIDs as full members: the fabric is
  managed, tenants' ports cannot reach each other through it;
* every tenant segment gets a partition ``tenant_<name>`` (``tenant_<name>__<workload>`` in
  per-workload mode) with its PKey, ``ipoib`` (a broadcast group for IPoIB) and
  ``defmember=limited``, its members the HCA port GUIDs of the nodes that run its work, as
  full members.

(A node running work of two tenants is a member of both partitions: per-tenant isolation on
one host needs per-workload ports, e.g. SR-IOV virtual functions, each with its own GUID.)

The grammar, after opensm(8) "Partition Definition"::

    [PartitionName][=PKey][,flag]...[,defmember=full|limited|both] : [member[,member]...] ;
    member := (PortGUID | ALL | ALL_CAS | ALL_SWITCHES | ALL_ROUTERS | SELF | NONE)
              [=full|=limited|=both]
    flag   := ipoib | indx0 | mtu=N | rate=N | sl=N | scope=N | Q_Key=N | TClass=N | FlowLabel=N

Whitespace is allowed around the delimiters, ``#`` starts a comment, a ``\\`` at the end of a
line continues it. :func:`parse_partitions` is stricter than OpenSM (which ignores what it does
not understand, and accepts prefixes of keywords): an unknown flag or membership, a missing
``:`` or ``;``, an empty member, a PKey out of range is a :class:`PartitionsSyntaxError` with
the line. A definition may run over several lines until its ``;`` (as OpenSM reads it).
Multicast group definitions (``mgid=…``) are not supported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proofplane.errors import ValidationFailed
from proofplane.network.desired import NetworkIndex, normalize_guid
from proofplane.network.segments import DEFAULT_PKEY

__all__ = [
    "KEYWORDS",
    "Member",
    "Partition",
    "PartitionsSyntaxError",
    "default_partition",
    "parse_partitions",
    "partition_name",
    "partitions_for",
    "render_partitions",
]

KEYWORDS = ("ALL", "ALL_CAS", "ALL_SWITCHES", "ALL_ROUTERS", "SELF", "NONE")
MEMBERSHIPS = ("full", "limited", "both")
_VALUE_FLAGS = ("mtu", "rate", "sl", "scope", "Q_Key", "TClass", "FlowLabel")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_HEX = re.compile(r"^0[xX][0-9a-fA-F]{1,16}$")
_DEC = re.compile(r"^[0-9]{1,20}$")
MEMBERS_PER_LINE = 4


class PartitionsSyntaxError(ValidationFailed, ValueError):
    """422: the text is not a partitions.conf this parser accepts (``details.line``)."""

    code = "invalid_partitions"


@dataclass(frozen=True, slots=True)
class Member:
    """A port (``0x`` + 16 hex digits) or a keyword, with its membership (None: the
    partition's ``defmember``, limited if unset)."""

    guid: str
    membership: str | None = None


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition definition."""

    name: str
    pkey: int | None
    flags: tuple[str, ...] = ()
    defmember: str | None = None
    members: tuple[Member, ...] = ()


def partition_name(tenant: str, workload: str | None = None) -> str:
    """``tenant_<tenant>``, or ``tenant_<tenant>__<workload key>`` with every character the
    grammar does not allow in a name as ``.`` (a name need not be unique: the PKey is)."""
    if not workload:
        return f"tenant_{tenant}"
    return f"tenant_{tenant}__{_UNSAFE.sub('.', workload)}"


def default_partition(management_guids: Iterable[str] = ()) -> Partition:
    """``Default=0x7fff, ipoib : ALL=limited, SELF=full, <management>=full``."""
    mgmt = sorted({normalize_guid(g) for g in management_guids})
    members = (Member("ALL", "limited"), Member("SELF", "full"), *(Member(g, "full") for g in mgmt))
    return Partition("Default", DEFAULT_PKEY, ("ipoib",), None, members)


def partitions_for(
    index: NetworkIndex, *, management_guids: Iterable[str] = ()
) -> tuple[Partition, ...]:
    """The fabric's partitions: the default one, then one per segment (by PKey) with the HCA
    GUIDs of the nodes that carry it."""
    out = [default_partition(management_guids)]
    for seg in sorted(index.segments.values(), key=lambda s: (s.pkey, s.vni)):
        guids = sorted(
            {normalize_guid(g) for n in index.nodes_of(seg.vni) for g in index.nodes[n].hca_guids}
        )
        out.append(
            Partition(
                partition_name(seg.tenant, seg.workload),
                seg.pkey,
                ("ipoib",),
                "limited",
                tuple(Member(g, "full") for g in guids),
            )
        )
    return tuple(out)


def _member_text(m: Member) -> str:
    return m.guid + (f"={m.membership}" if m.membership else "")


def _definition(p: Partition) -> str:
    head = p.name + (f"=0x{p.pkey:04x}" if p.pkey is not None else "")
    head += "".join(f", {f}" for f in p.flags)
    if p.defmember:
        head += f", defmember={p.defmember}"
    members = [_member_text(m) for m in p.members]
    if len(members) <= MEMBERS_PER_LINE:
        return f"{head} : {', '.join(members)};" if members else f"{head} : ;"
    rows = [
        ", ".join(members[i : i + MEMBERS_PER_LINE])
        for i in range(0, len(members), MEMBERS_PER_LINE)
    ]
    return f"{head} : \\\n\t" + ", \\\n\t".join(rows) + ";"


def render_partitions(partitions: Sequence[Partition]) -> str:
    """The partitions.conf text (deterministic; long member lists continued with ``\\``)."""
    lines = ["# proofplane: OpenSM partitions.conf (generated; one partition per segment)"]
    lines.extend(_definition(p) for p in partitions)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- parser
def _error(message: str, line: int, text: str) -> PartitionsSyntaxError:
    return PartitionsSyntaxError(
        f"partitions.conf line {line}: {message}: {text.strip()[:80]!r}",
        details={"line": line, "text": text.strip()[:200]},
    )


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first physical line number, text) with comments removed and continuations joined."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        cont = line.endswith("\\")
        if cont:
            line = line[:-1]
        pending = (number, line) if pending is None else (pending[0], f"{pending[1]} {line}")
        if not cont:
            out.append(pending)
            pending = None
    if pending is not None:
        raise _error("a continuation '\\' at the end of the file", pending[0], pending[1])
    return out


def _parse_pkey(text: str, line: int, src: str) -> int:
    if not (_HEX.fullmatch(text) or _DEC.fullmatch(text)):
        raise _error(f"PKey {text!r} is not a number", line, src)
    value = int(text, 16) if text.lower().startswith("0x") else int(text)
    if not 0 < value <= 0xFFFF or value & 0x7FFF == 0:
        raise _error(f"PKey {text!r} is out of range (0x0001..0x7fff, 15 bits)", line, src)
    return value & 0x7FFF


def _parse_header(text: str, line: int, src: str) -> tuple[str, int | None, list[str], str | None]:
    parts = [p.strip() for p in text.split(",")]
    first = parts[0]
    name, eq, pkey_text = (s.strip() for s in first.partition("="))
    if not name or not _NAME.fullmatch(name):
        raise _error(f"partition name {name!r} is not [A-Za-z0-9_.-]+", line, src)
    pkey = _parse_pkey(pkey_text, line, src) if eq else None
    flags: list[str] = []
    defmember = None
    for flag in parts[1:]:
        key, eq, value = (s.strip() for s in flag.partition("="))
        if not key:
            raise _error("an empty flag", line, src)
        if key == "defmember" and eq:
            if value not in MEMBERSHIPS:
                raise _error(f"defmember={value!r}: full, limited or both", line, src)
            defmember = value
        elif key in ("ipoib", "indx0") and not eq:
            flags.append(key)
        elif key in _VALUE_FLAGS and eq and (_DEC.fullmatch(value) or _HEX.fullmatch(value)):
            flags.append(f"{key}={value.lower()}")
        else:
            raise _error(f"unknown flag {flag!r}", line, src)
    return name, pkey, flags, defmember


def _parse_member(text: str, line: int, src: str) -> Member:
    guid, eq, membership = (s.strip() for s in text.partition("="))
    if not guid:
        raise _error("an empty member", line, src)
    if eq and membership not in MEMBERSHIPS:
        raise _error(f"membership {membership!r}: full, limited or both", line, src)
    if guid in KEYWORDS:
        port = guid
    elif _HEX.fullmatch(guid):
        port = f"0x{int(guid, 16):016x}"
    elif _DEC.fullmatch(guid) and int(guid) < 1 << 64:
        port = f"0x{int(guid):016x}"
    else:
        raise _error(f"member {guid!r} is not a port GUID or {'/'.join(KEYWORDS)}", line, src)
    return Member(port, membership if eq else None)


def parse_partitions(text: str) -> tuple[Partition, ...]:
    """The definitions of a partitions.conf, in order (see the module docstring for the
    grammar); :class:`PartitionsSyntaxError` on anything else."""
    out: list[Partition] = []
    stmt: list[tuple[int, str]] = []  # the pieces of the definition being read
    for number, line in _logical_lines(text):
        rest = line
        while rest:
            head, semi, rest = rest.partition(";")
            if head.strip():
                stmt.append((number, head))
            if not semi:
                break
            if not stmt:
                raise _error("an empty definition (';' alone)", number, line)
            first = stmt[0][0]
            src = " ".join(s for _, s in stmt)
            stmt = []
            header, colon, members_text = src.partition(":")
            if not colon:
                raise _error("a definition without ':' between the partition and its ports",
                             first, src)  # fmt: skip
            if ":" in members_text:
                raise _error("more than one ':' in a definition", first, src)
            name, pkey, flags, defmember = _parse_header(header, first, src)
            members: list[Member] = []
            if members_text.strip():
                members = [_parse_member(m, first, src) for m in members_text.split(",")]
            out.append(Partition(name, pkey, tuple(flags), defmember, tuple(members)))
    if stmt:
        raise _error("a definition without its closing ';'", stmt[0][0], stmt[0][1])
    return tuple(out)
