"""Writes queued in one group commit (``Store.write_grouped``): a helper for the tests of a
group's run path (submits, cancels)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proofplane.access import SYSTEM
from proofplane.errors import ProofplaneError
from proofplane.service.context import Store


def queued(store: Store, apply: Callable[..., Any], sends: list[Callable[[], Any]]) -> list[Any]:
    """Each of ``sends`` called from its own thread while another write holds the lock, in
    this order into the queue of the group ``apply`` names, so that they commit in one group;
    their outcomes (what each returned, or the ``ProofplaneError`` it raised)."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with store.write(SYSTEM) as tx:
            tx.record("test.hold", "item", "hold")
            held.set()
            assert release.wait(10)

    def send(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ProofplaneError as exc:
            return exc

    def waiting() -> int:
        group = store._groups.get(apply)
        return 0 if group is None else len(group.queue)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    with ThreadPoolExecutor(len(sends)) as pool:
        futures = []
        for k, call in enumerate(sends, 1):
            futures.append(pool.submit(send, call))
            for _ in range(2000):  # queued behind the ones before it
                if waiting() == k:
                    break
                threading.Event().wait(0.005)
            else:
                raise AssertionError("the writes did not queue")
        release.set()
        out = [f.result(timeout=30) for f in futures]
    thread.join(10)
    return out
