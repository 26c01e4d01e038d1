"""Events: the append-only record of every decision and change."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"
    DENIED = "denied"


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    ts: datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    outcome: Outcome
    details: dict[str, Any] = field(default_factory=dict)
