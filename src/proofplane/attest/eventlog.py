"""TCG PC Client firmware event logs: parse, decode the events policy needs, replay to PCRs.

Two on-disk formats (TCG PC Client Platform Firmware Profile, §10):

* **SHA-1 (TCG 1.2 style)**: every event is ``TCG_PCClientPCREvent`` — pcrIndex u32, eventType
  u32, a 20-byte SHA-1 digest, eventSize u32, event data (little-endian throughout).
* **crypto-agile**: the first event is still in the SHA-1 format, an EV_NO_ACTION whose data is
  the ``TCG_EfiSpecIdEvent`` ("Spec ID Event03") listing the hash algorithms and their digest
  sizes; every later event is a ``TCG_PCR_EVENT2`` carrying one digest per algorithm.

Replay: each PCR starts at zero (PCR 0 at ``0…0‖locality`` when an EV_NO_ACTION
"StartupLocality" event says the TPM was started from locality 3 or 4) and is extended with
``PCR := H(PCR ‖ digest)``. EV_NO_ACTION events are never extended, and neither are events with
the virtual PCR index 0xFFFFFFFF that Windows logs carry. Malformed input raises
:class:`EventLogError` with a reason; nothing here trusts a length without checking it.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from proofplane.attest.errors import EventLogError

EV_PREBOOT_CERT: Final = 0x00000000
EV_POST_CODE: Final = 0x00000001
EV_NO_ACTION: Final = 0x00000003
EV_SEPARATOR: Final = 0x00000004
EV_ACTION: Final = 0x00000005
EV_EVENT_TAG: Final = 0x00000006
EV_S_CRTM_CONTENTS: Final = 0x00000007
EV_S_CRTM_VERSION: Final = 0x00000008
EV_CPU_MICROCODE: Final = 0x00000009
EV_PLATFORM_CONFIG_FLAGS: Final = 0x0000000A
EV_TABLE_OF_DEVICES: Final = 0x0000000B
EV_COMPACT_HASH: Final = 0x0000000C
EV_IPL: Final = 0x0000000D
EV_IPL_PARTITION_DATA: Final = 0x0000000E
EV_NONHOST_CODE: Final = 0x0000000F
EV_NONHOST_CONFIG: Final = 0x00000010
EV_NONHOST_INFO: Final = 0x00000011
EV_OMIT_BOOT_DEVICE_EVENTS: Final = 0x00000012
EV_EFI_EVENT_BASE: Final = 0x80000000
EV_EFI_VARIABLE_DRIVER_CONFIG: Final = 0x80000001
EV_EFI_VARIABLE_BOOT: Final = 0x80000002
EV_EFI_BOOT_SERVICES_APPLICATION: Final = 0x80000003
EV_EFI_BOOT_SERVICES_DRIVER: Final = 0x80000004
EV_EFI_RUNTIME_SERVICES_DRIVER: Final = 0x80000005
EV_EFI_GPT_EVENT: Final = 0x80000006
EV_EFI_ACTION: Final = 0x80000007
EV_EFI_PLATFORM_FIRMWARE_BLOB: Final = 0x80000008
EV_EFI_HANDOFF_TABLES: Final = 0x80000009
EV_EFI_PLATFORM_FIRMWARE_BLOB2: Final = 0x8000000A
EV_EFI_HANDOFF_TABLES2: Final = 0x8000000B
EV_EFI_VARIABLE_BOOT2: Final = 0x8000000C
EV_EFI_HCRTM_EVENT: Final = 0x80000010
EV_EFI_VARIABLE_AUTHORITY: Final = 0x800000E0
EV_EFI_SPDM_FIRMWARE_BLOB: Final = 0x800000E1
EV_EFI_SPDM_FIRMWARE_CONFIG: Final = 0x800000E2

EVENT_TYPE_NAMES: Final[dict[int, str]] = {
    v: k for k, v in globals().items() if k.startswith("EV_") and isinstance(v, int)
}

#: TCG algorithm id → (bank name, digest size, hashlib name)
_ALGS: Final[dict[int, tuple[str, int, str]]] = {
    0x0004: ("sha1", 20, "sha1"),
    0x000B: ("sha256", 32, "sha256"),
    0x000C: ("sha384", 48, "sha384"),
    0x000D: ("sha512", 64, "sha512"),
    0x0012: ("sm3_256", 32, "sm3"),
}
WINDOWS_VIRTUAL_PCR: Final = 0xFFFFFFFF
MAX_PCR: Final = 23
EFI_GLOBAL_VARIABLE: Final = uuid.UUID("8be4df61-93ca-11d2-aa0d-00e098032b8c")
EFI_IMAGE_SECURITY_DATABASE: Final = uuid.UUID("d719b2cb-3d3a-4596-a3bc-dad00e67656f")
MAX_EVENTS: Final = 100_000  # more events than this: eventlog_too_long
MAX_EVENT_SIZE: Final = 16 * 1024 * 1024  # the largest eventSize accepted

_U32 = struct.Struct("<I")
_HDR2 = struct.Struct("<III")  # pcrIndex, eventType, digest count (crypto-agile)
#: pcrIndex, eventType, sha1 digest, eventSize: the SHA-1 format's header (and every log's first)
SHA1_EVENT_HEADER: Final = struct.Struct("<II20sI")
_U16 = struct.Struct("<H")


class Event(NamedTuple):
    """One measured event. ``digests`` maps bank name → digest bytes (a NamedTuple: logs have
    hundreds of events and the verifier parses one per attestation, so construction is hot)."""

    number: int  # position in the log, 0-based
    pcr: int
    type: int
    digests: dict[str, bytes]
    data: bytes

    @property
    def type_name(self) -> str:
        return EVENT_TYPE_NAMES.get(self.type, f"0x{self.type:08x}")

    @property
    def extended(self) -> bool:
        """Whether replay extends this event into a PCR."""
        return self.type != EV_NO_ACTION and self.pcr != WINDOWS_VIRTUAL_PCR


@dataclass(frozen=True, slots=True)
class SpecId:
    """The TCG_EfiSpecIdEvent header of a crypto-agile log."""

    signature: str
    platform_class: int
    version: tuple[int, int, int]  # major, minor, errata
    uintn_size: int
    algorithms: dict[int, int]  # alg id → digest size


@dataclass(frozen=True, slots=True)
class EventLog:
    """A parsed log: its format, the Spec ID header (crypto-agile only) and its events."""

    crypto_agile: bool
    spec_id: SpecId | None
    events: tuple[Event, ...]
    startup_locality: int = 0
    banks: tuple[str, ...] = field(default=("sha1",))

    def replay(self, banks: Iterable[str] | None = None) -> dict[str, dict[int, bytes]]:
        """PCR values per bank after extending every event; see :func:`replay`."""
        return replay(self, banks)


def bank_info(alg: int, size: int | None) -> tuple[str, int]:
    """(bank name, digest size) of TCG algorithm ``alg``; an unknown one is ``alg_0x…`` with
    the declared ``size`` (EventLogError without one, or when a known size is contradicted)."""
    known = _ALGS.get(alg)
    if known is None:
        if size is None:
            raise EventLogError(
                f"unknown digest algorithm 0x{alg:04x}", reason="eventlog_unknown_alg"
            )
        return f"alg_0x{alg:04x}", size
    if size is not None and size != known[1]:
        raise EventLogError(
            f"Spec ID lists {known[0]} with digest size {size}, expected {known[1]}",
            reason="eventlog_bad_spec_id",
        )
    return known[0], known[1]


def parse_spec_id(data: bytes) -> SpecId:
    """The ``TCG_EfiSpecIdEvent`` in the first event's data; EventLogError when malformed."""
    if len(data) < 29:
        raise EventLogError("Spec ID event too short", reason="eventlog_bad_spec_id")
    sig = data[:16].rstrip(b"\0").decode("ascii", "replace")
    platform_class, minor, major, errata, uintn, n = struct.unpack_from("<IBBBBI", data, 16)
    if n == 0 or n > 16 or len(data) < 28 + 4 * n + 1:
        raise EventLogError(f"Spec ID event lists {n} algorithms", reason="eventlog_bad_spec_id")
    algs: dict[int, int] = {}
    for i in range(n):
        alg, size = struct.unpack_from("<HH", data, 28 + 4 * i)
        bank_info(alg, size)
        algs[alg] = size
    vendor_size = data[28 + 4 * n]
    if len(data) != 28 + 4 * n + 1 + vendor_size:
        raise EventLogError(
            "Spec ID event size does not match its content", reason="eventlog_bad_spec_id"
        )
    return SpecId(sig, platform_class, (major, minor, errata), uintn, algs)


