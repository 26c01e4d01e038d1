"""A serving process's garbage collector (issue 20): what stops every request in a worker at
once, set for a server whose heap is large and long-lived.

CPython frees most objects by reference counting; its cyclic collector also runs every time
the objects allocated and not yet freed pass a threshold (700 by default), and a collection of
the oldest generation walks every object that survived earlier ones. A worker holds a large
heap that lives as long as it does (modules, the ORM's mappers, the route table, the scheduler's
cluster view, the token cache), and it stops while the collector walks it: with 1,000 nodes
attesting that came to ~11 full collections a minute of up to 250 ms each
(``proofplane_gc_pause_seconds``), a tail on every endpoint at once. Two settings, taken when the
worker has started (the application's lifespan, ``create_app(settle_heap=True)``, which
``serve`` asks for):

* ``gc.freeze()`` after a full collection: everything alive then (what importing and building
  the application made) moves to a permanent generation that no later collection walks. What
  is frozen and later becomes cyclic garbage is never collected; startup objects live until
  the process ends anyway.
* a first-generation threshold of ``GEN0_THRESHOLD`` allocations instead of 700, so a
  request's objects are mostly freed before a collection sees them; at 700 a collection ran
  every few milliseconds and moved the objects of the requests in flight (those waiting for the
  write lock, say) into the older generations, whose collections they then made frequent.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "settle"]

#: Allocations (net of frees) between first-generation collections in a serving worker.
GEN0_THRESHOLD = 10_000


def settle(gen0_threshold: int = GEN0_THRESHOLD) -> int:
    """Collect, freeze what is alive and raise the first generation's threshold (the module's
    docstring says why). Returns how many objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
    return gc.get_freeze_count()
