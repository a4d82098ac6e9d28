"""One layer of a decode step over an offloaded KV cache (see :mod:`jax_tpusync.attention`)."""