def _check_pcr(pcr: int, etype: int, pos: int) -> None:
    if pcr > MAX_PCR and pcr != WINDOWS_VIRTUAL_PCR and etype != EV_NO_ACTION:
        raise EventLogError(
            f"event at offset {pos}: PCR index {pcr} out of range", reason="eventlog_bad_pcr"
        )


def _slow_digests(
    buf: bytes, pos: int, n: int, start: int, count: int, sizes: dict[int, tuple[str, int]]
) -> tuple[dict[str, bytes], int, int]:
    """Digests of an event whose digest list is not the declared one in order: (digests, event
    size, position after the size field)."""
    size = len(buf)
    if count == 0 or count > len(sizes):
        raise EventLogError(
            f"event {n} at offset {start} has {count} digests, the log declares "
            f"{len(sizes)} algorithms",
            reason="eventlog_bad_digest_count",
        )
    digests: dict[str, bytes] = {}
    for _ in range(count):
        if pos + 2 > size:
            raise EventLogError(f"event {n} truncated", reason="eventlog_truncated")
        (alg,) = _U16.unpack_from(buf, pos)
        info = sizes.get(alg)
        if info is None:
            raise EventLogError(
                f"event {n} at offset {start}: digest algorithm 0x{alg:04x} "
                "not declared in the Spec ID event",
                reason="eventlog_unknown_alg",
            )
        bank, dsize = info
        pos += 2
        if pos + dsize > size:
            raise EventLogError(f"event {n} digest truncated", reason="eventlog_truncated")
        if bank in digests:
            raise EventLogError(
                f"event {n} carries two {bank} digests", reason="eventlog_duplicate_digest"
            )
        digests[bank] = buf[pos : pos + dsize]
        pos += dsize
    if pos + 4 > size:
        raise EventLogError(f"event {n} size field truncated", reason="eventlog_truncated")
    (esize,) = _U32.unpack_from(buf, pos)
    return digests, esize, pos + 4


