"""What an event log says, reduced to the facts policy needs — and a memo of them.

:func:`analyze_eventlog` is a pure function of the log bytes and the PCR bank: parse, replay,
and pull out the Secure Boot state, the boot applications and the kernels. A node's firmware log
is the same bytes on every attestation round until it reboots, so a verifier attesting thousands
of nodes a minute keeps an :class:`EventLogCache` (an explicit value the caller owns, bounded,
keyed by the SHA-256 of the bytes) and skips re-parsing identical logs. The facts are exactly
what the uncached path computes; collision resistance of SHA-256 is what makes that safe.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proofplane.attest import eventlog as el
from proofplane.attest.errors import AttestError

_KERNEL_MARKERS = (b"vmlinuz", b"linuxefi Kernel", b"/bzImage")


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
            elif (
                ev.pcr == 9 and ev.type == el.EV_IPL and any(m in ev.data for m in _KERNEL_MARKERS)
            ):
                path = ev.data.decode("utf-8", "replace").rstrip("\0")
                kernels.append((ev.number, path, ev.digests.get(bank, b"")))
        return LogFacts(digest, bank, replayed, len(log.events), secure_boot, sb_error,
                        tuple(apps), tuple(kernels))  # fmt: skip
    except AttestError as exc:
        return LogFacts(digest, bank, {}, error=("eventlog_malformed", exc.message))


def _scan_regular(buf: bytes, bank: str, digest: str) -> LogFacts | None:
    """The fused pass; None as soon as the log is not a regular crypto-agile log."""
    size = len(buf)
    if size < 48:
        return None
    pcr, etype, _sha1, esize = el._HDR1.unpack_from(buf, 0)
    if etype != el.EV_NO_ACTION or pcr != 0 or buf[32:48] != b"Spec ID Event03\0":
        return None
    pos = 32 + esize
    if pos > size:
        return None
    spec = el._parse_spec_id(buf[32:pos])
    sizes = {alg: el._bank_info(alg, sz) for alg, sz in spec.algorithms.items()}
    order = tuple(sizes)
    banks = [sizes[a][0] for a in order]
    if bank not in banks:
        return None
    k = 2 * banks.index(bank) + 1
    # one struct per event: pcrIndex, eventType, count, (algId, digest) × n, eventSize
    event = struct.Struct("<III" + "".join(f"H{sizes[a][1]}s" for a in order) + "I")
    unpack, esize_hdr = event.unpack_from, event.size
    n_algs = len(order)
    k += 3
    hfunc = el._hash_func(bank)
    zero = bytes(hfunc().digest_size)
    pcrs: dict[int, bytes] = {}
    get = pcrs.get
    apps: list[tuple[int, bytes]] = []
    kernels: list[tuple[int, str, bytes]] = []
    secure_boot: bool | None = None
    sb_error = None
    no_action, virtual, max_pcr = el.EV_NO_ACTION, el.WINDOWS_VIRTUAL_PCR, el.MAX_PCR
    max_event = el._MAX_EVENT_SIZE
    special = {el.EV_EFI_VARIABLE_DRIVER_CONFIG, el.EV_EFI_BOOT_SERVICES_APPLICATION, el.EV_IPL}
    n = 1
    while pos < size:
        if size - pos < esize_hdr:
            return None
        fields = unpack(buf, pos)
        pcr, etype, count = fields[0], fields[1], fields[2]
        if count != n_algs or fields[3:-1:2] != order:
            return None
        dpos = pos + esize_hdr
        pos = dpos + fields[-1]
        if pos > size or fields[-1] > max_event:
            return None
        if etype == no_action:
            if pcr == 0 and buf[dpos : dpos + 16] == b"StartupLocality\0":
                return None
        elif pcr != virtual:
            if pcr > max_pcr:
                return None
            d = fields[k]
            pcrs[pcr] = hfunc(get(pcr, zero) + d).digest()
            if etype in special:
                if pcr == 7 and etype == el.EV_EFI_VARIABLE_DRIVER_CONFIG:
                    data = buf[dpos:pos]
                    var = el.decode_efi_variable(data)
                    if var.guid == el.EFI_GLOBAL_VARIABLE and var.name == "SecureBoot":
                        dg = dict(zip(banks, fields[4:-1:2], strict=True))
                        if not el.event_data_digest_ok(el.Event(n, pcr, etype, dg, data)):
                            sb_error = f"event {n} (SecureBoot) data does not match its digest"
                        secure_boot = len(var.data) >= 1 and var.data[0] == 1
                elif pcr == 4 and etype == el.EV_EFI_BOOT_SERVICES_APPLICATION:
                    apps.append((n, d))
                elif pcr == 9 and etype == el.EV_IPL:
                    data = buf[dpos:pos]
                    if any(m in data for m in _KERNEL_MARKERS):
                        kernels.append((n, data.decode("utf-8", "replace").rstrip("\0"), d))
        n += 1
        if n > el._MAX_EVENTS:
            return None
    return LogFacts(digest, bank, dict(sorted(pcrs.items())), n, secure_boot, sb_error,
                    tuple(apps), tuple(kernels))  # fmt: skip


class VerifierCache:
    """Bounded LRUs a verifier process owns: event-log facts by (SHA-256 of the log, bank) and
    parsed AK public keys by their exact bytes. Pass it to ``verify(..., cache=…)``."""

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
            if len(self._aks) > self.max_entries:
                self._aks.popitem(last=False)
        else:
            self._aks.move_to_end(blob)
        return found

    def facts(self, blob: bytes, bank: str, sha256: str) -> LogFacts:
        key = (sha256, bank)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        facts = analyze_eventlog(blob, bank, sha256)
        self._items[key] = facts
        if len(self._items) > self.max_entries:
            self._items.popitem(last=False)
        return facts

    def __len__(self) -> int:
        return len(self._items)
