"""Attestation nonces the server can check without having stored them (issue 20).

A round's nonce goes into the TPM quote as its ``qualifyingData`` (extraData), so it stays 32
bytes (the size of a SHA-256 digest, which every TPM accepts there). It carries what the server
needs to check it when the evidence comes back, authenticated by a key only the server holds:

====  ==========================================================================
byte  content
====  ==========================================================================
0     the format, ``1``
1-6   when it was issued: milliseconds since the Unix epoch, big-endian
7-15  nine random bytes
16-31 HMAC-SHA-256 under the server's nonce key over a label, the node's id and name,
      and bytes 0-15, truncated to 128 bits
====  ==========================================================================

So issuing a nonce is a read (nothing is written, no write lock is taken), and a nonce is
accepted only from the node it was issued to, with the time it was issued at, which the
verifier's freshness check then judges. Single use is the evidence transaction's job: it records
every nonce it spends, and a nonce spent before is a replay.

Pure: bytes in, bytes out (the key, the clock and the randomness are passed in).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from datetime import UTC, datetime, timedelta

NONCE_SIZE = 32
KEY_SIZE = 32
FORMAT = 1
RANDOM_SIZE = 9
_MAC_SIZE = 16
_LABEL = b"proofplane/attestation-nonce/v1\x00"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_MS = (1 << 48) - 1


def _mac(key: bytes, node_id: int, node: str, head: bytes) -> bytes:
    who = struct.pack(">Q", node_id) + node.encode() + b"\x00"
    return hmac.new(key, _LABEL + who + head, hashlib.sha256).digest()[:_MAC_SIZE]


def issued_ms(at: datetime) -> int:
    """``at`` as whole milliseconds since the epoch (what a nonce can carry)."""
    ms = (at - _EPOCH) // timedelta(milliseconds=1)
    if not 0 <= ms <= _MAX_MS:
        raise ValueError(f"{at.isoformat()} cannot be carried by a nonce")
    return ms


def at_ms(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)


def make_nonce(key: bytes, node_id: int, node: str, at: datetime, random: bytes) -> bytes:
    """A nonce for node ``node_id``/``node`` issued at ``at`` (kept to the millisecond)."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"a nonce key is {KEY_SIZE} bytes")
    if len(random) != RANDOM_SIZE:
        raise ValueError(f"a nonce takes {RANDOM_SIZE} random bytes")
    head = bytes([FORMAT]) + issued_ms(at).to_bytes(6, "big") + random
    return head + _mac(key, node_id, node, head)


def open_nonce(key: bytes, node_id: int, node: str, nonce: bytes) -> datetime | None:
    """When ``nonce`` was issued to this node, or None: not one of ours, made under another key,
    issued to another node, or altered."""
    if len(nonce) != NONCE_SIZE or nonce[0] != FORMAT or len(key) != KEY_SIZE:
        return None
    head, mac = nonce[:16], nonce[16:]
    if not hmac.compare_digest(_mac(key, node_id, node, head), mac):
        return None
    return at_ms(int.from_bytes(head[1:7], "big"))
