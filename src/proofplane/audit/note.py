"""C2SP signed notes (c2sp.org/signed-note) with Ed25519, and tlog checkpoints
(c2sp.org/tlog-checkpoint) inside them. Pure: keys and texts in, texts and verdicts out.

A note is UTF-8 text ending in a newline, a blank line, then signature lines
``— <name> <base64(key id ‖ signature)>``; the signature covers the text (with its final
newline). The key id is the first 4 bytes of SHA-256(name ‖ 0x0A ‖ 0x01 ‖ public key), 0x01
being the Ed25519 signature type. A verifier key is published as
``<name>+<hex key id>+<base64(0x01 ‖ public key)>``; the signing key file holds
``PRIVATE+KEY+<name>+<hex key id>+<base64(0x01 ‖ seed)>``, as Go's ``sumdb/note`` writes it.

A checkpoint's text is ``<origin>\\n<tree size>\\n<base64 root hash>\\n`` plus optional
extension lines.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from proofplane.errors import ProofplaneError

ED25519 = 0x01
SIG_PREFIX = "\u2014 "  # em dash, space


class NoteError(ProofplaneError, ValueError):
    """A note, key or checkpoint that is malformed or does not verify."""

    code = "note_invalid"


@dataclass(frozen=True, slots=True)
class VerifierKey:
    name: str
    key_id: bytes
    public_key: bytes  # 32 raw Ed25519 bytes

    def text(self) -> str:
        return verifier_key_text(self.name, self.public_key)


@dataclass(frozen=True, slots=True)
class SignerKey:
    name: str
    seed: bytes  # 32-byte Ed25519 private key seed

    @property
    def public_key(self) -> bytes:
        return _private(self.seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def verifier(self) -> VerifierKey:
        pub = self.public_key
        return VerifierKey(self.name, key_id(self.name, pub), pub)

    def text(self) -> str:
        kid = key_id(self.name, self.public_key).hex()
        blob = base64.b64encode(bytes([ED25519]) + self.seed).decode()
        return f"PRIVATE+KEY+{self.name}+{kid}+{blob}"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    origin: str
    size: int
    root_hash: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        lines = [self.origin, str(self.size), base64.b64encode(self.root_hash).decode()]
        return "\n".join([*lines, *self.extensions]) + "\n"


def key_id(name: str, public_key: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([ED25519]) + public_key).digest()[:4]


def verifier_key_text(name: str, public_key: bytes) -> str:
    blob = base64.b64encode(bytes([ED25519]) + public_key).decode()
    return f"{name}+{key_id(name, public_key).hex()}+{blob}"


def _check_name(name: str) -> None:
    if not name or any(c in name for c in "+ \n\t") or not name.isprintable():
        raise NoteError(f"invalid key name {name!r}: no '+', spaces or control characters")


def generate_signer(name: str, seed: bytes) -> SignerKey:
    """A signer from 32 random bytes (the caller supplies the randomness: os.urandom)."""
    _check_name(name)
    if len(seed) != 32:
        raise NoteError("an Ed25519 seed is 32 bytes")
    return SignerKey(name, seed)


def parse_verifier_key(text: str) -> VerifierKey:
    parts = text.strip().split("+", 2)  # base64 may contain '+'
    if len(parts) != 3:
        raise NoteError("a verifier key is <name>+<key id hex>+<base64 key>")
    name, kid_hex, blob = parts
    _check_name(name)
    try:
        kid = bytes.fromhex(kid_hex)
        raw = base64.b64decode(blob, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise NoteError("verifier key: bad hex or base64") from exc
    if len(kid) != 4 or len(raw) != 33 or raw[0] != ED25519:
        raise NoteError("verifier key: not an Ed25519 key (type 0x01, 32 bytes)")
    if key_id(name, raw[1:]) != kid:
        raise NoteError("verifier key: the key id does not match the name and key")
    return VerifierKey(name, kid, raw[1:])


def parse_signer_key(text: str) -> SignerKey:
    parts = text.strip().split("+", 4)
    if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"]:
        raise NoteError("a signing key is PRIVATE+KEY+<name>+<key id hex>+<base64 key>")
    name, kid_hex, blob = parts[2:]
    _check_name(name)
    try:
        raw = base64.b64decode(blob, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise NoteError("signing key: bad base64") from exc
    if len(raw) != 33 or raw[0] != ED25519:
        raise NoteError("signing key: not an Ed25519 key")
    signer = SignerKey(name, raw[1:])
    if key_id(name, signer.public_key).hex() != kid_hex.lower():
        raise NoteError("signing key: the key id does not match the key")
    return signer


def sign(text: str, signer: SignerKey) -> str:
    """The signed note: text, blank line, one signature line."""
    _check_text(text)
    sig = _private(signer.seed).sign(text.encode())
    return signed_note(text, signer.verifier, sig)


def signed_note(text: str, verifier: VerifierKey, signature: bytes) -> str:
    """The signed note of ``text`` with an Ed25519 ``signature`` made elsewhere (a KMS: the
    private key never comes here), checked against ``verifier`` before it is returned."""
    _check_text(text)
    if len(signature) != 64:
        raise NoteError("an Ed25519 signature is 64 bytes")
    blob = base64.b64encode(verifier.key_id + signature).decode()
    note = f"{text}\n{SIG_PREFIX}{verifier.name} {blob}\n"
    open_note(note, verifier)
    return note


def verifier_for(name: str, public_key: bytes) -> VerifierKey:
    """The verifier key of an Ed25519 ``public_key`` (32 raw bytes) under ``name``."""
    _check_name(name)
    if len(public_key) != 32:
        raise NoteError("an Ed25519 public key is 32 bytes")
    return VerifierKey(name, key_id(name, public_key), public_key)


def signed_by(note: str, verifiers: Sequence[VerifierKey]) -> VerifierKey:
    """The one of ``verifiers`` whose signature line ``note`` carries and verifies (a log
    signed by successive key versions: each checkpoint names its version by key id)."""
    last: NoteError | None = None
    for verifier in verifiers:
        try:
            open_note(note, verifier)
        except NoteError as exc:
            last = exc
            continue
        return verifier
    if last is None:
        raise NoteError("no verifier key to check the note with")
    if len(verifiers) == 1:
        raise last
    raise NoteError(f"no signature by any of {len(verifiers)} known verifier keys ({last})")


def open_note(note: str, verifier: VerifierKey) -> str:
    """The note's text, if a signature line by ``verifier`` verifies; else NoteError. Lines by
    other keys are allowed (cosignatures) but a bad line by this key is an error."""
    sep = note.rfind("\n\n")
    if sep < 0 or not note.endswith("\n"):
        raise NoteError("not a signed note: no blank line before the signatures")
    text, sigs = note[: sep + 1], note[sep + 2 :]
    _check_text(text)
    public = Ed25519PublicKey.from_public_bytes(verifier.public_key)
    verified = False
    for line in sigs.splitlines():
        if not line.startswith(SIG_PREFIX):
            raise NoteError("malformed signature line")
        try:
            name, blob = line[len(SIG_PREFIX) :].split(" ")
            raw = base64.b64decode(blob, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise NoteError("malformed signature line") from exc
        if len(raw) < 5:
            raise NoteError("signature too short")
        if name != verifier.name or raw[:4] != verifier.key_id:
            continue
        try:
            public.verify(raw[4:], text.encode())
        except InvalidSignature as exc:
            raise NoteError(f"the signature by {name} does not verify") from exc
        verified = True
    if not verified:
        raise NoteError(f"no signature by {verifier.name}+{verifier.key_id.hex()}")
    return text


def parse_checkpoint(text: str) -> Checkpoint:
    if not text.endswith("\n"):
        raise NoteError("a checkpoint ends with a newline")
    lines = text[:-1].split("\n")
    if len(lines) < 3 or not lines[0]:
        raise NoteError("a checkpoint has an origin, a size and a root hash line")
    origin, size_text, root_b64, *ext = lines
    if not size_text.isdigit() or (size_text != "0" and size_text.startswith("0")):
        raise NoteError("the checkpoint size is not a decimal number")
    try:
        root = base64.b64decode(root_b64, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise NoteError("the checkpoint root is not base64") from exc
    if len(root) != 32:
        raise NoteError("the checkpoint root is not a SHA-256 hash")
    if any(not e for e in ext):
        raise NoteError("empty extension line in a checkpoint")
    return Checkpoint(origin, int(size_text), root, tuple(ext))


def sign_checkpoint(checkpoint: Checkpoint, signer: SignerKey) -> str:
    return sign(checkpoint.text(), signer)


def verify_checkpoint(
    note: str, verifier: VerifierKey | Sequence[VerifierKey], origin: str | None = None
) -> Checkpoint:
    """The checkpoint in a signed note, after checking the signature (by ``verifier``, or by
    one of several) and (given) the origin."""
    if not isinstance(verifier, VerifierKey):
        verifier = signed_by(note, verifier)
    cp = parse_checkpoint(open_note(note, verifier))
    if origin is not None and cp.origin != origin:
        raise NoteError(f"checkpoint origin {cp.origin!r} is not {origin!r}")
    return cp


def _check_text(text: str) -> None:
    if not text.endswith("\n") or "\n\n" in text:
        raise NoteError("note text must end in a newline and have no blank line")


def _private(seed: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(seed)
