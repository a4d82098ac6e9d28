"""Sparse layer-ahead decode: attend to the KV blocks a step needs, not to all of them.

A decode row's attention is dominated by a few blocks of its context. Each KV block keeps a
small summary (:mod:`.summaries`: per KV head, the channel-wise minimum and maximum of its
keys), from which a query bounds every score in the block without reading it; the step
takes the blocks with the highest bounds under a budget, always with the first block
(attention sinks) and the most recent ones (:mod:`.select`). A layer's fetch starts before
its query exists, so the blocks are predicted (the previous step's selection for that
layer), and what the exact selection adds is fetched late (:mod:`.prediction`).

Everything here is jnp over static shapes, usable inside ``jit`` with traced lengths.
"""

from jax_tpusync.sparse.config import SparseConfig

__all__ = ["SparseConfig"]