def _startup_locality(ev: Event) -> int | None:
    if ev.type == EV_NO_ACTION and ev.pcr == 0 and ev.data[:16] == b"StartupLocality\0":
        if len(ev.data) != 17:
            raise EventLogError(
                "StartupLocality event has a bad size", reason="eventlog_bad_locality"
            )
        loc = ev.data[16]
        if loc not in (0, 3, 4):
            raise EventLogError(
                f"StartupLocality {loc} is not 0, 3 or 4", reason="eventlog_bad_locality"
            )
        return loc
    return None


def parse_eventlog(blob: bytes) -> EventLog:
    """Parse a binary TCG event log (SHA-1 or crypto-agile format)."""
    buf = bytes(blob)
    size = len(buf)
    if size < SHA1_EVENT_HEADER.size:
        raise EventLogError("event log shorter than one event header", reason="eventlog_truncated")
    pcr, etype, sha1, esize = SHA1_EVENT_HEADER.unpack_from(buf, 0)
    pos = SHA1_EVENT_HEADER.size
    if esize > size - pos:
        raise EventLogError("first event truncated", reason="eventlog_truncated")
    first_data = buf[pos : pos + esize]
    pos += esize
    events: list[Event] = []
    locality = 0
    if etype == EV_NO_ACTION and pcr == 0 and first_data[:16] == b"Spec ID Event03\0":
        spec = parse_spec_id(first_data)
        events.append(Event(0, pcr, etype, {"sha1": sha1}, first_data))
        sizes = {alg: bank_info(alg, sz) for alg, sz in spec.algorithms.items()}
        n_algs = len(sizes)
        # Fast path: an event carrying every declared digest in the declared order (nearly all
        # events of real logs) is unpacked with one precompiled struct.
        order = tuple(sizes)
        block = struct.Struct("<" + "".join(f"H{sizes[a][1]}s" for a in order) + "I")
        block_banks = tuple(sizes[a][0] for a in order)
        hdr_unpack = _HDR2.unpack_from
        block_unpack = block.unpack_from
        block_size = block.size
        unpack_u32 = _U32.unpack_from
        unpack_u16 = _U16.unpack_from
        n = 1
        while pos < size:
            start = pos
            if size - pos < 12:
                if not any(buf[pos:]):
                    break  # zero padding after the last event
                raise EventLogError(
                    f"event {n} header truncated at offset {pos}", reason="eventlog_truncated"
                )
            pcr, etype, count = hdr_unpack(buf, pos)
            pos += 12
            if pcr > MAX_PCR and pcr != WINDOWS_VIRTUAL_PCR and etype != EV_NO_ACTION:
                if count == 0 and pcr == 0 and not any(buf[start:]):
                    break
                raise EventLogError(
                    f"event {n} at offset {start}: PCR index {pcr} out of range",
                    reason="eventlog_bad_pcr",
                )
            if count == n_algs and pos + block_size <= size:
                fields = block_unpack(buf, pos)
                if fields[:-1:2] == order:
                    digests = dict(zip(block_banks, fields[1:-1:2], strict=True))
                    esize = fields[-1]
                    pos += block_size
                else:
                    digests, esize, pos = _slow_digests(buf, pos, n, start, count, sizes)
            else:
                if count == 0 and pcr == 0 and etype == 0 and not any(buf[start:]):
                    break
                if count == 0 or count > n_algs:
                    raise EventLogError(
                        f"event {n} at offset {start} has {count} digests, the log declares "
                        f"{n_algs} algorithms",
                        reason="eventlog_bad_digest_count",
                    )
                digests, esize, pos = _slow_digests(buf, pos, n, start, count, sizes)
            if esize > size - pos or esize > MAX_EVENT_SIZE:
                raise EventLogError(
                    f"event {n} at offset {start} claims {esize} data bytes, {size - pos} remain",
                    reason="eventlog_truncated",
                )
            ev = Event(n, pcr, etype, digests, buf[pos : pos + esize])
            pos += esize
            if etype == EV_NO_ACTION:
                loc = _startup_locality(ev)
                if loc is not None:
                    locality = loc
            events.append(ev)
            n += 1
            if n > MAX_EVENTS:
                raise EventLogError("more than 100000 events", reason="eventlog_too_long")
        del unpack_u16, unpack_u32
        banks = tuple(info[0] for info in sizes.values())
        return EventLog(True, spec, tuple(events), locality, banks)

    # SHA-1 (TCG 1.2 style) log: the first event is an ordinary one.
    pos = 0
    n = 0
    while pos < size:
        if size - pos < SHA1_EVENT_HEADER.size:
            if not any(buf[pos:]):
                break
            raise EventLogError(
                f"event {n} header truncated at offset {pos}", reason="eventlog_truncated"
            )
        pcr, etype, sha1, esize = SHA1_EVENT_HEADER.unpack_from(buf, pos)
        if n > 0 and pcr == 0 and etype == 0 and esize == 0 and not any(buf[pos:]):
            break
        _check_pcr(pcr, etype, pos)
        pos += SHA1_EVENT_HEADER.size
        if esize > size - pos:
            raise EventLogError(
                f"event {n} claims {esize} data bytes, {size - pos} remain",
                reason="eventlog_truncated",
            )
        ev = Event(n, pcr, etype, {"sha1": sha1}, buf[pos : pos + esize])
        pos += esize
        if etype == EV_NO_ACTION:
            loc = _startup_locality(ev)
            if loc is not None:
                locality = loc
        events.append(ev)
        n += 1
        if n > MAX_EVENTS:
            raise EventLogError("more than 100000 events", reason="eventlog_too_long")
    return EventLog(False, None, tuple(events), locality, ("sha1",))


