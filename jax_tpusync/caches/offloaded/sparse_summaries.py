"""A sparse offloaded cache's host side: block summaries recomputed from the tier's rows
where KV enters other than by a step, and the prediction counts read back as stats.

A step keeps the summaries of the blocks it writes (:mod:`jax_tpusync.step.sparse_layer`).
KV that enters between steps gets its blocks' summaries here, from the rows the tier holds
(:func:`jax_tpusync.sparse.summaries.of_keys` of the keys read back, so whatever the route
was, the summaries describe the bytes a step will read):

* a fresh state (``init``, ``recover``; also a persistent tier's re-attach, whose first
  ``init`` starts from the committed lengths): every block a slot maps below its length;
* ``load``: the blocks the loaded rows touch;
* ``admit`` of a cached prefix (blocks of this cache's prefix index, or imported from a
  shared directory or a remote level; a P/D transfer's rows, admitted at their length):
  the prefix's blocks;
* a state of an older epoch, drained (the host may have written rows through a later
  one since): every block below its lengths.

The summaries live in the state's arrays (on the CPU backend, host memory): 2 x
``num_layers x num_blocks x num_kv_heads x head_dim`` values of the key dtype, ``2 /
block_tokens`` of the K bytes (``1 / block_tokens`` of K and V).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_tpusync.core.host_io import HostRows
from jax_tpusync.core.state import CacheSpec, KVState, SparseState
from jax_tpusync.sparse import prediction

__all__ = ["combined_stats", "fresh_sparse", "refreshed", "sparse_stats", "with_slot_reset"]


def read_keys(rows: HostRows, layer: int, slot: int, start: int, stop: int) -> np.ndarray:
    """float32[stop - start, H, D]: ``slot``'s keys of positions ``[start, stop)`` in
    ``layer``, as the tier holds them (dequantized from a quantized tier)."""
    buf = rows.row_buffer((stop - start,))
    runs, mem = [], 0
    for tier, offset, n in rows.runs(layer, 0, slot, start, stop):
        runs.append((tier, offset, mem, n))
        mem += n
    rows.engine.transfer(runs, buf, write=False)
    return np.asarray(rows.from_rows(buf), np.float32)


def block_summaries(
    spec: CacheSpec, keys: np.ndarray, first_position: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` float32[blocks, H, D] of ``keys`` (positions ``first_position`` on, a
    multiple of ``block_tokens``), one per block they touch."""
    bt = spec.block_tokens
    assert first_position % bt == 0
    n = keys.shape[0]
    blocks = -(-n // bt)
    pad = blocks * bt - n
    shape = (blocks, bt, spec.num_kv_heads, spec.head_dim)
    lo = np.pad(keys, ((0, pad), (0, 0), (0, 0)), constant_values=np.inf).reshape(shape)
    hi = np.pad(keys, ((0, pad), (0, 0), (0, 0)), constant_values=-np.inf).reshape(shape)
    return lo.min(axis=1), hi.max(axis=1)


def refreshed(
    spec: CacheSpec,
    rows: HostRows,
    sparse: SparseState,
    tables: np.ndarray,  # int[batch, max_blocks]: the slots' block tables
    spans: list[tuple[int, int, int, int]],  # (layer, slot, start, stop): positions to cover
    valid: np.ndarray,  # int[num_layers, batch]: each slot's rows that hold KV, per layer
) -> SparseState:
    """``sparse`` with the summaries of every block that positions ``[start, stop)`` of
    ``slot`` in ``layer`` touch recomputed from the tier: each block from its first row
    to the slot's last valid one (``valid``)."""
    bt = spec.block_tokens
    layers, ids, los, his = [], [], [], []
    for layer, slot, start, stop in spans:
        if stop <= start:
            continue
        first = start // bt * bt
        end = min(-(-stop // bt) * bt, int(valid[layer, slot]))
        if end <= first:
            continue
        lo, hi = block_summaries(spec, read_keys(rows, layer, slot, first, end), first)
        physical = tables[slot, first // bt : first // bt + lo.shape[0]]
        layers.append(np.full(lo.shape[0], layer))
        ids.append(physical)
        los.append(lo)
        his.append(hi)
    if not ids:
        return sparse
    layer_ix, block_ix = np.concatenate(layers), np.concatenate(ids)
    dtype = spec.summary_dtype
    lo = sparse.lo.at[layer_ix, block_ix].set(jnp.asarray(np.concatenate(los), dtype))
    hi = sparse.hi.at[layer_ix, block_ix].set(jnp.asarray(np.concatenate(his), dtype))
    return sparse.replace(lo=lo, hi=hi)


def fresh_sparse(
    spec: CacheSpec, rows: HostRows, tables: np.ndarray, lengths: np.ndarray
) -> SparseState:
    """A fresh state's sparse part: no prediction, no counts, and the summaries of every
    block each slot maps below its length, from the tier."""
    sparse = SparseState.empty(spec)
    lengths = np.asarray(lengths, np.int64)
    spans = [
        (layer, b, 0, int(lengths[b]))
        for layer in range(spec.num_layers)
        for b in range(spec.batch)
        if lengths[b] > 0
    ]
    valid = np.broadcast_to(lengths, (spec.num_layers, spec.batch))
    return refreshed(spec, rows, sparse, tables, spans, valid)


def with_slot_reset(sparse: SparseState, slot: int) -> SparseState:
    """``sparse`` with ``slot``'s previous selections dropped (a new sequence, or none)."""
    return sparse.replace(previous=sparse.previous.at[:, slot].set(-1))


def combined_stats(parts: list[dict]) -> dict:
    """The :func:`sparse_stats` of several parts (a mesh cache's shards) summed: blocks and
    bytes add up, the shares and rates are taken over the sums."""
    layers = []
    for rows in zip(*(p["layers"] for p in parts)):
        row = {name: sum(r[name] for r in rows) for name in (*prediction.COUNTS, "context_blocks")}
        row["sparse"] = rows[0]["sparse"]
        row["hit_rate"] = row["hits"] / row["predicted"] if row["predicted"] else None
        row["bytes"] = {name: sum(r["bytes"][name] for r in rows) for name in rows[0]["bytes"]}
        layers.append(row)
    totals = {name: sum(p["bytes"][name] for p in parts) for name in parts[0]["bytes"]}
    steps = parts[0]["steps"]
    return dict(
        steps=steps,
        layers=layers,
        bytes=totals,
        read_share=totals["read"] / totals["dense"] if totals["dense"] else None,
        bytes_per_step=dict(
            read=totals["read"] / steps if steps else 0.0,
            dense=totals["dense"] / steps if steps else 0.0,
        ),
    )


def sparse_stats(spec: CacheSpec, state: KVState) -> dict:
    """The prediction counts and bytes of ``state``'s sparse decode steps since its
    ``init`` (see :meth:`jax_tpusync.OffloadedKVCache.sparse_stats`)."""
    counts = np.asarray(state.sparse.counts, np.int64)  # [num_layers, 5]
    steps = int(np.asarray(state.sparse.steps))
    kv_block = 2 * spec.block_bytes  # K and V of one block
    summary_block = 2 * spec.num_kv_heads * spec.head_dim * spec.summary_dtype.itemsize
    layers = []
    totals = dict(summaries=0, predicted=0, late=0, dense=0)
    for layer in range(spec.num_layers):
        row = dict(zip(prediction.COUNTS, (int(x) for x in counts[layer, :4])))
        context = int(counts[layer, 4])
        row["context_blocks"] = context
        sparse_layer = spec.windows[layer] is None
        row["sparse"] = sparse_layer
        row["hit_rate"] = row["hits"] / row["predicted"] if row["predicted"] else None
        bytes_read = dict(
            summaries=context * summary_block,
            predicted=row["predicted"] * kv_block,
            late=row["late"] * kv_block,
            dense=context * kv_block,
        )
        row["bytes"] = bytes_read
        for name, value in bytes_read.items():
            totals[name] += value
        layers.append(row)
    read = totals["summaries"] + totals["predicted"] + totals["late"]
    return dict(
        steps=steps,
        layers=layers,
        bytes=dict(totals, read=read),
        read_share=read / totals["dense"] if totals["dense"] else None,
        bytes_per_step=dict(
            read=read / steps if steps else 0.0,
            dense=totals["dense"] / steps if steps else 0.0,
        ),
    )
