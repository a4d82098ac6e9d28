"""Prefill-to-decode transfer: :class:`~jax_tpusync.pd.transfer.KVSender` (prefill) and
:class:`~jax_tpusync.pd.transfer.KVReceiver` (decode), the control channel, the writes,
and where a slot's rows land or come from in each kind of cache (the endpoints)."""