def hash_func(bank: str) -> Callable[..., Any]:
    """The hash constructor of ``bank`` (``hashlib.sha256`` for sha256): called with the
    data, it returns an object with ``digest()``. EventLogError when this Python lacks it."""
    fast: Callable[..., Any] | None = getattr(hashlib, bank, None)
    if fast is not None:
        return fast
    hname = {"sm3_256": "sm3"}.get(bank, bank)
    try:
        hashlib.new(hname)
    except ValueError:
        raise EventLogError(f"hash {bank} not available", reason="eventlog_unknown_alg") from None
    return lambda data=b"": hashlib.new(hname, data)


def replay(log: EventLog, banks: Iterable[str] | None = None) -> dict[str, dict[int, bytes]]:
    """Replay the log: bank → {PCR index → value} for every PCR that an event touches.

    PCR 0 is included whenever a StartupLocality event set its initial value. Default: every bank
    the log declares. An event without a digest for a bank is not extended into that bank, as
    TPM2_PCR_Extend extends only the banks it is given digests for (Windows logs carry
    sha256-only events). Asking for a bank the log does not declare raises EventLogError.
    """
    wanted = tuple(log.banks if banks is None else banks)
    out: dict[str, dict[int, bytes]] = {}
    for bank in wanted:
        if bank not in log.banks:
            raise EventLogError(f"the log has no {bank} digests", reason="eventlog_missing_bank")
        hfunc = hash_func(bank)
        size = hfunc().digest_size
        pcrs: dict[int, bytes] = {}
        if log.startup_locality:
            pcrs[0] = bytes(size - 1) + bytes([log.startup_locality])
        zero = bytes(size)
        for ev in log.events:
            if ev.type == EV_NO_ACTION or ev.pcr == WINDOWS_VIRTUAL_PCR:
                continue
            d = ev.digests.get(bank)
            if d is None:
                continue
            pcrs[ev.pcr] = hfunc(pcrs.get(ev.pcr, zero) + d).digest()
        out[bank] = dict(sorted(pcrs.items()))
    return out


