"""A SIGKILL between two head shards' manifest writes: re-attach brings both shards to their
common commit (the shorter lengths), never a slot at row 8 in some heads and row 5 in others."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.persist import commit as persistence

from support import child_env
from support.mesh_model import BATCH, HEAD_DIM, KV_HEADS, LAYERS, MeshTestModel

CHILD = textwrap.dedent(
    """
    import os, sys
    import jax, numpy as np
    import jax_tpusync as tps
    from jax_tpusync.persist import commit as persistence
    from support.mesh_model import MeshTestModel, LAYERS, BATCH
    mesh = jax.make_mesh((1, 2), ("data", "model"))
    cache = tps.kv_cache(**MeshTestModel.cache_args(), mesh=mesh, kv_heads_axis="model",
                         tier="file", path={path!r}, file_name="kv")
    model = MeshTestModel()
    state = cache.init()
    for layer in range(LAYERS):
        state = cache.load(state, layer, model.context_k[layer], model.context_v[layer],
                           lengths=[5] * BATCH)
    state = cache.commit(state)
    for layer in range(LAYERS):
        state = cache.load(state, layer, model.context_k[layer, :, 5:8],
                           model.context_v[layer, :, 5:8], start=5)
    writes = []
    def kill_at_second_shard(stage):
        writes.append(stage)
        if len(writes) == 2:  # Shard 0's manifest is written; shard 1's is not.
            os.kill(os.getpid(), 9)
    persistence.fault_hook = kill_at_second_shard
    cache.commit(state)
    """
)


def test_a_kill_between_the_shards_commits_reattaches_to_the_common_lengths(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    env = child_env()
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    script = CHILD.format(path=str(data))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
        cwd="/",  # Not the source tree, whose package has no built extension.
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    mesh = jax.make_mesh((1, 2), ("data", "model"))
    args = dict(
        **MeshTestModel.cache_args(),
        mesh=mesh,
        kv_heads_axis="model",
        tier="file",
        path=str(data),
        file_name="kv",
    )
    # What each shard's manifest holds on its own: shard 0 committed 8 rows, shard 1 only 5.
    with caplog.at_level(logging.WARNING, logger="jax_tpusync.caches.offloaded.mesh"):
        cache = tps.kv_cache(**args)
    assert "left at different commits" in caplog.text and "shard 0" in caplog.text
    with cache:
        np.testing.assert_array_equal(cache.committed_lengths, [5] * BATCH)
        state = cache.init()
        np.testing.assert_array_equal(cache.lengths(state), [5] * BATCH)
        model = MeshTestModel()
        for slot in range(BATCH):
            k, v = cache.read(state, 0, slot)
            np.testing.assert_array_equal(k, model.context_k[0, slot, :5])
            np.testing.assert_array_equal(v, model.context_v[0, slot, :5])
        logits, _, state = model.run_offloaded(cache, state)
        assert all(np.isfinite(np.asarray(l)).all() for l in logits)
        np.testing.assert_array_equal(cache.lengths(state), [5 + 3] * BATCH)
        cache.close(state)
    # The reconciled commit is every shard's: a second re-attach finds nothing to mend.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_tpusync.caches.offloaded.mesh"):
        with tps.kv_cache(**args) as again:
            np.testing.assert_array_equal(again.committed_lengths, [8] * BATCH)
    assert "left at different commits" not in caplog.text


@pytest.mark.parametrize("torn_release", [True])
def test_a_slot_released_in_one_head_shard_only_is_released_in_all(tmp_path, torn_release):
    """A release whose commit reached one head shard only: re-attach releases the slot in
    the other shard too (its KV dropped), so no head range decodes a sequence the others
    forgot."""
    mesh = jax.make_mesh((1, 2), ("data", "model"))
    args = dict(
        **MeshTestModel.cache_args(),
        mesh=mesh,
        kv_heads_axis="model",
        tier="file",
        path=str(tmp_path),
        file_name="kv",
    )
    model = MeshTestModel()
    with tps.kv_cache(**args) as cache:
        state = cache.init()
        for layer in range(LAYERS):
            state = cache.load(
                state, layer, model.context_k[layer], model.context_v[layer], lengths=[4] * BATCH
            )
        state = cache.commit(state)
        # Shard 1 alone releases slot 2 (what a crash inside release's commits leaves).
        shard = cache.shards[1]
        part = cache.split(state)[1]
        shard.release(part, 2)
        cache.shards[0].close()
        shard.close()
        cache.engine.close()
    with tps.kv_cache(**args) as cache:
        np.testing.assert_array_equal(cache.capacity[2], 0)
        np.testing.assert_array_equal(cache.committed_lengths, [4, 4, 0, 4])
        state = cache.init()
        k, _ = cache.read(state, 0, 0)
        np.testing.assert_array_equal(k, model.context_k[0, 0, :4])
        assert k.shape == (4, KV_HEADS, HEAD_DIM)
        cache.close(state)


def test_a_crash_between_the_shards_commits_cuts_every_shards_token_ids_there(
    tmp_path, monkeypatch
):
    """A commit that reached head shard 0 only (8 rows; shard 1 keeps 5): re-attach brings
    the slot's token ids to 5 in every shard too, so a continued slot released without
    ``tokens=`` indexes its blocks under the ids whose KV they hold."""
    mesh = jax.make_mesh((1, 2), ("data", "model"))
    args = dict(
        **MeshTestModel.cache_args(block_tokens=4),
        mesh=mesh,
        kv_heads_axis="model",
        tier="file",
        path=str(tmp_path),
        file_name="kv",
    )
    ids = np.arange(300, 308)

    def load_rows(cache, state, lo, hi, seed):
        k = np.zeros((BATCH, hi - lo, KV_HEADS, HEAD_DIM), np.float32)
        k[0] = np.random.default_rng(seed).standard_normal(k.shape[1:])
        for layer in range(LAYERS):
            state = cache.load(state, layer, k, -k, start=lo, lengths=[hi - lo, 0, 0, 0])
        return state, k[0]

    with tps.kv_cache(**args) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=ids)
        state, _ = load_rows(cache, state, 0, 5, seed=1)
        state = cache.commit(state)
        state, _ = load_rows(cache, state, 5, 8, seed=2)
        seen = []

        def kill_at_second_shard(stage):
            seen.append(stage)
            if len(seen) == 2:  # Shard 0's manifest is written; shard 1's is not.
                raise RuntimeError("killed at shard 1's manifest write")

        monkeypatch.setattr(persistence, "fault_hook", kill_at_second_shard)
        with pytest.raises(persistence.CommitError, match="killed at shard 1's manifest write"):
            cache.commit(state)
        monkeypatch.setattr(persistence, "fault_hook", None)
        assert [int(c.committed_lengths[0]) for c in cache.shards.values()] == [8, 5]
    with tps.kv_cache(**args) as cache:
        np.testing.assert_array_equal(cache.committed_lengths, [5, 0, 0, 0])
        for shard in cache.shards.values():
            np.testing.assert_array_equal(shard.tokens(0), ids[:5])
        np.testing.assert_array_equal(cache.tokens(0), ids[:5])
        state = cache.init(admit=False)
        state, rows = load_rows(cache, state, 5, 8, seed=3)
        other = np.arange(900, 903)
        cache.extend_tokens(0, other)
        state = cache.release(state, 0)
        # The first ids' rows 5-7 were never committed: their second block is not indexed.
        state, cached = cache.admit(state, 1, tokens=np.concatenate([ids, [7]]))
        assert cached == 4
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 1, tokens=np.concatenate([ids[:5], other, [7]]))
        assert cached == 8
        k, v = cache.read(state, 0, 1, 5, 8)
        np.testing.assert_array_equal(k, rows)
        np.testing.assert_array_equal(v, -rows)
        cache.close(state)
