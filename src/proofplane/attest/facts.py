"""What an event log says, reduced to the facts policy needs — and a memo of them.

:func:`analyze_eventlog` is a pure function of the log bytes and the PCR bank: parse, replay,
and pull out the Secure Boot state, the boot applications and the kernels. A node's firmware log
is the same bytes on every attestation round until it reboots, so a verifier attesting thousands
of nodes a minute keeps an :class:`EventLogCache` (an explicit value the caller owns, bounded,
keyed by the SHA-256 of the bytes) and skips re-parsing identical logs. The facts are exactly
what the uncached path computes; collision resistance of SHA-256 is what makes that safe.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proofplane.attest import eventlog as el
from proofplane.attest.errors import AttestError


def _is_kernel(data: bytes) -> bool:
    """Whether a PCR 9 EV_IPL event's data names a kernel (GRUB measures every file it loads)."""
    return b"vmlinuz" in data or b"linuxefi Kernel" in data or b"/bzImage" in data


@dataclass(frozen=True, slots=True)
class LogFacts:
    """Policy-relevant facts of one event log in one bank; ``error`` set when it is unusable."""

    sha256: str
    bank: str
    replayed: dict[int, bytes]
    events: int = 0
    secure_boot: bool | None = None
    secure_boot_error: str | None = None  # the SecureBoot event's data does not match its digest
    boot_apps: tuple[tuple[int, bytes], ...] = ()  # (event index, digest) in PCR 4
    kernels: tuple[tuple[int, str, bytes], ...] = ()  # (event index, path, digest) in PCR 9
    error: tuple[str, str] | None = None  # (reason, message)


def analyze_eventlog(blob: bytes, bank: str, sha256: str | None = None) -> LogFacts:
    """Parse and replay ``blob`` in ``bank`` and extract the facts; never raises.

    A fused single pass handles the regular crypto-agile log (every event carries every declared
    digest, in order); anything else — SHA-1 logs, StartupLocality, padding, any damage — takes
    the general parser, which also produces the error reasons. Both give identical facts
    (tests/test_attest_eventlog.py checks that on the real logs and on mutated ones).
    """
    digest = sha256 or hashlib.sha256(blob).hexdigest()
    try:
        fast = _scan_regular(bytes(blob), bank, digest)
    except Exception:
        fast = None
    return fast if fast is not None else analyze_eventlog_general(blob, bank, digest)


def analyze_eventlog_general(blob: bytes, bank: str, sha256: str | None = None) -> LogFacts:
    """:func:`analyze_eventlog` through the general parser (``parse_eventlog`` + ``replay``)."""
    digest = sha256 or hashlib.sha256(blob).hexdigest()
    try:
        log = el.parse_eventlog(blob)
        replayed = el.replay(log, [bank])[bank]
        secure_boot: bool | None = None
        sb_error = None
        apps: list[tuple[int, bytes]] = []
        kernels: list[tuple[int, str, bytes]] = []
        for ev in log.events:
            if ev.pcr == 7 and ev.type == el.EV_EFI_VARIABLE_DRIVER_CONFIG:
                var = el.decode_efi_variable(ev.data)
                if var.guid == el.EFI_GLOBAL_VARIABLE and var.name == "SecureBoot":
                    if not el.event_data_digest_ok(ev):
                        sb_error = f"event {ev.number} (SecureBoot) data does not match its digest"
                    secure_boot = len(var.data) >= 1 and var.data[0] == 1
            elif ev.pcr == 4 and ev.type == el.EV_EFI_BOOT_SERVICES_APPLICATION:
                apps.append((ev.number, ev.digests.get(bank, b"")))
            elif ev.pcr == 9 and ev.type == el.EV_IPL and _is_kernel(ev.data):
                path = ev.data.decode("utf-8", "replace").rstrip("\0")
                kernels.append((ev.number, path, ev.digests.get(bank, b"")))
        return LogFacts(digest, bank, replayed, len(log.events), secure_boot, sb_error,
                        tuple(apps), tuple(kernels))  # fmt: skip
    except AttestError as exc:
        return LogFacts(digest, bank, {}, error=("eventlog_malformed", exc.message))