# --- event decoding -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EfiVariable:
    """UEFI_VARIABLE_DATA: the variable a EV_EFI_VARIABLE_* event measured."""

    guid: uuid.UUID
    name: str
    data: bytes


def decode_efi_variable(data: bytes) -> EfiVariable:
    """Decode UEFI_VARIABLE_DATA (EV_EFI_VARIABLE_DRIVER_CONFIG/BOOT/AUTHORITY event data)."""
    if len(data) < 32:
        raise EventLogError("UEFI_VARIABLE_DATA too short", reason="eventlog_bad_event")
    guid = uuid.UUID(bytes_le=bytes(data[:16]))
    name_len, data_len = struct.unpack_from("<QQ", data, 16)
    end_name = 32 + 2 * name_len
    if name_len > 4096 or end_name + data_len > len(data):
        raise EventLogError(
            "UEFI_VARIABLE_DATA lengths exceed the event", reason="eventlog_bad_event"
        )
    name = bytes(data[32:end_name]).decode("utf-16-le", "replace")
    return EfiVariable(guid, name, bytes(data[end_name : end_name + data_len]))


@dataclass(frozen=True, slots=True)
class ImageLoad:
    """UEFI_IMAGE_LOAD_EVENT of an EV_EFI_BOOT_SERVICES_APPLICATION/DRIVER event."""

    location: int
    length: int
    link_time_address: int
    device_path: bytes


def decode_image_load(data: bytes) -> ImageLoad:
    if len(data) < 32:
        raise EventLogError("UEFI_IMAGE_LOAD_EVENT too short", reason="eventlog_bad_event")
    loc, length, link, dp_len = struct.unpack_from("<QQQQ", data, 0)
    if 32 + dp_len > len(data):
        raise EventLogError("device path exceeds the event", reason="eventlog_bad_event")
    return ImageLoad(loc, length, link, bytes(data[32 : 32 + dp_len]))


def describe_event(ev: Event) -> str:
    """A one-line human description of the event data (best effort, never raises)."""
    try:
        if ev.type in (
            EV_EFI_VARIABLE_DRIVER_CONFIG,
            EV_EFI_VARIABLE_BOOT,
            EV_EFI_VARIABLE_BOOT2,
            EV_EFI_VARIABLE_AUTHORITY,
        ):
            var = decode_efi_variable(ev.data)
            return f"{var.name} ({len(var.data)} bytes)"
        if ev.type in (EV_EFI_ACTION, EV_ACTION, EV_IPL, EV_S_CRTM_VERSION):
            raw = ev.data
            if len(raw) >= 2 and raw[1::2].count(0) == len(raw) // 2:
                return raw.decode("utf-16-le", "replace").rstrip("\0")
            return raw.decode("utf-8", "replace").rstrip("\0")
        if ev.type == EV_SEPARATOR:
            return "separator" if ev.data in (b"\0\0\0\0", b"") else "separator (error)"
        if ev.type == EV_NO_ACTION:
            return ev.data[:16].split(b"\0", 1)[0].decode("ascii", "replace")
    except Exception:
        return ""
    return ""


