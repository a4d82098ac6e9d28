"""How many programs XLA compiled in a stretch of this thread's work (JAX's monitoring events).

The serving loop counts them around each request's step: a step whose function an earlier
loop (or anything else in the process) compiled already compiles nothing, and its time holds
no compile, whatever the width's history in this loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jax import monitoring

# The event JAX records once per program its backend compiles (a persistent-cache hit
# records none).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_counts = threading.local()
_listening = False
_listening_lock = threading.Lock()


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == BACKEND_COMPILE_EVENT and getattr(_counts, "depth", 0):
        _counts.compiled += 1


def _listen() -> None:
    """Registers the listener once per process (JAX keeps it for the process' life)."""
    global _listening
    with _listening_lock:
        if not _listening:
            monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


class CompileCount:
    """The programs compiled so far inside :func:`counting_compiles`'s block."""

    def __init__(self, start: int) -> None:
        self._start = start
        self.compiled = 0

    def _update(self) -> None:
        self.compiled = _counts.compiled - self._start


@contextlib.contextmanager
def counting_compiles() -> Iterator[CompileCount]:
    """Counts the programs this thread compiles inside the block (``.compiled`` once it ends).

    Blocks may nest; each counts everything compiled inside it.
    """
    _listen()
    if not getattr(_counts, "depth", 0):
        _counts.depth, _counts.compiled = 0, 0
    count = CompileCount(_counts.compiled)
    _counts.depth += 1
    try:
        yield count
    finally:
        _counts.depth -= 1
        count._update()
