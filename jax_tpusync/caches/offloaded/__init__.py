"""The offloaded cache: rows on an engine tier (DRAM, a ``/dev/shm`` segment or a file),
fetched by the in-graph FFI ops; :class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache`
and its split over a mesh."""
