"""A bit-compatible re-implementation of Go's ``math/rand`` (Go 1.x ``rngSource``), plus a
Python-RNG stand-in with the same interface.

Go's source is an additive lagged-Fibonacci generator ``y[n] = y[n-607] + y[n-273] (mod 2^64)``
kept in a 607-slot ring buffer. ``Seed`` fills the buffer from a Park-Miller (Schrage) sequence
and XORs each slot with a fixed "cooked" table. That table is, per Go's documented generator
program, the raw buffer of the same lagged-Fibonacci generator seeded with 1 (shifts 20/10)
after 7.8e12 steps. We do not store it: we compute it on first use by jumping the linear
recurrence ahead with polynomial exponentiation modulo ``x^607 - x^334 - 1`` over Z/2^64
(about 0.3 s), so no table is copied from anywhere.

Self-test (Go's well-known playground output): ``GoRand(1)`` gives ``Intn(100)`` =
81 87 47 59 81 18 25 40 56 0.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Protocol, TypeVar

T = TypeVar("T")

RNG_LEN = 607
RNG_TAP = 273
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
_COOK_STEPS = 7_800_000_000_000
_SLOT_BITS = 140  # Kronecker-substitution slot: 607 products of two 64-bit words fit in 138 bits
_SLOT_MASK = (1 << _SLOT_BITS) - 1


def _seedrand(x: int) -> int:
    """One Park-Miller step (a = 48271, m = 2^31-1) in Schrage form, as Go writes it."""
    hi, lo = divmod(x, 44488)
    x = 48271 * lo - 3399 * hi
    if x < 0:
        x += _INT32_MAX
    return x


def _seed_vector(seed: int, shift_hi: int, shift_mid: int) -> list[int]:
    x = seed
    vec = [0] * RNG_LEN
    for i in range(-20, RNG_LEN):
        x = _seedrand(x)
        if i >= 0:
            u = x << shift_hi
            x = _seedrand(x)
            u ^= x << shift_mid
            x = _seedrand(x)
            u ^= x
            vec[i] = u & _MASK64
    return vec


def _pack(coeffs: list[int]) -> int:
    out = 0
    for c in reversed(coeffs):
        out = (out << _SLOT_BITS) | c
    return out


def _polymulmod(a: list[int], b: list[int]) -> list[int]:
    """a·b mod (x^607 - x^334 - 1), coefficients mod 2^64."""
    prod = _pack(a) * _pack(b)
    c = [0] * (2 * RNG_LEN - 1)
    for i in range(2 * RNG_LEN - 1):
        c[i] = prod & _SLOT_MASK & _MASK64
        prod >>= _SLOT_BITS
    lag = RNG_LEN - RNG_TAP  # 334
    for i in range(len(c) - 1, RNG_LEN - 1, -1):
        v = c[i]
        if v:
            lo = i - RNG_LEN
            c[lo + lag] = (c[lo + lag] + v) & _MASK64
            c[lo] = (c[lo] + v) & _MASK64
    return c[:RNG_LEN]


def _xpow(n: int) -> list[int]:
    result = [1] + [0] * (RNG_LEN - 1)
    base = [0, 1] + [0] * (RNG_LEN - 2)
    while n:
        if n & 1:
            result = _polymulmod(result, base)
        n >>= 1
        if n:
            base = _polymulmod(base, base)
    return result


def _first_write_step(pos: int) -> int:
    """The first step (1-based) at which the feed pointer writes buffer slot ``pos``."""
    return ((RNG_LEN - RNG_TAP - pos - 1) % RNG_LEN) + 1


def jump_buffer(vec: list[int], steps: int) -> list[int]:
    """The ring buffer after ``steps`` generator steps from a freshly seeded buffer ``vec``
    (tap 0, feed 334), without running them. Slot ``p`` initially holds sequence element
    ``y[w(p) - 607]`` (w = first write step); after N steps it holds the newest ``y[t]``,
    ``t ≤ N``, ``t ≡ w(p) (mod 607)``."""
    z = [0] * RNG_LEN  # z[i] = y[i - 606]
    for p in range(RNG_LEN):
        z[_first_write_step(p) - 1] = vec[p]
    if steps < RNG_LEN:
        raise ValueError("jump_buffer needs at least 607 steps")
    coef = _xpow(steps)  # coefficients of z_steps = y[steps - 606]
    lag = RNG_LEN - RNG_TAP
    ys: dict[int, int] = {}
    for k in range(RNG_LEN):
        ys[steps - 606 + k] = sum(c * v for c, v in zip(coef, z, strict=True)) & _MASK64
        top = coef[-1]
        coef = [0, *coef[:-1]]
        if top:
            coef[lag] = (coef[lag] + top) & _MASK64
            coef[0] = (coef[0] + top) & _MASK64
    out = [0] * RNG_LEN
    for p in range(RNG_LEN):
        w = _first_write_step(p)
        out[p] = ys[steps - ((steps - w) % RNG_LEN)]
    return out


@lru_cache(maxsize=1)
def cooked_table() -> tuple[int, ...]:
    """Go's ``rngCooked`` (as unsigned 64-bit words), generated from the documented algorithm."""
    return tuple(jump_buffer(_seed_vector(1, 20, 10), _COOK_STEPS))