def secure_boot_state(log: EventLog) -> bool | None:
    """The SecureBoot variable measured in PCR 7: True/False, or None when not measured.

    The caller must have checked that the event's digest covers its data (see
    :func:`event_data_digest_ok`), since event data is not otherwise authenticated.
    """
    state: bool | None = None
    for ev in log.events:
        if ev.pcr == 7 and ev.type == EV_EFI_VARIABLE_DRIVER_CONFIG:
            var = decode_efi_variable(ev.data)
            if var.guid == EFI_GLOBAL_VARIABLE and var.name == "SecureBoot":
                state = len(var.data) >= 1 and var.data[0] == 1
    return state


def event_data_digest_ok(ev: Event) -> bool:
    """Whether every digest of an event is H(event data), for events whose digest covers data."""
    for bank, d in ev.digests.items():
        fast = _FIXED_HASHES.get(bank)
        if fast is not None:
            got = fast(ev.data).digest()
        else:
            got = hashlib.new({"sm3_256": "sm3"}.get(bank, bank), ev.data).digest()
        if got != d:
            return False
    return True


_FIXED_HASHES: Final = {
    "sha1": hashlib.sha1,
    "sha256": hashlib.sha256,
    "sha384": hashlib.sha384,
    "sha512": hashlib.sha512,
}


# --- writing logs (tests, simulated attesters) ----------------------------------------------------
def build_eventlog(
    events: Iterable[tuple[Any, ...]],
    *,
    banks: tuple[str, ...] = ("sha1", "sha256"),
    startup_locality: int | None = None,
    crypto_agile: bool = True,
) -> bytes:
    """Write a log of ``(pcr, event_type, data)`` events whose digests are H(data) per bank.

    An event given as ``(pcr, type, data, {bank: digest})`` uses those digests instead.
    """
    out = bytearray()
    if not crypto_agile:
        for item in events:
            pcr, etype, data = item[0], item[1], item[2]
            dg = item[3]["sha1"] if len(item) > 3 else hashlib.sha1(data).digest()
            out += SHA1_EVENT_HEADER.pack(pcr, etype, dg, len(data)) + data
        return bytes(out)
    ids = {v[0]: k for k, v in _ALGS.items()}
    spec = b"Spec ID Event03\0" + struct.pack("<IBBBBI", 0, 0, 2, 0, 2, len(banks))
    for b in banks:
        spec += struct.pack("<HH", ids[b], _ALGS[ids[b]][1])
    spec += b"\0"
    out += SHA1_EVENT_HEADER.pack(0, EV_NO_ACTION, bytes(20), len(spec)) + spec
    if startup_locality is not None:
        loc = b"StartupLocality\0" + bytes([startup_locality])
        out += _HDR2.pack(0, EV_NO_ACTION, len(banks))
        for b in banks:
            out += struct.pack("<H", ids[b]) + bytes(_ALGS[ids[b]][1])
        out += _U32.pack(len(loc)) + loc
    for item in events:
        pcr, etype, data = item[0], item[1], item[2]
        given: dict[str, bytes] = item[3] if len(item) > 3 else {}
        out += _HDR2.pack(pcr, etype, len(banks))
        for b in banks:
            dg = given.get(b) or hashlib.new(_ALGS[ids[b]][2], data).digest()
            out += struct.pack("<H", ids[b]) + dg
        out += _U32.pack(len(data)) + data
    return bytes(out)


def encode_efi_variable(guid: uuid.UUID, name: str, data: bytes) -> bytes:
    """UEFI_VARIABLE_DATA for a variable (tests and simulated attesters)."""
    return (
        guid.bytes_le + struct.pack("<QQ", len(name), len(data)) + name.encode("utf-16-le") + data
    )
