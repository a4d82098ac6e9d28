"""Persistence of an offloaded cache: geometry guard, commits, restart, checksums, failures."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.persist import commit as persistence
from jax_tpusync.persist import manifest

from support import child_env
from support.tier_files import data_path, manifest_path

LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM, Q_HEADS = 2, 2, 64, 2, 16, 4
ROW_BYTES = KV_HEADS * HEAD_DIM * 4
CHUNK_ROWS = 8  # Small chunks, so that sequences span full and partial chunks.
CONTEXT = np.array([20, 13])
HEADER_BYTES = 4096  # The tiers' header page, before the data.


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(persistence, "CHUNK_TARGET_BYTES", CHUNK_ROWS * ROW_BYTES)


def make(where, **kwargs) -> tps.OffloadedKVCache:
    args = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        staging_bytes=1 << 20,
    )
    args.update(where)
    args.update(kwargs)
    return tps.OffloadedKVCache(**args)


def load_context(cache, seed=0):
    """Loads a ragged random context; returns (state, k, v) with k, v [L, B, n, H, D]."""
    rng = np.random.default_rng(seed)
    n = int(CONTEXT.max())
    k = rng.standard_normal((LAYERS, BATCH, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, BATCH, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
    state = cache.init()
    for layer in range(LAYERS):
        state = cache.load(state, layer, k[layer], v[layer], lengths=CONTEXT)
    return state, k, v


def decode_step():
    """One jitted decode step over every layer; k and v are the new rows [L, B, 1, H, D]."""

    def step(q, k, v, state):
        outs = []
        for layer in range(LAYERS):
            o, state = tps.prefetching_attention(q[layer], k[layer], v[layer], state, layer=layer)
            outs.append(o)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=(3,))


def new_rows(rng):
    q = rng.standard_normal((LAYERS, BATCH, 1, Q_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((LAYERS, BATCH, 1, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, BATCH, 1, KV_HEADS, HEAD_DIM)).astype(np.float32)
    return q, k, v


def flip_bit(where, cache, layer, kv, b, row, byte=0, bit=0):
    """Flips one bit of position ``row`` of sequence ``b`` (through its block table)
    directly in the tier's backing file."""
    shift = cache.engine.tier_info(cache.tier).alignment_offset if where["tier"] == "file" else 0
    ((tier_offset, _),) = cache.tier_rows(layer, kv, b, row, row + 1)
    offset = HEADER_BYTES + shift + tier_offset + byte
    with open(data_path(where), "r+b") as f:
        f.seek(offset)
        (old,) = f.read(1)
        f.seek(offset)
        f.write(bytes([old ^ (1 << bit)]))
        f.flush()
        os.fsync(f.fileno())


# -- geometry and model guard -------------------------------------------------------------

