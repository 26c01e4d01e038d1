"""The batch of tokens' "last used" times (issue 20, §2), apart from any database: what it
writes, when, and what it keeps when a write fails."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from proofplane.service.access import last_used
from proofplane.service.access.last_used import LastUsed

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class Sink:
    """A ``write`` that records each batch, or fails while ``failing`` is set."""

    def __init__(self) -> None:
        self.batches: list[dict[str, datetime]] = []
        self.failing = False
        self.written = threading.Event()

    def __call__(self, times: Mapping[str, datetime]) -> None:
        if self.failing:
            raise OSError("database unavailable")
        self.batches.append(dict(times))
        self.written.set()


def test_a_token_noted_twice_is_written_once_with_its_latest_time() -> None:
    sink = Sink()
    batch = LastUsed(sink, delay=3600)
    stored: list[datetime] = []
    batch.note("a", T0 + timedelta(seconds=5), stored.append)
    batch.note("a", T0, stored.append)  # an older time never wins
    batch.note("b", T0)
    assert batch.waiting() == 2
    assert batch.flush() == 2
    assert sink.batches == [{"a": T0 + timedelta(seconds=5), "b": T0}]
    assert stored == [T0 + timedelta(seconds=5)] * 2  # both callers learn the stored time
    assert batch.flush() == 0  # nothing waits: no transaction
    assert batch.writes == 1


def test_a_failed_write_keeps_the_times_for_the_next_one(caplog) -> None:
    sink = Sink()
    batch = LastUsed(sink, delay=3600)
    stored: list[datetime] = []
    batch.note("a", T0, stored.append)
    sink.failing = True
    assert batch.flush() == 0
    assert "not written" in caplog.text
    assert stored == []
    assert batch.waiting() == 1
    batch.note("a", T0 + timedelta(seconds=1))
    sink.failing = False
    assert batch.flush() == 1
    assert sink.batches == [{"a": T0 + timedelta(seconds=1)}]
    assert stored == [T0 + timedelta(seconds=1)]


def test_the_timer_writes_without_another_note() -> None:
    sink = Sink()
    batch = LastUsed(sink, delay=0.01)
    batch.note("a", T0)
    assert sink.written.wait(10)
    assert sink.batches == [{"a": T0}]
    assert batch.waiting() == 0


def test_a_full_batch_is_written_by_the_note_that_fills_it(monkeypatch) -> None:
    monkeypatch.setattr(last_used, "MAX_WAITING", 3)
    sink = Sink()
    batch = LastUsed(sink, delay=3600)
    for token in ("a", "b"):
        batch.note(token, T0)
    assert sink.batches == []
    batch.note("c", T0)
    assert sink.batches == [{"a": T0, "b": T0, "c": T0}]


def test_after_close_notes_are_ignored() -> None:
    sink = Sink()
    batch = LastUsed(sink, delay=3600)
    batch.note("a", T0)
    batch.close()
    assert sink.batches == [{"a": T0}]
    batch.note("b", T0)
    assert batch.waiting() == 0
