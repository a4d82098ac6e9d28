"""Hybrid models: one cache per layer group (sliding and global layers, layers reading
another's KV), :class:`~jax_tpusync.caches.hybrid.cache.HybridKVCache`."""