@functools.lru_cache(maxsize=64)
def _layout(algs: tuple[tuple[int, int], ...], bank: str) -> tuple[Any, ...] | None:
    """How a regular event of a log declaring ``algs`` ((alg id, digest size), in order) is laid
    out, for :func:`_scan_regular`; None when the log has no ``bank`` digests.

    A pure function of the algorithm list that the Spec ID event declares (the Spec ID event
    itself is parsed and checked on every call of the scan): memoizing it is compiling a format,
    like ``re``'s pattern cache, not remembering anything about a log.
    """
    info = [el.bank_info(alg, sz) for alg, sz in algs]
    banks = tuple(b for b, _ in info)
    if bank not in banks:
        return None
    # (pcrIndex, eventType, the digest of `bank`, eventSize): the same arity for every layout
    fmt = "<II4x"
    for b, sz in info:
        fmt += f"2x{sz}s" if b == bank else f"2x{sz}x"
    head = struct.Struct(fmt + "I")
    # (digest count, algId × n): must be (n, the declared ids in order)
    ids = struct.Struct("<8xI" + "".join(f"H{sz}x" for _, sz in info[:-1]) + "H")
    # every digest, for the rare event whose data is hashed (the SecureBoot variable)
    full = struct.Struct("<III" + "".join(f"H{sz}s" for _, sz in info) + "I")
    expect = (len(algs), *(alg for alg, _ in algs))
    return head, ids, full, banks, expect


_QQ = struct.Struct("<QQ")
# UEFI_VARIABLE_DATA of SecureBoot starts GUID ‖ UnicodeNameLength (10) and its name follows
_SECURE_BOOT_VAR = el.EFI_GLOBAL_VARIABLE.bytes_le + struct.pack("<Q", 10)
_SECURE_BOOT_NAME = "SecureBoot".encode("utf-16-le")
# the PCRs whose events policy reads (7: SecureBoot, 4: boot applications, 9: kernels)
_WATCHED = tuple(i in (4, 7, 9) for i in range(el.MAX_PCR + 1))


def _scan_regular(buf: bytes, bank: str, digest: str) -> LogFacts | None:
    """The fused pass; None as soon as the log is not a regular crypto-agile log (the caller then
    takes the general parser, which also names the error).

    Every event is still bounds-checked (header, digest count and algorithm ids, data size) and
    every extended one replayed in ``bank``; no Event is built. Only the events policy reads are
    looked into: PCR 7 EV_EFI_VARIABLE_DRIVER_CONFIG (every one's UEFI_VARIABLE_DATA lengths
    checked as :func:`~proofplane.attest.eventlog.decode_efi_variable` does, the SecureBoot one
    found by its GUID and UTF-16 name bytes, so nothing is decoded), PCR 4
    EV_EFI_BOOT_SERVICES_APPLICATION and PCR 9 EV_IPL.
    """
    size = len(buf)
    if size < 48 or size > el.MAX_EVENT_SIZE:  # (so that eventSize > 16 MiB overruns the log)
        return None
    pcr, etype, _sha1, esize = el.SHA1_EVENT_HEADER.unpack_from(buf, 0)
    if etype != el.EV_NO_ACTION or pcr != 0 or buf[32:48] != b"Spec ID Event03\0":
        return None
    pos = 32 + esize
    if pos > size:
        return None
    spec = el.parse_spec_id(buf[32:pos])
    layout = _layout(tuple(spec.algorithms.items()), bank)
    if layout is None:
        return None
    head, ids, full, banks, expect = layout
    unpack, check, hsize = head.unpack_from, ids.unpack_from, head.size
    hfunc = el.hash_func(bank)
    zero = bytes(hfunc().digest_size)
    pcrs = [zero] * (el.MAX_PCR + 1)
    apps: list[tuple[int, bytes]] = []
    kernels: list[tuple[int, str, bytes]] = []
    secure_boot: bool | None = None
    sb_error = None
    no_action, virtual, max_pcr = el.EV_NO_ACTION, el.WINDOWS_VIRTUAL_PCR, el.MAX_PCR
    driver_config = el.EV_EFI_VARIABLE_DRIVER_CONFIG
    boot_app, ipl = el.EV_EFI_BOOT_SERVICES_APPLICATION, el.EV_IPL
    watched = _WATCHED
    n = 1
    try:
        while pos < size:
            pcr, etype, d, esize = unpack(buf, pos)  # struct.error when the header is cut
            if check(buf, pos) != expect:
                return None
            pos += hsize + esize  # past the end only for the last event: checked below
            if etype == no_action:
                if pcr == 0 and buf.startswith(b"StartupLocality\0", pos - esize):
                    return None
            elif pcr <= max_pcr:
                pcrs[pcr] = hfunc(pcrs[pcr] + d).digest()
                if watched[pcr]:
                    if etype == driver_config and pcr == 7:
                        if pos > size or esize < 32:
                            return None
                        data = buf[pos - esize : pos]
                        name_len, data_len = _QQ.unpack_from(data, 16)
                        if name_len > 4096 or 32 + 2 * name_len + data_len > esize:
                            return None  # as decode_efi_variable: the general path says why
                        if data[:24] == _SECURE_BOOT_VAR and data[32:52] == _SECURE_BOOT_NAME:
                            fields = full.unpack_from(buf, pos - esize - hsize)
                            dg = dict(zip(banks, fields[4:-1:2], strict=True))
                            if not el.event_data_digest_ok(el.Event(n, pcr, etype, dg, data)):
                                sb_error = f"event {n} (SecureBoot) data does not match its digest"
                            secure_boot = data_len >= 1 and data[52] == 1
                    elif etype == boot_app and pcr == 4:
                        apps.append((n, d))
                    elif etype == ipl and pcr == 9:
                        data = buf[pos - esize : pos]
                        if pos <= size and _is_kernel(data):
                            kernels.append((n, data.decode("utf-8", "replace").rstrip("\0"), d))
            elif pcr != virtual:
                return None
            n += 1
    except struct.error:
        return None
    if pos != size or n > el.MAX_EVENTS:
        return None
    replayed = {i: v for i, v in enumerate(pcrs) if v is not zero}
    return LogFacts(digest, bank, replayed, n, secure_boot, sb_error,
                    tuple(apps), tuple(kernels))  # fmt: skip


