"""What both data paths share, with no cache object in sight.

Configuration (:mod:`~jax_tpusync.core.config`) and its planner
(:mod:`~jax_tpusync.core.layout`); the states a step carries (:mod:`~jax_tpusync.core.state`,
:mod:`~jax_tpusync.core.pool_state`, :mod:`~jax_tpusync.core.hybrid_state`); quantized rows;
the mesh layout; and the block bookkeeping every cache keeps host-side: block tables
(:mod:`~jax_tpusync.core.blocks`), the slot table that admits and evicts
(:mod:`~jax_tpusync.core.slots`), the prefix index (:mod:`~jax_tpusync.core.prefix`), token
history, windows, the spill policy, where block bytes live
(:mod:`~jax_tpusync.core.levels`, :mod:`~jax_tpusync.core.shared_blocks`) and the host-side
row I/O (:mod:`~jax_tpusync.core.host_io`).
"""
