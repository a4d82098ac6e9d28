"""Memory registered with a Mooncake TransferEngine, counted per engine.

One engine per process may serve both the remote prefix level
(:mod:`jax_tpusync.mooncake_level`) and P/D transfer (:mod:`jax_tpusync.pd_transfer`),
and both register the same cache pool with it; the engine refuses a second registration
of memory it already has ("overlapped memory region"). Registering through here counts
them: the first registration of an (engine, address) reaches the engine, the last
unregistration leaves it.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
# (id(engine), address) -> [engine, bytes, registrations]; the engine is kept so its id
# stays its own while registered.
_registered: dict[tuple[int, int], list] = {}


def register(engine: Any, address: int, nbytes: int) -> int:
    """Registers ``[address, address + nbytes)`` with ``engine`` (``register_memory``)
    unless it holds that range already; returns the engine's code (0: registered). The
    same address registered again with another size is refused (-600, as the engine
    answers overlapping ranges) without asking it."""
    key = (id(engine), int(address))
    with _lock:
        entry = _registered.get(key)
        if entry is not None:
            if entry[1] != nbytes:
                return -600
            entry[2] += 1
            return 0
        rc = engine.register_memory(int(address), int(nbytes))
        if rc == 0:
            _registered[key] = [engine, int(nbytes), 1]
        return rc


def unregister(engine: Any, address: int) -> None:
    """Drops one registration of ``address``; the last one unregisters it from the
    engine. An address not registered here is ignored."""
    key = (id(engine), int(address))
    with _lock:
        entry = _registered.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del _registered[key]
            engine.unregister_memory(int(address))


def registrations(engine: Any, address: int) -> int:
    """How many holders registered ``address`` with ``engine`` through here."""
    with _lock:
        entry = _registered.get((id(engine), int(address)))
        return 0 if entry is None else entry[2]
