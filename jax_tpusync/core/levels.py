"""Storage levels: where a cache's block bytes live, behind small interfaces.

Three roles, each an interface (a ``Protocol``) the slot table (:mod:`jax_tpusync.core.slots`)
and the cache use, with one class per level that plays it:

* :class:`BlockStore` — reads and writes whole blocks (every layer, K then V) of the
  cache's own tiers. :class:`TierBlocks`: an engine tier allocation (host DRAM, a file, or
  DRAM over a spill file), which also says where each block's rows are
  (:meth:`TierBlocks.locate`, what the step's segments and host-side reads use).
* :class:`RemoteLevel` — a level past the cache's own index that holds *published* prefix
  blocks by their chained key, shared with other processes or hosts: lookup (``has``),
  ``load`` (checked: a damaged or foreign block is a miss, never KV), ``publish``
  (first writer wins), ``stats``. :class:`SharedDirectoryLevel`: one file per block in a
  shared directory. A level that can also write blocks straight into the tier's memory
  (:class:`InPlaceRemoteLevel`: a network store, see :mod:`jax_tpusync.mooncake.level`)
  is used that way when the tier is in memory: a run of blocks looked up in one request,
  then read into free tier blocks with no copy, checked where it landed.
* :class:`SpillMover` — moves cached blocks between the two levels of a two-level cache
  (:class:`jax_tpusync.core.spill.SpillTier`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jax_tpusync.core import layout, shared_blocks
from jax_tpusync.runtime.engine import Engine, page_offset

logger = logging.getLogger(__name__)


class BlockStore(Protocol):
    """Whole blocks of the cache's own tiers: ``uint8[regions * block_bytes]`` payloads
    (every (layer, K|V) region of the block, in region order)."""

    def read_blocks(self, blocks: Sequence[int]) -> list[np.ndarray]: ...

    def write_block(self, block: int, payload: np.ndarray) -> None: ...

    def block_memory(self, block: int) -> list[np.ndarray] | None: ...

    def quiesce(self) -> None: ...


class RemoteLevel(Protocol):
    """Published prefix blocks by key, shared beyond this cache."""

    def has(self, key: bytes) -> bool: ...

    def load(self, key: bytes, parent: bytes | None, tokens: np.ndarray) -> np.ndarray | None: ...

    def publish(
        self, key: bytes, parent: bytes | None, tokens: np.ndarray, payload: np.ndarray
    ) -> bool: ...

    def stats(self) -> dict: ...

    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class InPlaceLoad:
    """What :meth:`InPlaceRemoteLevel.load_into` did: the first ``loaded`` destinations hold
    their blocks, checked; destinations ``[loaded, busy_until)`` may still be written by a
    call that passed its deadline, until the level is ``settled()``; the rest are untouched.
    """

    loaded: int
    busy_until: int = 0


@runtime_checkable
class InPlaceRemoteLevel(RemoteLevel, Protocol):
    """A remote level that reads blocks straight into the tier's memory, and looks up and
    publishes runs of blocks a request at a time (``missing``, ``publish_many``).

    ``wanted``: ``(key, parent, tokens)`` of consecutive blocks of a prompt, from its first
    missing block on. ``destinations``: per block, ``uint8[block_bytes]`` views of its
    bytes in every region (region order), inside the memory given to :meth:`use_memory`.
    ``publish_many``'s payloads: a block's bytes, or its regions in the same form (read
    only during the call).
    """

    def use_memory(self, address: int, nbytes: int) -> None: ...

    def lookup(self, wanted: Sequence[tuple[bytes, bytes | None, np.ndarray]]) -> int: ...

    def load_into(
        self,
        wanted: Sequence[tuple[bytes, bytes | None, np.ndarray]],
        destinations: Sequence[Sequence[np.ndarray]],
    ) -> InPlaceLoad: ...

    def settled(self) -> bool: ...

    def missing(self, keys: list[bytes]) -> list[int]: ...

    def publish_many(self, items: list[tuple[bytes, bytes | None, np.ndarray, Any]]) -> int: ...


class SpillMover(Protocol):
    """Moves cached blocks between DRAM and a spill level (see jax_tpusync.core.spill)."""

    def demote(self, prefix: Any, want_free: int) -> None: ...

    def promotion_room(self, shared: list[int]) -> int: ...

    def intact(self, prefix: Any, shared: list[int]) -> list[int]: ...

    def admitted(self, prefix: Any, shared: list[int]) -> list[int]: ...

    def stats(self) -> dict: ...


class TierBlocks:
    """One cache's block allocation on an engine tier (and its spill tier, if any).

    Block ``b`` of region ``r`` (= layer * 2 + K|V) lies at tier block ``first_block + r *
    num_blocks + b``; a two-level cache's ids past ``num_blocks`` are on the spill tier
    (``locate`` asks the spill mover, which knows both allocations).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        tier: int,
        first_block: int,
        num_blocks: int,
        regions: int,
        block_bytes: int,
        spill: Any = None,
    ):
        self.engine = engine
        self.tier = tier
        self.first_block = first_block
        self.num_blocks = num_blocks
        self.regions = regions
        self.block_bytes = block_bytes
        self.spill = spill
        self.spill_tier = self.spill_first = 0  # A two-level cache's spill allocation.
        self.memory: np.ndarray | None = None  # uint8[tier bytes]: a host tier, mapped.
        try:
            address, nbytes = engine.mapped_memory(tier)
        except ValueError:  # A file tier: not in memory.
            pass
        else:
            self.memory = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))

    @classmethod
    def open(cls, engine: Engine, config: Any, spec: Any, first_staging: Any) -> TierBlocks:
        """Opens the tier a :class:`~jax_tpusync.core.config.CacheConfig` names on ``engine``
        (and a two-level cache's spill file) and allocates the cache's blocks on it,
        checking the int32 bounds with the first block each allocation got.

        ``first_staging``: the first state's staging buffer, for a tier whose fetches land
        in staging (a file): its data is shifted to that buffer's offset within a page.
        (Where XLA places a buffer depends on the allocator's history; a probe buffer of
        the same size is not reliable.)"""
        g, tier = config.geometry, config.tier
        block_bytes = spec.block_bytes
        blocks = layout.tier_blocks(g)
        phase = 0 if first_staging is None else (page_offset(first_staging) or 0)
        if tier.kind == "host":
            index = engine.add_host_tier(
                block_bytes=block_bytes, num_blocks=blocks, shm_name=tier.shm_name
            )
        else:
            index = engine.add_file_tier(
                tier.path,
                block_bytes=block_bytes,
                num_blocks=blocks,
                file_name=tier.file_name,
                alignment_offset=phase,
            )
        first = engine.allocate(index, blocks, name="kv" if tier.persistent else None)
        layout.check_int32_layout(g.max_len, g.windows, spec.chunk_len, block_bytes, blocks, first)
        store = cls(
            engine,
            tier=index,
            first_block=first,
            num_blocks=g.num_blocks,
            regions=g.num_layers * 2,
            block_bytes=block_bytes,
        )
        if spec.spill_blocks:
            spill_blocks = layout.tier_blocks(g, spec.spill_blocks)
            store.spill_tier = engine.add_file_tier(
                tier.spill_path,
                block_bytes=block_bytes,
                num_blocks=spill_blocks,
                alignment_offset=phase,
            )
            store.spill_first = engine.allocate(store.spill_tier, spill_blocks)
            layout.check_int32_layout(
                g.max_len, g.windows, spec.chunk_len, block_bytes, spill_blocks, store.spill_first
            )
        return store

    def target(self, shard: int) -> list[int]:
        """(tier, first block, shard, spill tier, spill first block) of a state's target."""
        return [self.tier, self.first_block, shard, self.spill_tier, self.spill_first]

    @property
    def payload_bytes(self) -> int:
        return self.regions * self.block_bytes

    def note_staging_phase(self, staging: Any) -> None:
        """Logs when fetches into ``staging`` will go through bounce buffers."""
        info = self.engine.tier_info(self.tier)
        offset = page_offset(staging)
        if not info.dio_alignment or offset is None:
            return
        # dio_alignment divides the page size, so the offset within a page decides.
        phase = (offset - info.alignment_offset) % info.dio_alignment
        if phase:
            logger.info(
                "staging buffer is %d bytes out of phase with the file tier's data: fetches "
                "copy through bounce buffers (correct, slower)",
                phase,
            )

    def locate(self, region: int, block: int) -> tuple[int, int]:
        """(tier, tier byte offset) of table id ``block`` in ``region``."""
        if self.spill is not None:
            return self.spill.locate(region, block)
        offset = (self.first_block + region * self.num_blocks + block) * self.block_bytes
        return self.tier, offset

    def block_rows(self, block: int, at: int = 0) -> list[tuple[int, int, int, int]]:
        """(tier, tier offset, memory offset, bytes) of ``block`` in every region, packed
        in region order from memory byte ``at``."""
        return [
            (*self.locate(region, block), at + region * self.block_bytes, self.block_bytes)
            for region in range(self.regions)
        ]

    def block_memory(self, block: int) -> list[np.ndarray] | None:
        """``uint8[block_bytes]`` views of DRAM ``block``'s bytes in every region (region
        order) in the tier's memory, for another engine to write in place; None when the
        tier is not in memory. Call :meth:`quiesce` before writing through them."""
        if self.memory is None or block >= self.num_blocks:
            return None
        return [
            self.memory[offset : offset + self.block_bytes]
            for offset in (self.locate(region, block)[1] for region in range(self.regions))
        ]

    def quiesce(self) -> None:
        """Waits for every transfer this engine has in flight: writes through
        :meth:`block_memory` bypass the engine's ordering, so a freed block must not still
        be the target or source of one."""
        self.engine.drain()

    def read_blocks(self, blocks: Sequence[int]) -> list[np.ndarray]:
        """The payloads of ``blocks``, read in one request (after the writes in flight to
        their bytes, which the engine orders first)."""
        size = self.payload_bytes
        buf = np.empty(len(blocks) * size, np.uint8)
        rows = [r for j, b in enumerate(blocks) for r in self.block_rows(int(b), j * size)]
        self.engine.transfer(rows, buf, write=False)
        return [buf[j * size : (j + 1) * size] for j in range(len(blocks))]

    def write_block(self, block: int, payload: np.ndarray) -> None:
        self.engine.transfer(self.block_rows(block), payload, write=True)


