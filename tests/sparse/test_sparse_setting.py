"""``sparse=`` as a cache keyword: how it is read, and what it is refused with."""

from __future__ import annotations

import pytest

from jax_tpusync.core.config import CacheConfig, to_kwargs
from jax_tpusync.sparse import SparseConfig

GEOMETRY = dict(num_layers=2, batch=1, max_len=64, num_kv_heads=1, head_dim=8)


def test_a_budget_alone_is_a_sparse_config():
    assert CacheConfig.from_kwargs(**GEOMETRY, sparse=0.05).sparse == SparseConfig(budget=0.05)
    assert CacheConfig.from_kwargs(**GEOMETRY, sparse=4).sparse == SparseConfig(budget=4)
    config = CacheConfig.from_kwargs(**GEOMETRY, sparse=SparseConfig(0.1, recent_blocks=2))
    assert to_kwargs(config)["sparse"] == SparseConfig(0.1, recent_blocks=2)
    assert "sparse" not in to_kwargs(CacheConfig.from_kwargs(**GEOMETRY))


def test_a_sparse_setting_of_another_type_is_refused_by_name():
    with pytest.raises(TypeError, match="sparse must be a SparseConfig, a budget .* got str"):
        CacheConfig.from_kwargs(**GEOMETRY, sparse="5%")


def test_sparse_on_a_cache_whose_every_layer_slides_is_refused():
    with pytest.raises(ValueError, match="every layer of this cache has a sliding window"):
        CacheConfig.from_kwargs(**GEOMETRY, sliding_window=16, sparse=0.1)
    # One global layer is enough.
    CacheConfig.from_kwargs(**GEOMETRY, sliding_window=[16, None], sparse=0.1)
