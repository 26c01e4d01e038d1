"""What every JSON request body must be before any route validates it (issue 19, §2).

* **At most** :data:`MAX_JSON_DEPTH` **levels of nesting.** Pydantic's validators and our own
  (the NUL check in ``schemas.BodyIn``) recurse: a body nested a few hundred levels deep ran
  them into ``RecursionError``, unauthenticated, on ``POST /auth/login``. Nothing the API takes
  is nested more than a dozen levels (a Kubernetes AdmissionReview, the deepest, about ten).
  Deeper bodies are refused with 400 ``json_too_deep``.
* **Text, not UTF-16 debris.** JSON may escape a lone surrogate (``"\\ud800"``), and Python's
  decoder also lets one through as (CESU-8) bytes; no store can keep such a string (SQLite's
  driver and PostgreSQL refuse to encode it), nor can a response echo it. Any such string,
  a key or a value anywhere in the body, is refused with 400 ``invalid_text``.

:func:`checked_json_body` is one application-wide dependency (``FastAPI(dependencies=...)``):
it runs after FastAPI has parsed the body (once; it reads FastAPI's parse, it does not parse
again) and before the body is validated, which happens after every dependency. The walk is
iterative, so the check itself cannot recurse too deep. A body too deep even for the JSON
parser (thousands of levels) fails in FastAPI's parse; ``api.errors`` answers that with the
same 400 ``json_too_deep``.
"""

from __future__ import annotations

import email.message
from typing import Any

from fastapi import Request

from proofplane.errors import ProofplaneError

MAX_JSON_DEPTH = 64


def too_deep() -> ProofplaneError:
    return ProofplaneError(
        f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
        code="json_too_deep",
        details={"max_depth": MAX_JSON_DEPTH},
    )


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ``json_too_deep`` or ``invalid_text`` (both 400) for a parsed JSON value."""
    stack: list[tuple[Any, int]] = [(value, 0)]  # (value, containers around it)
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                raise _invalid_text(value)
        elif isinstance(item, dict):
            if depth >= max_depth:
                raise too_deep()
            for key, inner in item.items():
                if isinstance(key, str) and not _is_text(key):
                    raise _invalid_text(value)
                stack.append((inner, depth + 1))
        elif isinstance(item, list):
            if depth >= max_depth:
                raise too_deep()
            stack.extend((inner, depth + 1) for inner in item)


def _invalid_text(value: Any) -> ProofplaneError:
    return ProofplaneError(
        "the request body holds a string that is not valid Unicode text (a lone UTF-16 "
        "surrogate such as \\ud800)",
        code="invalid_text",
        details={"loc": ["body", *_where_not_text(value)]},
    )


def _where_not_text(value: Any) -> list[str | int]:
    """The path to the first string (or key) that is not text; the error path only."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return path
        if isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and not _is_text(key):
                    return [*path, ascii(key)]
                stack.append((inner, [*path, key]))
        elif isinstance(item, list):
            stack.extend((inner, [*path, i]) for i, inner in enumerate(item))
    return []  # pragma: no cover - called only when there is one


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def checked_json_body(request: Request) -> None:
    """The application-wide dependency: the JSON body of a route that takes one (FastAPI has
    parsed it already; this reads that parse) is bounded in depth and is text."""
    route = request.scope.get("route")
    if getattr(route, "body_field", None) is None:
        return  # the route takes no body, and nothing reads one
    if not _is_json(request.headers.get("content-type")) or not await request.body():
        return
    try:
        data = await request.json()
    except RecursionError:
        raise too_deep() from None
    except ValueError:
        return  # not JSON: the route's own validation answers
    check_json(data)
