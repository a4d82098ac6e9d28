"""Every keyword the other caches take (OffloadedKVCache, ShardedKVCache, kv_cache) is taken
by HostPoolKVCache or refused naming it, with why: never a raw "unexpected keyword
argument" from deep inside."""

from __future__ import annotations

import inspect
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core.config import CacheConfig, keyword_names

BASE = dict(
    num_layers=2, batch=1, max_len=512, num_kv_heads=2, head_dim=8, dtype=jnp.float32
)  # fmt: skip


def other_caches_keywords() -> set[str]:
    """The named keywords of the other caches' signatures (CacheConfig's through them)."""
    names: set[str] = set()
    for made in (tps.OffloadedKVCache.__init__, tps.ShardedKVCache.__init__, tps.kv_cache):
        for p in inspect.signature(made).parameters.values():
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
                names.add(p.name)
    names.discard("self")
    return names | set(keyword_names())


def sample_values(tmp_path) -> dict[str, object]:
    """A value other than the default for each keyword, as a user of another cache passes it."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "spill").mkdir()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("h",))
    return dict(
        config=CacheConfig.from_kwargs(**BASE),
        engine=tps.EngineConfig(),
        mesh=mesh,
        kv_heads_axis="h",
        batch_axis="b",
        shard=1,
        kv_sharing=[None, 0],
        bound_windows=False,
        window_cache_blocks=4,
        num_layers=3,
        batch=2,
        max_len=1024,
        num_kv_heads=4,
        head_dim=16,
        dtype=jnp.bfloat16,
        block_tokens=128,
        num_blocks=64,
        staging_bytes=1 << 20,
        prefetch_depth=2,
        prefetch_across_steps=False,
        max_step_tokens=64,
        sliding_window=256,
        tier="file",
        path=str(tmp_path),
        shm_name=f"tpusync-kw-{uuid.uuid4().hex[:8]}",
        file_name="pool.kv",
        overwrite=True,
        tier_dtype="int8",
        verify=True,
        resident=True,
        read_in_place=True,
        debug_poison=True,
        model_id="m",
        prefix_salt=b"salt",
        shared_prefix_dir=str(tmp_path / "shared"),
        remote_prefix=None,
        spill_path=str(tmp_path / "spill"),
        spill_blocks=16,
        promote_after=3,
        sparse=0.05,
    )


def test_every_keyword_of_the_other_caches_is_taken_or_refused_by_name(tmp_path):
    values = sample_values(tmp_path)
    names = other_caches_keywords()
    assert names <= set(values), f"no sample value for {sorted(names - set(values))}"
    outcomes = {}
    for name in sorted(names):
        keywords = {name: values[name]} if name == "config" else {**BASE, name: values[name]}
        try:
            tps.HostPoolKVCache(**keywords).close()
        except (TypeError, ValueError) as e:
            message = str(e)
            assert "unexpected keyword argument" not in message, (name, message)
            assert name in message, (name, message)
            outcomes[name] = "refused"
        else:
            outcomes[name] = "taken"
    # What the other caches' engine feeds, and kv_cache()'s choice of cache, are refused.
    for name in ("engine", "shard", "kv_sharing", "bound_windows", "window_cache_blocks"):
        assert outcomes[name] == "refused", name


@pytest.mark.parametrize(
    "name, value, why",
    [
        ("engine", tps.EngineConfig(), "no engine"),
        ("kv_sharing", [None, 0], "hybrid cache"),
        ("window_cache_blocks", 4, "hybrid cache"),
        ("bound_windows", False, "max_step_tokens="),
        ("shard", 1, "mesh="),
    ],
)
def test_the_other_caches_own_keywords_are_refused_saying_why(name, value, why):
    with pytest.raises(ValueError, match=rf"^{name}=.*{why}.*\(host-pool cache\)"):
        tps.HostPoolKVCache(**BASE, **{name: value})


@pytest.mark.parametrize(
    "name, value", [("engine", None), ("shard", 0), ("kv_sharing", None), ("bound_windows", None)]
)
def test_the_other_caches_defaults_are_taken(name, value):
    tps.HostPoolKVCache(**BASE, **{name: value}).close()
