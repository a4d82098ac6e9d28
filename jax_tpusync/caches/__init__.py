"""The caches: the :class:`~jax_tpusync.caches.protocol.KVCache` protocol every cache
answers, what some caches can do beyond it, one small protocol per capability
(:mod:`~jax_tpusync.caches.capabilities`), caches made of parts (their rules,
:mod:`~jax_tpusync.caches.parts`; their host calls, :mod:`~jax_tpusync.caches.composite`),
and one subpackage per
kind of storage: :mod:`~jax_tpusync.caches.offloaded` (rows on an engine tier, the in-graph
FFI path), :mod:`~jax_tpusync.caches.pool` (a ``pinned_host`` pool the state carries, the
TPU path) and :mod:`~jax_tpusync.caches.hybrid` (layer groups, each a cache of either
kind)."""