class Rng(Protocol):
    """What the stream builder needs from a random source."""

    def int63(self) -> int: ...

    def intn(self, n: int) -> int: ...

    def shuffle(self, items: list[T]) -> None: ...

    def perm(self, n: int) -> list[int]: ...


class GoRand:
    """Go's ``rand.New(rand.NewSource(seed))`` with the Go 1.x helper semantics."""

    def __init__(self, seed: int) -> None:
        seed %= _INT32_MAX  # Python's % is already non-negative for a positive modulus
        if seed == 0:
            seed = 89482311
        cooked = cooked_table()
        base = _seed_vector(seed, 40, 20)
        self._vec = [(a ^ c) & _MASK64 for a, c in zip(base, cooked, strict=True)]
        self._tap = 0
        self._feed = RNG_LEN - RNG_TAP

    def uint64(self) -> int:
        self._tap -= 1
        if self._tap < 0:
            self._tap += RNG_LEN
        self._feed -= 1
        if self._feed < 0:
            self._feed += RNG_LEN
        x = (self._vec[self._feed] + self._vec[self._tap]) & _MASK64
        self._vec[self._feed] = x
        return x

    def int63(self) -> int:
        return self.uint64() & _MASK63

    def uint32(self) -> int:
        return self.int63() >> 31

    def int31(self) -> int:
        return self.int63() >> 32

    def int31n(self, n: int) -> int:
        """Go's ``Int31n`` (mask for powers of two, else rejection then modulo)."""
        if n <= 0:
            raise ValueError("invalid argument to Int31n")
        if n & (n - 1) == 0:
            return self.int31() & (n - 1)
        top = _INT32_MAX - (1 << 31) % n
        v = self.int31()
        while v > top:
            v = self.int31()
        return v % n

    def intn(self, n: int) -> int:
        """Go's ``Intn`` for n < 2^31 (it is ``Int31n`` there)."""
        if n > _INT32_MAX:
            raise ValueError("Intn beyond 2^31-1 is not needed here")
        return self.int31n(n)

    def _int31n_lemire(self, n: int) -> int:
        """Go's unexported ``int31n`` (Lemire multiply-shift), used by ``Shuffle``."""
        prod = self.uint32() * n
        low = prod & 0xFFFFFFFF
        if low < n:
            thresh = ((1 << 32) - n) % n
            while low < thresh:
                prod = self.uint32() * n
                low = prod & 0xFFFFFFFF
        return prod >> 32

    def shuffle(self, items: list[T]) -> None:
        for i in range(len(items) - 1, 0, -1):
            j = self._int31n_lemire(i + 1)
            items[i], items[j] = items[j], items[i]

    def perm(self, n: int) -> list[int]:
        m = [0] * n
        for i in range(n):
            j = self.intn(i + 1)
            m[i] = m[j]
            m[j] = i
        return m


class PyRand:
    """The same interface on Python's Mersenne Twister (``--rng python``): same protocol,
    different stream, so only 10-seed means are comparable with the published numbers."""

    def __init__(self, seed: int) -> None:
        self._r = random.Random(seed)

    def int63(self) -> int:
        return self._r.getrandbits(63)

    def intn(self, n: int) -> int:
        return self._r.randrange(n)

    def shuffle(self, items: list[T]) -> None:
        for i in range(len(items) - 1, 0, -1):
            j = self._r.randrange(i + 1)
            items[i], items[j] = items[j], items[i]

    def perm(self, n: int) -> list[int]:
        m = [0] * n
        for i in range(n):
            j = self._r.randrange(i + 1)
            m[i] = m[j]
            m[j] = i
        return m


def make_rng(kind: str, seed: int) -> Rng:
    """``"go"`` → :class:`GoRand`, ``"python"`` → :class:`PyRand`."""
    if kind == "go":
        return GoRand(seed)
    if kind == "python":
        return PyRand(seed)
    raise ValueError(f"unknown rng {kind!r} (use 'go' or 'python')")
