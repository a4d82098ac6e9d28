"""The host pool: the TPU data path, a ``pinned_host`` pool the state carries, copied to the
device unit by unit by the compiled step itself;
:class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` and its parts (blocks, rows, windows,
imports, the spill tier, persistence) and its split over a mesh's batch axis."""
