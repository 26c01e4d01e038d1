"""Attestation nonces checked without a stored copy (``proofplane.attest.nonce``, issue 20)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proofplane.attest import nonce as n

KEY = bytes(range(32))
T = datetime(2026, 11, 28, 16, 30, 0, 123456, tzinfo=UTC)
RANDOM = b"\x07" * n.RANDOM_SIZE

names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=63)
times = st.datetimes(
    min_value=datetime(1971, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)
)


def test_a_nonce_is_32_bytes_and_carries_its_issue_time_to_the_millisecond() -> None:
    made = n.make_nonce(KEY, 7, "n1", T, RANDOM)
    assert len(made) == 32 == n.NONCE_SIZE  # a TPM's qualifyingData of a SHA-256 size
    assert made[0] == n.FORMAT
    assert n.open_nonce(KEY, 7, "n1", made) == T.replace(microsecond=123000)


@given(st.binary(min_size=32, max_size=32), st.integers(0, 2**63 - 1), names, times,
       st.binary(min_size=9, max_size=9))  # fmt: skip
def test_only_the_node_it_was_made_for_under_the_same_key_opens_it(
    key: bytes, node_id: int, name: str, at: datetime, random: bytes
) -> None:
    made = n.make_nonce(key, node_id, name, at, random)
    assert n.open_nonce(key, node_id, name, made) == n.at_ms(n.issued_ms(at))
    assert n.open_nonce(key, node_id + 1, name, made) is None  # another node's id
    assert n.open_nonce(key, node_id, name + "x", made) is None  # another node's name
    other = bytes([key[0] ^ 1]) + key[1:]
    assert n.open_nonce(other, node_id, name, made) is None  # another deployment's key


@given(st.integers(0, 32 * 8 - 1))
def test_any_bit_changed_is_refused(bit: int) -> None:
    made = bytearray(n.make_nonce(KEY, 7, "n1", T, RANDOM))
    made[bit // 8] ^= 1 << (bit % 8)
    assert n.open_nonce(KEY, 7, "n1", bytes(made)) is None


def test_a_later_issue_time_cannot_be_claimed() -> None:
    made = bytearray(n.make_nonce(KEY, 7, "n1", T, RANDOM))
    later = n.issued_ms(T + timedelta(hours=1)).to_bytes(6, "big")
    made[1:7] = later
    assert n.open_nonce(KEY, 7, "n1", bytes(made)) is None


@pytest.mark.parametrize("bad", [b"", b"\x01" * 31, b"\x01" * 33, b"\x01" * 64])
def test_a_nonce_of_another_size_is_refused(bad: bytes) -> None:
    assert n.open_nonce(KEY, 7, "n1", bad) is None


def test_the_names_of_two_nodes_cannot_run_into_their_ids() -> None:
    # id and name are framed (8 bytes, then the name and a NUL): no pair spells another's
    made = n.make_nonce(KEY, 1, "n1", T, RANDOM)
    assert n.open_nonce(KEY, 1, "n1\x00", made) is None
    assert n.open_nonce(KEY, 256, "n1", made) is None


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        n.make_nonce(b"short", 1, "n1", T, RANDOM)
    with pytest.raises(ValueError, match="random"):
        n.make_nonce(KEY, 1, "n1", T, b"\x00")
    with pytest.raises(ValueError, match="cannot be carried"):
        n.make_nonce(KEY, 1, "n1", datetime(1969, 12, 31, tzinfo=UTC), RANDOM)
    assert n.open_nonce(b"short", 1, "n1", n.make_nonce(KEY, 1, "n1", T, RANDOM)) is None
