"""An offloaded cache's commits: the lengths a re-attached cache starts from, and a commit
once the engine has drained: :class:`OffloadedCommits`.

A cache made over a persistent tier re-attaches its last commit
(:meth:`~jax_tpusync.persist.commit.Persistence.attach`): the committed lengths are
``init()``'s default, and until that first ``init()`` they bound what it may start from (the
tier may hold rows past them that a crashed process wrote and never committed).
:meth:`~jax_tpusync.OffloadedKVCache.restart_at` moves both to the common commit of a
cache of parts. A commit waits for the engine's write-backs; one that failed is a commit not
made (:meth:`~jax_tpusync.persist.commit.Persistence.commit_after`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_tpusync.caches.parts import restart_part
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.persist.commit import Persistence
from jax_tpusync.persist.persisted_kv import PersistedKV
from jax_tpusync.runtime.engine import Engine

__all__ = ["OffloadedCommits"]


class OffloadedCommits:
    """The commit side of one offloaded cache.

    Args:
      persistence: the cache's commit protocol (None: not a persistent tier).
      engine: the cache's engine (drained before a commit).
      batch: slots of the cache.

    Attributes:
      restored: ``init()``'s default lengths once the cache re-attached a commit (None:
        none).
      bound: until the first ``init()`` after a re-attach, the rows each slot's commit
        covers (None: no bound).
    """

    def __init__(self, persistence: Persistence | None, engine: Engine, batch: int):
        self.persistence = persistence
        self.engine = engine
        self.batch = batch
        self.restored: np.ndarray | None = None
        self.bound: np.ndarray | None = None

    def attach(self, kv: PersistedKV, *, attached: bool, verify: bool) -> None:
        """Re-attaches the tier's last commit (a new tier: commit 0)."""
        self.restored = self.persistence.attach(kv, attached=attached, verify=verify)
        self.bound = self.restored

    def start_lengths(self, lengths: Sequence[int] | np.ndarray | None) -> np.ndarray:
        """The lengths an ``init(lengths)`` starts from (default: the restored ones, or 0),
        refused, changing nothing, if of another shape or past a slot's commit bound."""
        if lengths is None:
            lengths = self.restored
        if lengths is None:
            lengths = np.zeros(self.batch, np.int32)
        lengths = np.asarray(lengths)
        if lengths.shape != (self.batch,):
            raise ValueError(f"lengths must have shape ({self.batch},); got {lengths.shape}")
        bound = self.bound
        for b in np.flatnonzero(lengths > bound) if bound is not None else ():
            raise ValueError(
                f"lengths[{b}]={int(lengths[b])} is past slot {b}'s committed length "
                f"{int(bound[b])}: this cache re-attached its last commit, and rows past it "
                f"were never committed (or restart_at() cut them)"
            )
        return lengths

    def started(self, lengths: np.ndarray) -> None:
        """A fresh state of ``lengths`` is made: this process's states hold whatever rows
        follow, and the commit protocol is told."""
        self.bound = None
        if self.persistence is not None:
            self.persistence.note_init(lengths)

    def commit(self, lengths: np.ndarray, *, session: str) -> None:
        """Drains the engine (a failed write-back raises), then commits ``lengths`` on a
        persistent tier."""
        if self.persistence is None:
            self.engine.drain()
            return
        self.persistence.commit_after(self.engine.drain, lengths, session=session)

    def restart_at(
        self,
        slots: SlotTable,
        block_tokens: int,
        lengths: np.ndarray,
        tokens: Sequence[np.ndarray] | None,
    ) -> None:
        """:meth:`jax_tpusync.OffloadedKVCache.restart_at`'s commit and new start."""
        self.restored = restart_part(self.persistence, slots, block_tokens, lengths, tokens)
        if self.bound is not None:
            self.bound = self.restored
