"""Runbooks: versioned response procedures, parsed and matched to events. Pure.

A runbook is Markdown with a small YAML header::

    ---
    id: attestation-failure
    title: Attestation failure
    version: 1
    triggers: ["node.attest:failure"]
    ---
    1. First step …

The header names exactly ``id``, ``title``, ``version`` (a positive integer) and ``triggers``
(the event actions it answers, each optionally narrowed to one outcome: ``action:failure``);
an empty ``triggers`` list is a runbook a person starts by hand. The body holds the steps and
must contain at least one numbered step. Anything else is refused with ``invalid_runbook``, so
a published version is always one the server can show and match.

:func:`runbook_for` answers "which runbook answers this event": a trigger naming the event's
action and its outcome wins over one naming the action alone; among equals the lowest id wins,
so the answer never depends on the order the runbooks were loaded in.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from proofplane.errors import ValidationFailed

MAX_RUNBOOK_BYTES = 64 * 1024
MAX_VERSION = 1_000_000
MAX_TRIGGERS = 32
MAX_TITLE = 200
OUTCOMES = ("success", "failure", "denied")
FIELDS = ("id", "title", "version", "triggers")

_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_ACTION = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+")
_STEP = re.compile(r"^\s{0,3}\d{1,3}[.)]\s+\S", re.MULTILINE)
_FENCE = "---"


def invalid(problem: str, **details: Any) -> ValidationFailed:
    """The one error a bad runbook gets (422 ``invalid_runbook``)."""
    return ValidationFailed(
        f"invalid runbook: {problem}",
        code="invalid_runbook",
        details={"problem": problem, **details},
    )


@dataclass(frozen=True, slots=True)
class Trigger:
    """An event action a runbook answers; ``outcome`` None: whatever the outcome."""

    action: str
    outcome: str | None = None

    def __str__(self) -> str:
        return self.action if self.outcome is None else f"{self.action}:{self.outcome}"


@dataclass(frozen=True, slots=True)
class Runbook:
    id: str
    title: str
    version: int
    triggers: tuple[Trigger, ...]
    body: str  # the steps (Markdown)
    text: str  # the document as published, header included

    @property
    def ref(self) -> str:
        """How events name it: ``<id>@v<version>``."""
        return f"{self.id}@v{self.version}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def answers(self, action: str, outcome: str | None) -> int:
        """How specifically it answers the event: 2 action and outcome, 1 action, 0 not."""
        best = 0
        for t in self.triggers:
            if t.action != action:
                continue
            if t.outcome is None:
                best = max(best, 1)
            elif outcome is not None and t.outcome == str(outcome):
                return 2
        return best

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "version": self.version,
            "triggers": [str(t) for t in self.triggers],
            "sha256": self.sha256,
        }


def parse_trigger(value: Any) -> Trigger:
    if not isinstance(value, str):
        raise invalid(
            "each trigger is a string such as 'node.attest:failure'", trigger=repr(value)[:80]
        )
    action, sep, outcome = value.partition(":")
    shown = value[:100]
    if not _ACTION.fullmatch(action) or len(action) > 100:
        raise invalid(f"trigger {shown!r} is not an event action (e.g. 'sink.delivery_failed')",
                      trigger=shown)  # fmt: skip
    if sep and outcome not in OUTCOMES:
        raise invalid(f"trigger {shown!r}: after ':' comes one of {', '.join(OUTCOMES)}",
                      trigger=shown)  # fmt: skip
    return Trigger(action, outcome if sep else None)


def _split(text: str) -> tuple[str, str]:
    lines = text.split("\n")
    if not lines or lines[0].rstrip() != _FENCE:
        raise invalid("a runbook starts with a '---' line, then its YAML header")
    for i in range(1, len(lines)):
        if lines[i].rstrip() == _FENCE:
            return "\n".join(lines[1:i]), "\n".join(lines[i + 1 :])
    raise invalid("the YAML header is not closed by a '---' line")


def parse_runbook(text: Any) -> Runbook:
    """Parse and check one runbook document; ``invalid_runbook`` (422) for anything wrong."""
    if not isinstance(text, str):
        raise invalid("a runbook is Markdown text")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_RUNBOOK_BYTES:
        raise invalid(f"a runbook is at most {MAX_RUNBOOK_BYTES} bytes")
    if "\x00" in text:
        raise invalid("a runbook contains no NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("a runbook is valid Unicode text") from None
    normalized = text.replace("\r\n", "\n")
    head, body = _split(normalized)
    try:
        header = yaml.safe_load(head)
    except yaml.YAMLError as exc:
        raise invalid(f"the header is not YAML: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(header, dict):
        raise invalid("the header is a YAML mapping of id, title, version and triggers")
    unknown = sorted(str(k) for k in header if k not in FIELDS)
    if unknown:
        raise invalid(f"unknown header field(s): {', '.join(unknown)[:200]}", fields=unknown[:10])
    missing = [f for f in FIELDS if f not in header]
    if missing:
        raise invalid(f"missing header field(s): {', '.join(missing)}", fields=missing)
    rid, title, version, triggers = (header[f] for f in FIELDS)
    if not isinstance(rid, str) or not _ID.fullmatch(rid):
        raise invalid("id is lowercase letters, digits and '-' (at most 63)")
    if not isinstance(title, str) or not title.strip() or len(title) > MAX_TITLE or "\n" in title:
        raise invalid(f"title is one line of text (at most {MAX_TITLE} characters)")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise invalid(f"version is a whole number from 1 to {MAX_VERSION}")
    if not isinstance(triggers, list):
        raise invalid("triggers is a list of event actions (it may be empty)")
    if len(triggers) > MAX_TRIGGERS:
        raise invalid(f"at most {MAX_TRIGGERS} triggers")
    parsed = tuple(parse_trigger(t) for t in triggers)
    if len(set(parsed)) != len(parsed):
        raise invalid("a trigger is listed twice")
    if not _STEP.search(body):
        raise invalid("the body has no numbered steps ('1. …')")
    return Runbook(rid, title.strip(), version, parsed, body.strip("\n") + "\n", normalized)


def runbook_for(
    action: str, outcome: str | None, runbooks: Iterable[Runbook]
) -> tuple[str, int] | None:
    """(id, version) of the runbook answering an event with ``action`` and ``outcome``."""
    best: tuple[int, str, int] | None = None  # (-specificity, id, version)
    for rb in runbooks:
        score = rb.answers(action, outcome)
        if score and (best is None or (-score, rb.id) < best[:2]):
            best = (-score, rb.id, rb.version)
    return None if best is None else (best[1], best[2])


def runbook_ref(found: tuple[str, int] | None) -> str | None:
    return None if found is None else f"{found[0]}@v{found[1]}"