class SharedDirectoryLevel:
    """A shared directory of published blocks (:mod:`jax_tpusync.core.shared_blocks`) as a
    remote level: a damaged, truncated or foreign block file is a miss and a warning
    naming the file, never an error that blocks every admission of the prompt."""

    def __init__(self, path: str | os.PathLike, **layout: Any):
        self.directory = shared_blocks.SharedBlockDirectory(path, **layout)
        self.damaged = 0  # Block files refused on load.

    def describe(self) -> str:
        return f"shared directory {os.fspath(self.directory.path)!r}"

    @property
    def payload_bytes(self) -> int:
        return self.directory.payload_bytes

    def has(self, key: bytes) -> bool:
        return self.directory.has(key)

    def load(self, key: bytes, parent: bytes | None, tokens: np.ndarray) -> np.ndarray | None:
        try:
            return self.directory.load(key, parent, tokens)
        except shared_blocks.SharedBlockError as e:
            self.damaged += 1
            logger.warning("%s; treated as a miss", e)
            return None

    def publish(
        self, key: bytes, parent: bytes | None, tokens: np.ndarray, payload: np.ndarray
    ) -> bool:
        return self.directory.publish(key, parent, tokens, payload)

    def stats(self) -> dict:
        return dict(
            shared_published=self.directory.published,
            shared_imported=self.directory.imported,
            shared_damaged=self.damaged,
        )
