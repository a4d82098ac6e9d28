"""How a host-pool cache (:class:`~jax_tpusync.HostPoolKVCache`, the TPU data path) takes
part in P/D transfer (:mod:`jax_tpusync.pd.transfer`).

Its pool is a JAX array the state carries, donated by every step: no address stays its own
long enough to register with a TransferEngine. So a sequence's rows pass through a
*staging buffer* here: host memory this process maps and registers once (grown when a
longer sequence comes), laid out as the stored rows of one slot
(:mod:`jax_tpusync.caches.pool.stored_rows`: per head shard, per layer, the K rows then the V rows
of consecutive positions), which is exactly the order of an engine cache's runs. The
decode side lands the writes in it and, once the completion message came, loads them into
the slot between steps (:meth:`~jax_tpusync.HostPoolKVCache.load_stored_rows`); the prefill
side reads the slot's rows into it (:meth:`~jax_tpusync.HostPoolKVCache.read_stored_rows`)
and writes from there. One host copy on each side, byte for byte (a quantized pool's codes
and scales as they are).

Late writes: after a failed receive, writes already in flight may still land in the buffer,
never in the slot's blocks (they were not named). So the slot is free at once, and the
buffer itself is set aside until its quarantine has passed (:meth:`PoolStaging.retire`); the
next transfer maps a new one.

:class:`PoolStagingEndpoint` is this path's
:class:`~jax_tpusync.pd.endpoint.SlotRowsEndpoint`: what both roles call.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_tpusync.caches.capabilities import StagedRows
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.mooncake import transfer_memory
from jax_tpusync.pd.channel import PDTransferError
from jax_tpusync.pd.pools import check_not_a_ring, check_slot, head_split
from jax_tpusync.pd.quarantine import sleep_until

logger = logging.getLogger(__name__)

# Positions a new buffer holds at least (it grows to the next power of two past a longer
# sequence): a handful of remaps over a run, not one per new length.
MIN_STAGING_TOKENS = 1024


@dataclasses.dataclass
class _Buffer:
    """One mapped, registered buffer of ``tokens`` positions per (shard, layer, K|V)."""

    memory: mmap.mmap
    view: np.ndarray  # uint8[shards, num_layers, 2, tokens, row_bytes]
    address: int
    tokens: int
    until: float = 0.0  # Set aside until this time (retired buffers).


class PoolStaging:
    """The staging buffer of a host-pool cache on one TransferEngine (see the module).

    Args:
      cache: the host-pool cache (:class:`~jax_tpusync.caches.capabilities.StagedRows`).
      engine: the TransferEngine the buffer is registered with.
      role: "KVReceiver" or "KVSender", for messages.
      populate: fault a new buffer's pages in when it is mapped, rather than during the
        first transfer into it.
    """

    def __init__(self, cache: StagedRows, engine: Any, role: str, *, populate: bool = True):
        check_not_a_ring(cache, role)
        self.cache = cache
        self.engine = engine
        self.role = role
        self.populate = populate
        self.heads = [tuple(h) for h in head_split(cache)]
        self._current: _Buffer | None = None
        self._retired: list[_Buffer] = []

    @property
    def tokens(self) -> int:
        """Positions the current buffer holds (0: none mapped)."""
        return 0 if self._current is None else self._current.tokens

    @property
    def retired(self) -> list[float]:
        """When each buffer set aside after a failed transfer may be freed."""
        return [b.until for b in self._retired]

    def _shape(self, tokens: int) -> tuple[int, ...]:
        spec = self.cache.shard_spec  # One head range's: its row is one shard's.
        return (len(self.heads), spec.num_layers, 2, tokens, spec.row_bytes)

    def ensure(self, n: int) -> _Buffer:
        """The current buffer, mapped and registered anew if it holds fewer than ``n``
        positions. Raises PDTransferError if the engine refuses the registration (nothing
        changed)."""
        if self._current is not None and self._current.tokens >= n:
            return self._current
        tokens = max(MIN_STAGING_TOKENS, 1 << (max(n, 1) - 1).bit_length())
        shape = self._shape(tokens)
        nbytes = int(np.prod(shape))
        memory = mmap.mmap(-1, nbytes)
        view = np.frombuffer(memory, np.uint8).reshape(shape)
        address = view.ctypes.data
        rc = transfer_memory.register(self.engine, address, nbytes)
        if rc != 0:
            del view
            memory.close()
            raise PDTransferError(
                f"{self.role}: registering a staging buffer of {nbytes} bytes with the "
                f"TransferEngine returned {rc}"
            )
        if self.populate:
            transfer_memory.populate(address, nbytes)
        if self._current is not None:
            self._free(self._current)
        self._current = _Buffer(memory, view, address, tokens)
        logger.debug("%s: staging buffer of %d positions (%d bytes)", self.role, tokens, nbytes)
        return self._current

    def head_runs(self, n: int) -> list[dict]:
        """Per head range, in head order: ``{"heads": [lo, hi], "runs": per region (layer *
        2 + K|V) [[address, bytes]]}`` of the first ``n`` positions of the buffer (one run
        a region). Maps a larger buffer first if needed."""
        buffer = self.ensure(n)
        stride = buffer.view.strides
        out = []
        for shard, heads in enumerate(self.heads):
            runs = []
            for layer in range(self.cache.shard_spec.num_layers):
                for kv in (0, 1):
                    at = buffer.address + shard * stride[0] + layer * stride[1] + kv * stride[2]
                    runs.append([[at, n * stride[3]]] if n else [])
            out.append({"heads": list(heads), "runs": runs})
        return out

    def rows(self, n: int) -> np.ndarray:  # uint8[shards, num_layers, 2, n, row_bytes]
        """The first ``n`` positions of the current buffer (a view)."""
        if self._current is None or self._current.tokens < n:
            raise ValueError(f"the staging buffer holds {self.tokens} positions, not {n}")
        return self._current.view[:, :, :, :n]

    def fill(self, rows: np.ndarray) -> None:
        """Copies ``rows`` (uint8[shards, num_layers, 2, n, row_bytes]) into the buffer's
        first ``n`` positions, mapping a larger buffer first if needed."""
        n = rows.shape[3]
        self.ensure(n)
        self.rows(n)[...] = rows

    def retire(self, until: float) -> None:
        """Sets the current buffer aside until ``until`` (writes of a failed transfer may
        still land in it); the next transfer maps a new one."""
        if self._current is not None:
            self._current.until = until
            self._retired.append(self._current)
            self._current = None

    def reclaim(self, now: float, wait: bool = False) -> int:
        """Frees the set-aside buffers whose time has passed (``wait``: all of them);
        returns how many."""
        keep = [b for b in self._retired if not (wait or now >= b.until)]
        freed = [b for b in self._retired if b not in keep]
        for buffer in freed:
            self._free(buffer)
        self._retired = keep
        return len(freed)

    def close(self) -> None:
        """Unregisters and unmaps every buffer (the caller waited out the quarantines)."""
        for buffer in [*self._retired, *([self._current] if self._current else [])]:
            self._free(buffer)
        self._retired, self._current = [], None

    def _free(self, buffer: _Buffer) -> None:
        transfer_memory.unregister(self.engine, buffer.address)
        buffer.view = None  # The mapping closes once no array views it.
        try:
            buffer.memory.close()
        except BufferError:  # A caller still holds a view: freed when it goes.
            logger.debug("%s: a staging buffer is still viewed; unmapped later", self.role)


class PoolStagingEndpoint:
    """A slot's rows of a host-pool cache, through its staging buffer (a
    :class:`~jax_tpusync.pd.endpoint.SlotRowsEndpoint`; see the module): the decode side
    loads the rows received into the slot between steps, the prefill side reads the slot's
    rows into the buffer before it writes them.

    Args:
      cache: the host-pool cache (:class:`~jax_tpusync.caches.capabilities.StagedRows`).
      role: "KVReceiver" or "KVSender", for messages.
      populate: fault a new buffer's pages in when it is mapped.
      clock: the time a set-aside buffer's quarantine is counted in.

    Raises:
      ValueError: a cache that cannot take part (the message says why).
    """

    pools = ()  # No memory of the cache is registered: its pool moves with every step.

    def __init__(self, cache: StagedRows, role: str, *, populate: bool, clock: Callable[[], float]):
        self.cache = cache
        self.staging = PoolStaging(cache, None, role, populate=populate)
        self.clock = clock

    def register(self, engine: Any) -> None:
        self.staging.engine = engine  # Each buffer is registered when it is mapped.

    def unregister(self) -> None:
        self.staging.close()

    def check_slot(self, slot: Any) -> None:
        check_slot(self.cache, slot)

    def slot_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        raise ValueError(
            "a host-pool cache receives through a staging buffer, not into its pool's "
            "memory: its slots have no runs"
        )

    def landing_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        return self.staging.head_runs(hi - lo)

    def admit(self, state: PoolState, reservation: Any, lo: int, hi: int) -> PoolState:
        # Admitted at its prefix; the received rows then grow it to hi.
        state = self.cache.admitted(state, reservation)
        return self.cache.load_stored_rows(state, reservation.slot, lo, self.staging.rows(hi - lo))

    def set_aside(self, reservation: Any, lo: int, hi: int, seconds: float) -> str:
        # Late writes land in the buffer, never in the slot's blocks: the slot is free at once.
        self.cache.cancel(reservation)
        self.staging.retire(self.clock() + seconds)
        return f", the staging buffer set aside for {seconds:.3g} s (writes may still land in it)"

    def quarantined(self) -> dict[int, float]:
        return {}  # No slot is held: only buffers are.

    def reclaim(self, wait: bool) -> list[int]:
        if wait:
            sleep_until(self.clock, self.staging.retired)
        self.staging.reclaim(self.clock(), wait)
        return []

    def source_runs(self, state: PoolState, slot: int, lo: int, hi: int) -> list[dict]:
        # The slot's rows, read out of the state's pool, are sent from the buffer.
        self.staging.fill(self.cache.read_stored_rows(state, slot, lo, hi))
        return self.staging.head_runs(hi - lo)