# Each case keeps the tier's byte size where it can, so that only the manifest can tell.
# (MAX_LEN tokens make one block of 64 by default, so a slot is one block.)
GEOMETRY_CASES = {
    "num_layers": (dict(num_layers=1, batch=4), LAYERS, 1),
    "batch": (dict(batch=1, max_len=2 * MAX_LEN), BATCH, 1),
    "max_len": (dict(max_len=2 * MAX_LEN, num_kv_heads=1), MAX_LEN, 2 * MAX_LEN),
    "num_kv_heads": (dict(num_kv_heads=4, head_dim=HEAD_DIM // 2), KV_HEADS, 4),
    "head_dim": (dict(head_dim=2 * HEAD_DIM, num_kv_heads=1), HEAD_DIM, 2 * HEAD_DIM),
    "dtype": (dict(dtype=jnp.bfloat16, max_len=2 * MAX_LEN), "float32", "bfloat16"),
    "model_id": (dict(model_id="other-model"), "unspecified", "other-model"),
    "block_tokens": (dict(block_tokens=32, num_kv_heads=4, num_blocks=2), 64, 32),
    "num_blocks": (dict(num_blocks=4, num_layers=1), BATCH, 4),
}


def test_max_len_mismatch_names_max_len_not_the_block_size(where):
    """A longer max_len with the same block size: nothing but max_len differs."""
    make(where, block_tokens=16).close()
    with pytest.raises(persistence.LayoutMismatchError) as info:
        make(where, block_tokens=16, max_len=2 * MAX_LEN, num_blocks=BATCH * MAX_LEN // 16)
    message = str(info.value)
    assert f"max_len: the tier holds {MAX_LEN}, this cache has {2 * MAX_LEN}" in message
    assert "block" not in message.split("does not belong to this cache:")[1]


@pytest.mark.parametrize("field", sorted(GEOMETRY_CASES))
def test_geometry_mismatch_names_the_field(where, field):
    changes, held, have = GEOMETRY_CASES[field]
    make(where).close()
    with pytest.raises(persistence.LayoutMismatchError) as info:
        make(where, **changes)
    assert f"{field}: the tier holds {held!r}, this cache has {have!r}" in str(info.value)
    assert "layout mismatch" in str(info.value)
    with make(where) as cache:  # The refused open changed nothing.
        assert cache.engine.tier_info(cache.tier).attached


def test_layout_version_mismatch_is_named(where, monkeypatch):
    make(where).close()
    held = persistence.LAYOUT_VERSION
    monkeypatch.setattr(manifest, "LAYOUT_VERSION", held + 1)  # What Geometry.of records.
    with pytest.raises(
        persistence.LayoutMismatchError, match=f"layout_version: the tier holds {held}, "
    ):
        make(where)


def test_different_model_ids_never_attach(where):
    make(where, model_id="model-a").close()
    with pytest.raises(persistence.LayoutMismatchError, match="model_id: the tier holds 'model-a'"):
        make(where, model_id="model-b")
    with pytest.raises(persistence.LayoutMismatchError, match="this cache has 'unspecified'"):
        make(where)
    make(where, model_id="model-a").close()


def test_mismatch_error_is_a_tpusync_error(where):
    make(where).close()
    with pytest.raises(tps.TpusyncError):
        make(where, num_kv_heads=4, head_dim=HEAD_DIM // 2)


# -- manifest and commits ------------------------------------------------------------------


def test_new_cache_writes_commit_zero(where):
    with make(where, model_id="m") as cache:
        m = json.loads(manifest_path(where).read_text())
        assert m["commit"] == 0 and m["lengths"] == [0] * BATCH
        assert m["model_id"] == "m" and m["geometry"]["num_kv_heads"] == KV_HEADS
        assert m["geometry"]["layout_version"] == persistence.LAYOUT_VERSION
        assert m["geometry"]["dtype"] == "float32" and m["geometry"]["head_dim"] == HEAD_DIM
        assert m["geometry"]["block_tokens"] == cache.spec.block_tokens == 64
        assert m["geometry"]["num_blocks"] == cache.spec.num_blocks == BATCH
        assert m["block_tables"] == [[-1]] * BATCH and m["capacity"] == [0] * BATCH
        assert cache.committed_lengths.tolist() == [0] * BATCH


def test_commit_restores_lengths_and_rows(where):
    with make(where) as cache:
        state, k, v = load_context(cache)
        state = cache.commit(state)
        cache.close(state)
    m = json.loads(manifest_path(where).read_text())
    assert m["commit"] == 2 and m["lengths"] == CONTEXT.tolist() and m["session"] == "closed"
    assert m["block_tables"] == [[0], [1]] and m["capacity"] == [MAX_LEN] * BATCH
    with make(where) as cache:
        np.testing.assert_array_equal(cache.block_tables, [[0], [1]])
        state = cache.init()
        np.testing.assert_array_equal(np.asarray(state.lengths), CONTEXT)
        np.testing.assert_array_equal(np.asarray(state.block_table), [[0], [1]])
        for layer in range(LAYERS):
            got_k, got_v = cache.read_all(layer, CONTEXT)
            for b in range(BATCH):
                n = CONTEXT[b]
                np.testing.assert_array_equal(got_k[b, :n], k[layer, b, :n])
                np.testing.assert_array_equal(got_v[b, :n], v[layer, b, :n])


def test_incremental_checksums_match_a_full_verify(where):
    """Commits after each decode step hash only appended rows; a from-scratch verify of
    the result (in a re-opened cache) agrees, across chunk boundaries."""
    rng = np.random.default_rng(1)
    step = decode_step()
    with make(where) as cache:
        state, _, _ = load_context(cache)
        state = cache.commit(state)
        for _ in range(6):  # Sequence 1 crosses row 16, a chunk boundary.
            _, state = step(*new_rows(rng), state)
            state = cache.commit(state)
        assert cache.verify(state).chunks > 0
        cache.close(state)
    with make(where) as cache:
        np.testing.assert_array_equal(cache.committed_lengths, CONTEXT + 6)
        cache.verify()


def test_load_rewriting_committed_rows_is_rehashed(where):
    with make(where) as cache:
        state, k, v = load_context(cache)
        state = cache.commit(state)
        rows = np.ones((BATCH, 3, KV_HEADS, HEAD_DIM), np.float32)
        state = cache.load(state, 0, rows, rows, start=5)
        assert cache.verify().skipped_chunks > 0  # Rewritten chunks have no checksum yet.
        cache.close(state)
    with make(where) as cache:  # Verified on open: the new rows carry new checksums.
        got_k, _ = cache.read_all(0, CONTEXT)
        np.testing.assert_array_equal(got_k[:, 5:8], rows)


def test_init_below_the_commit_commits_the_shorter_lengths(where):
    with make(where) as cache:
        state, _, _ = load_context(cache)
        cache.close(state)
    with make(where) as cache:
        # Past the commit: rows no commit covers (here never written) are refused.
        with pytest.raises(ValueError, match=r"lengths\[1\]=14 is past slot 1's committed"):
            cache.init([4, 14])
        state = cache.init([4, 13])
        np.testing.assert_array_equal(cache.committed_lengths, [4, 13])
        cache.close(cache.commit(state))
    assert json.loads(manifest_path(where).read_text())["lengths"] == [4, 13]


def test_non_persistent_commit_only_drains(tmp_path):
    with make(dict(tier="file", path=tmp_path)) as cache:
        state, _, _ = load_context(cache)
        state = cache.commit(state)
        assert cache.committed_lengths is None
        with pytest.raises(ValueError, match="persistent tier"):
            cache.verify()
    assert not list(tmp_path.glob("*manifest*"))


# -- data without a manifest ---------------------------------------------------------------


def test_data_without_manifest_is_refused_until_overwrite(where):
    with make(where) as cache:
        state, _, _ = load_context(cache)
        cache.close(state)
    manifest_path(where).unlink()
    with pytest.raises(persistence.MissingManifestError, match="overwrite=True"):
        make(where)
    with make(where, overwrite=True) as cache:
        assert not cache.engine.tier_info(cache.tier).attached
        np.testing.assert_array_equal(np.asarray(cache.init().lengths), [0, 0])
        k, _ = cache.read_all(0)
        assert not k.any()  # The old contents are gone.
    assert json.loads(manifest_path(where).read_text())["commit"] == 0


def test_corrupt_manifest_is_refused(where):
    make(where).close()
    manifest_path(where).write_text("{not json")
    with pytest.raises(persistence.MissingManifestError, match="cannot use manifest"):
        make(where)
    make(where, overwrite=True).close()


def test_overwrite_discards_a_mismatched_cache(where):
    make(where).close()
    with make(where, num_kv_heads=4, head_dim=HEAD_DIM // 2, overwrite=True) as cache:
        assert cache.spec.num_kv_heads == 4


# -- checksums ------------------------------------------------------------------------------


def committed_cache(where):
    with make(where) as cache:
        state, _, _ = load_context(cache)
        cache.close(state)


@pytest.mark.parametrize("layer,kv,b,row", [(0, 0, 0, 0), (1, 1, 1, 9), (1, 0, 0, 19)])
def test_flipped_committed_bit_names_the_chunk(where, layer, kv, b, row):
    committed_cache(where)
    with make(where, verify=False) as cache:
        flip_bit(where, cache, layer, kv, b, row, byte=5, bit=3)
        lo = row // CHUNK_ROWS * CHUNK_ROWS
        hi = min(lo + CHUNK_ROWS, CONTEXT[b])
        name = f"layer {layer} {'KV'[kv]} sequence {b}, rows \\[{lo}, {hi}\\)"
        with pytest.raises(persistence.ChecksumMismatchError, match=name) as info:
            cache.verify()
        assert (info.value.layer, info.value.kv, info.value.sequence) == (layer, "KV"[kv], b)
        assert info.value.rows == (lo, hi)
    with pytest.raises(persistence.ChecksumMismatchError, match=name):
        make(where)  # verify=True on re-attach.


def test_last_byte_of_last_committed_row_is_covered(where):
    committed_cache(where)
    with make(where, verify=False) as cache:
        flip_bit(where, cache, LAYERS - 1, 1, 1, CONTEXT[1] - 1, byte=ROW_BYTES - 1, bit=7)
        with pytest.raises(persistence.ChecksumMismatchError, match=r"rows \[8, 13\)"):
            cache.verify()


def test_first_uncommitted_row_is_not_checked(where):
    committed_cache(where)
    with make(where, verify=False) as cache:
        for b in range(BATCH):
            flip_bit(where, cache, 0, 0, b, CONTEXT[b], byte=0, bit=0)
        cache.verify()
    make(where).close()


# -- restart and failures -------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from support import load_module
    t = load_module({test_file!r})
    from jax_tpusync.persist import commit as persistence
    persistence.CHUNK_TARGET_BYTES = t.CHUNK_ROWS * t.ROW_BYTES
    where = dict(tier="file", path={path!r}, file_name="kv")
    rng = np.random.default_rng(3)
    step = t.decode_step()
    cache = t.make(where)
    state, k, v = t.load_context(cache)
    written_k, written_v = [k], [v]
    for _ in range(3):
        q, nk, nv = t.new_rows(rng)
        _, state = step(q, nk, nv, state)
        written_k.append(nk)
        written_v.append(nv)
    state = cache.commit(state)
    np.save({out!r} + "/lengths.npy", np.asarray(state.lengths))
    # What the committed rows must hold: the context, then the decoded rows in order.
    shape = (t.BATCH, t.MAX_LEN, t.KV_HEADS, t.HEAD_DIM)
    for layer in range(t.LAYERS):
        for name, parts in (("k", written_k), ("v", written_v)):
            want = np.zeros(shape, np.float32)
            for b in range(t.BATCH):
                n = t.CONTEXT[b]
                want[b, :n] = parts[0][layer, b, :n]
                for i, rows in enumerate(parts[1:]):
                    want[b, n + i] = rows[layer, b, 0]
            np.save({out!r} + f"/{{name}}{{layer}}.npy", want)
    for _ in range(4):  # Uncommitted steps, then a crash.
        _, state = step(*t.new_rows(rng), state)
    np.asarray(state.lengths)
    os.kill(os.getpid(), 9)
    """
)


def test_restart_after_sigkill_restores_the_commit(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    script = CHILD.format(test_file=__file__, path=str(data), out=str(out))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=child_env(),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    lengths = np.load(out / "lengths.npy")
    np.testing.assert_array_equal(lengths, CONTEXT + 3)
    where = dict(tier="file", path=data, file_name="kv")
    with caplog.at_level(logging.WARNING, logger="jax_tpusync.persist.commit"):
        cache = make(where)
    with cache:
        assert "were not committed and are not used" in caplog.text
        state = cache.init()
        np.testing.assert_array_equal(np.asarray(state.lengths), lengths)
        for layer in range(LAYERS):
            got_k, got_v = cache.read_all(layer, lengths)
            np.testing.assert_array_equal(got_k, np.load(out / f"k{layer}.npy"))
            np.testing.assert_array_equal(got_v, np.load(out / f"v{layer}.npy"))
        # The restored cache decodes on from the commit and commits again.
        _, state = decode_step()(*new_rows(np.random.default_rng(4)), state)
        cache.close(state)
    assert (
        json.loads((data / ("kv" + persistence.MANIFEST_SUFFIX)).read_text())["lengths"]
        == (lengths + 1).tolist()
    )


class FileSizeLimit:
    """Makes writes past ``limit`` bytes of any file fail with EFBIG, like a full disk."""

    def __init__(self, limit: int):
        self.limit = limit

    def __enter__(self):
        self.old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))
        return self

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
        signal.signal(signal.SIGXFSZ, self.old_handler)


def test_failed_write_back_fails_the_commit_and_reopen_restores(tmp_path, caplog):
    where = dict(tier="file", path=tmp_path, file_name="kv")
    rng = np.random.default_rng(5)
    step = decode_step()
    cache = make(where)
    state, _, _ = load_context(cache)
    _, state = step(*new_rows(rng), state)  # Compiled before any write can fail.
    state = cache.commit(state)
    committed = CONTEXT + 1
    before = manifest_path(where).read_bytes()
    with FileSizeLimit(HEADER_BYTES):  # Every data write now fails.
        try:
            _, state = step(*new_rows(rng), state)
            np.asarray(state.lengths)
        except Exception:  # noqa: BLE001 - the step itself may see the failed write-back.
            state = cache.init(committed + 1)
        with pytest.raises(persistence.CommitError, match="commit 2 was not written") as info:
            cache.commit(state)
        assert "write-back failed" in str(info.value)
        assert manifest_path(where).read_bytes() == before
        with caplog.at_level(logging.ERROR, logger="jax_tpusync.caches.offloaded.cache"):
            cache.close(state)  # Reports, does not raise.
        assert "final commit failed" in caplog.text
    assert manifest_path(where).read_bytes() == before
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_tpusync.persist.commit"):
        cache = make(where)  # Space is back: re-open restores the last commit.
    with cache:
        assert "sequence 0 from row 21" in caplog.text
        state = cache.init()
        np.testing.assert_array_equal(np.asarray(state.lengths), committed)
        # The new engine decodes and commits again (this also replaces JAX's record of the
        # failed step, which it would otherwise report at exit).
        _, state = step(*new_rows(rng), state)
        state = cache.commit(state)
        np.testing.assert_array_equal(cache.committed_lengths, committed + 1)
        cache.close(state)


def test_failure_before_manifest_write_keeps_the_old_commit(where, monkeypatch):
    with make(where) as cache:
        state, _, _ = load_context(cache)
        state = cache.commit(state)
        before = manifest_path(where).read_bytes()

        def fail(stage):
            raise OSError(28, f"No space left on device (at {stage})")

        monkeypatch.setattr(persistence, "fault_hook", fail)
        # Rows past the committed lengths (a rewrite of committed rows commits first).
        rows = np.ones((BATCH, 3, KV_HEADS, HEAD_DIM), np.float32)
        state = cache.load(state, 0, rows, rows, start=CONTEXT)
        with pytest.raises(persistence.CommitError, match="No space left"):
            cache.commit(state)
        assert manifest_path(where).read_bytes() == before
        assert cache.committed_lengths.tolist() == CONTEXT.tolist()
        monkeypatch.setattr(persistence, "fault_hook", None)
        state = cache.commit(cache.init(CONTEXT))
    assert json.loads(manifest_path(where).read_text())["commit"] == 2
    make(where).close()


def test_a_load_over_committed_rows_commits_the_shorter_lengths_first(where):
    """Rewriting rows [2, 5) of committed sequences: the manifest first says lengths 2, so a
    crash before the next commit re-attaches (verified) to the rows the checksums cover,
    never to a ChecksumMismatchError over the whole cache. The edge: a load starting exactly
    at a committed length rewrites nothing and commits nothing."""
    cache = make(where)
    state, k, _ = load_context(cache)
    state = cache.commit(state)
    rows = np.ones((BATCH, 3, KV_HEADS, HEAD_DIM), np.float32)
    state = cache.load(state, 0, rows, rows, start=CONTEXT)  # The edge: appends only.
    assert cache.persistence.commit_number == 1
    state = cache.load(state, 0, rows, rows, start=[2, int(CONTEXT[1])])
    assert cache.persistence.commit_number == 2
    assert cache.committed_lengths.tolist() == [2, int(CONTEXT[1])]
    cache.engine.close()  # A crash before the next commit: no final commit is written.
    with make(where) as again:  # verify=True: the committed rows' checksums hold.
        assert again.committed_lengths.tolist() == [2, int(CONTEXT[1])]
        state = again.init()
        got_k, _ = again.read(state, 0, 0)
        np.testing.assert_array_equal(got_k, k[0, 0, :2])
