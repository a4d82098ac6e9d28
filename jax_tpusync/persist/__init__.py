"""Persistence: the commit protocol (:mod:`~jax_tpusync.persist.commit`), the manifest it
writes, the checksums of committed rows, and :class:`~jax_tpusync.persist.persisted_kv.PersistedKV`,
the one view of a cache the protocol reads and restores through."""
