"""The Mooncake Store: its client, addresses and transfer memory (shared by the remote prefix
level, P/D and the weight store) and the remote prefix level built on it
(:mod:`~jax_tpusync.mooncake.level`)."""