class VerifierCache:
    """Bounded LRUs a verifier process owns: event-log facts by (SHA-256 of the log, bank) and
    parsed AK public keys by their exact bytes. Pass it to ``verify(..., cache=…)``.

    Only pure functions of bytes are kept: the facts of a log (its parse and replay) and the
    parsed AK; never a verdict. Every round still verifies the quote's signature over the
    fresh nonce and compares the quoted PCR digest with the PCR values and the replay, and
    the policy is applied anew. A re-enrolled node has a new AK, hence a new key here.

    A server shares one between the threads of its process: each step is one operation of
    the (C) ``OrderedDict``, and an entry another thread evicted in between is recomputed or
    skipped, never wrong (what is kept is a pure function of its key)."""

    def __init__(self, max_entries: int = 20_000) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[tuple[str, str], LogFacts] = OrderedDict()
        self._aks: OrderedDict[bytes, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def ak(self, blob: bytes, load: Callable[[bytes], Any]) -> Any:
        """``load(blob)`` memoized by the AK's bytes (parsing and key loading are not free)."""
        found = self._aks.get(blob)
        if found is None:
            found = load(blob)
            self._aks[blob] = found
            _bound(self._aks, self.max_entries)
        else:
            _touch(self._aks, blob)
        return found

    def facts(self, blob: bytes, bank: str, sha256: str) -> LogFacts:
        """The facts of ``blob`` in ``bank``; ``sha256`` is the hex SHA-256 of ``blob`` (the
        verifier computes it from the very bytes it judges)."""
        key = (sha256, bank)
        found = self._items.get(key)
        if found is not None:
            _touch(self._items, key)
            self.hits += 1
            return found
        self.misses += 1
        facts = analyze_eventlog(blob, bank, sha256)
        self._items[key] = facts
        _bound(self._items, self.max_entries)
        return facts

    def __len__(self) -> int:
        return len(self._items)


def _touch(lru: OrderedDict[Any, Any], key: Any) -> None:
    with contextlib.suppress(KeyError):  # another thread evicted it meanwhile
        lru.move_to_end(key)


def _bound(lru: OrderedDict[Any, Any], size: int) -> None:
    while len(lru) > size:
        try:
            lru.popitem(last=False)
        except KeyError:  # another thread emptied it meanwhile
            return
