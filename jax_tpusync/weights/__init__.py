"""RL weight sync: :class:`WeightPublisher` (trainer) and :class:`WeightPuller` (sampler)
over a weight store (a directory, or a Mooncake Store), in :mod:`~jax_tpusync.weights.sync`;
the stores, the transfer plan and the staging below it."""

from jax_tpusync.weights.sync import (
    DamagedVersionError,
    IncompleteVersionError,
    PublishStats,
    PullStats,
    WeightPublisher,
    WeightPuller,
    WeightSyncError,
    open_weight_store,
)

__all__ = [
    "DamagedVersionError",
    "IncompleteVersionError",
    "PublishStats",
    "PullStats",
    "WeightPublisher",
    "WeightPuller",
    "WeightSyncError",
    "open_weight_store",
]
