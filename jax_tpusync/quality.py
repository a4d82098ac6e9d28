"""``compare_sparse``: run a model's own decode step dense and sparse over its own context,
and say how far sparse decode moves it.

No long-context checkpoint can be downloaded where this library is developed, so its own
quality figures are from constructed tasks (``python -m jax_tpusync.bench sparse`` and
``retrieval``); this call measures a user's checkpoint, on the user's machine.

The step keeps its usual form, with the attention passed in::

    def step(params, tokens, state, attention=jax_tpusync.prefetching_attention):
        ...  # per layer: out, state = attention(q, k, v, state, layer=layer, ...)
        return logits, state  # logits f32[batch, vocab] (or [batch, T, vocab]: the last row)

:func:`compare_sparse` makes two resident caches (``OffloadedKVCache(resident=True)``: the
KV also kept on the device, where a plain-jnp attention can read it), prefills both with
the context through the step (densely, as a sparse cache prefills too), then decodes
``decode_steps`` tokens: the dense run greedily, the sparse run fed the dense run's tokens
(so each step compares the next-token choice given one history). In the sparse run, each
layer's decode row attends through the sparse reference
(:func:`jax_tpusync.sparse.measure.measure`: the block summaries, the selection under the
budget, the layer-ahead prediction and its late blocks, attention over what a sparse step
reads), in place of the cache's dense attention; the rows are written to the cache as
always. It measures the selection rule a sparse cache applies, not a sparse cache's data
path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.core.state import KVState
from jax_tpusync.sparse import SparseConfig
from jax_tpusync.sparse import measure as sparse_measure
from jax_tpusync.sparse.prediction import COUNTS
from jax_tpusync.step.device import device_attention
from jax_tpusync.step.unit import from_bits

__all__ = ["SparseComparison", "compare_sparse"]

# Keywords compare_sparse sets itself.
_OWN_KEYWORDS = ("resident", "batch")


@dataclasses.dataclass(frozen=True)
class SparseComparison:
    """What :func:`compare_sparse` measured.

    Attributes:
      budget: the sparse budget (a share of each layer's context blocks, or blocks).
      decode_steps: the decode steps compared.
      recall: float[layers]: the share of the dense softmax weight the exact selection
        holds, averaged over the sparse run's steps, sequences and query heads.
      recall_min: float[layers]: its smallest value at any step, sequence and head.
      error: float[layers]: the relative error of a layer's attention output over what the
        sparse step reads against dense attention over the same KV (mean).
      hit_rate: float[layers]: the blocks the layer-ahead prediction prefetched that the
        exact selection used (as ``OffloadedKVCache.sparse_stats`` counts it).
      coverage: float[layers]: the exact selection's blocks the prediction had prefetched
        (the rest are fetched late; the first decode step has no previous selection).
      counts: int[layers, 4]: predicted, hits, late, wasted blocks, summed over the steps.
      max_abs_logit_diff, mean_abs_logit_diff: sparse against dense logits, every step.
      top1_agreement: the share of steps x sequences whose sparse argmax is the dense one.
      dense_logits, sparse_logits: float32[steps, batch, vocab].
      dense_tokens: int32[steps, batch]: the dense run's greedy tokens (fed to both runs:
        step ``i`` is given ``dense_tokens[i - 1]``, step 0 the prefill's).
    """

    budget: float | int
    decode_steps: int
    recall: np.ndarray
    recall_min: np.ndarray
    error: np.ndarray
    hit_rate: np.ndarray
    coverage: np.ndarray
    counts: np.ndarray
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    top1_agreement: float
    dense_logits: np.ndarray
    sparse_logits: np.ndarray
    dense_tokens: np.ndarray

    def summary(self) -> str:
        """The comparison in words, one line per layer after the totals."""
        budget = (
            f"{100 * self.budget:g}% of the blocks"
            if isinstance(self.budget, float)
            else f"{self.budget} blocks"
        )
        lines = [
            f"sparse at {budget} against dense over {self.decode_steps} decode steps: the "
            f"next token agrees in {100 * self.top1_agreement:.1f}% of them; logits move by "
            f"{self.mean_abs_logit_diff:.3g} on average, at most {self.max_abs_logit_diff:.3g}"
        ]
        for layer in range(len(self.recall)):
            lines.append(
                f"  layer {layer}: recall {self.recall[layer]:.4f} (lowest "
                f"{self.recall_min[layer]:.4f}), output error {self.error[layer]:.4f}, "
                f"prediction hit rate {self.hit_rate[layer]:.3f}, coverage "
                f"{self.coverage[layer]:.3f}"
            )
        return "\n".join(lines)


def compare_sparse(
    step: Callable,
    params: Any,
    context: Any,
    *,
    sparse: SparseConfig | float | int = 0.05,
    decode_steps: int = 16,
    prefill_chunk: int = 512,
    **cache_keywords: Any,
) -> SparseComparison:
    """Runs ``step`` over ``context`` dense and sparse and compares them (see the module).

    Args:
      step: ``step(params, tokens int32[batch, T], state, attention) -> (logits, state)``,
        calling ``attention`` (signature of :func:`jax_tpusync.prefetching_attention`)
        once per layer with ``layer`` a Python int; logits f32[batch, vocab] or [batch, T,
        vocab] (the last row is used). It is jitted here.
      params: the step's parameters.
      context: int tokens [batch, T] (or [T]: one sequence), T >= 1; every sequence has
        the same length.
      sparse: a :class:`~jax_tpusync.sparse.SparseConfig`, or its budget (a float share of
        each layer's context blocks, or an int count).
      decode_steps: decode steps compared (>= 1).
      prefill_chunk: context tokens per prefill call (>= 1).
      **cache_keywords: :class:`~jax_tpusync.OffloadedKVCache`'s keywords
        (``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``block_tokens``, ...);
        ``max_len`` defaults to ``T + decode_steps``. ``batch`` and ``resident`` are
        set here; the cache keeps every position of one device (no sliding
        window, no quantized tier, no mesh).

    Returns:
      A :class:`SparseComparison` (``.summary()`` says it in words).
    """
    for name in _OWN_KEYWORDS:
        if name in cache_keywords:
            raise ValueError(f"compare_sparse sets {name}= itself: drop it from the keywords")
    config = sparse if isinstance(sparse, SparseConfig) else SparseConfig(budget=sparse)
    context = np.asarray(context)
    if context.ndim == 1:
        context = context[None]
    if context.ndim != 2 or context.shape[1] < 1 or not np.issubdtype(context.dtype, np.integer):
        raise ValueError(
            f"context must be int tokens [batch, T] or [T] with T >= 1, got "
            f"{context.dtype}{list(context.shape)}"
        )
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 1:
        raise ValueError(f"decode_steps={decode_steps!r} must be an int >= 1")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be an int >= 1")
    batch, length = context.shape
    cache_keywords.setdefault("max_len", length + decode_steps)
    if cache_keywords["max_len"] < length + decode_steps:
        raise ValueError(
            f"max_len={cache_keywords['max_len']} is less than the context ({length}) plus "
            f"decode_steps ({decode_steps})"
        )

    prefill = jax.jit(
        lambda p, tokens, state: step(p, tokens, state, _dense_attention),
        donate_argnums=(2,),
    )
    runs = {}
    for mode in ("dense", "sparse"):
        with OffloadedKVCache(batch=batch, resident=True, **cache_keywords) as cache:
            state = cache.init(np.zeros(batch, np.int32))
            _check_state(state)
            for lo in range(0, length, prefill_chunk):
                logits, state = prefill(
                    params, jnp.asarray(context[:, lo : lo + prefill_chunk], jnp.int32), state
                )
            first = _last_row(logits)
            fed = None if mode == "dense" else runs["dense"]["tokens"]
            runs[mode] = _decode(step, params, state, first, config, mode, decode_steps, fed)
    dense, sparse_run = runs["dense"], runs["sparse"]
    diff = np.abs(sparse_run["logits"] - dense["logits"])
    agree = sparse_run["logits"].argmax(-1) == dense["logits"].argmax(-1)
    counts = sparse_run["counts"].sum(0)  # [layers, 4]
    predicted = counts[:, COUNTS.index("predicted")]
    hits, late = counts[:, COUNTS.index("hits")], counts[:, COUNTS.index("late")]
    return SparseComparison(
        budget=config.budget,
        decode_steps=decode_steps,
        recall=sparse_run["recall"].mean(axis=(0, 2, 3)),
        recall_min=sparse_run["recall"].min(axis=(0, 2, 3)),
        error=sparse_run["error"].mean(axis=(0, 2, 3)),
        hit_rate=hits / np.maximum(1, predicted),
        coverage=hits / np.maximum(1, hits + late),
        counts=counts,
        max_abs_logit_diff=float(diff.max()),
        mean_abs_logit_diff=float(diff.mean()),
        top1_agreement=float(agree.mean()),
        dense_logits=dense["logits"],
        sparse_logits=sparse_run["logits"],
        dense_tokens=dense["tokens"],
    )


def _dense_attention(q, k, v, state, *, layer, **options):
    """:func:`jax_tpusync.prefetching_attention` on one device's cache (the only kind
    compare_sparse makes)."""
    return device_attention(q, k, v, state, layer=layer, **options)


def _check_state(state: Any) -> None:
    spec = getattr(state, "spec", None)
    if not isinstance(state, KVState) or spec is None or not spec.resident or spec.mesh:
        raise ValueError(
            "compare_sparse needs one device's OffloadedKVCache keeping every position "
            "(these keywords make another cache: drop sliding windows, meshes, host pools)"
        )
    if any(window is not None for window in spec.windows):
        raise ValueError(
            "compare_sparse compares global attention (sliding layers read their window "
            "whole, sparse or not): drop sliding_window"
        )
    if spec.quantized:
        raise ValueError("compare_sparse reads the KV as stored: drop tier_dtype")


def _last_row(logits) -> jax.Array:
    logits = jnp.asarray(logits)
    return jnp.argmax(logits[:, -1] if logits.ndim == 3 else logits, axis=-1).astype(jnp.int32)


def _decode(step, params, state, first, config, mode, steps, fed) -> dict:
    """``steps`` decode steps; the dense run picks greedily, the sparse one is ``fed``."""
    spec = state.spec
    width = config.max_selected(-(-spec.max_len // spec.block_tokens))
    previous = jnp.full((spec.num_layers, spec.batch, width), -1, jnp.int32)
    fn = _decode_fn(step, config, mode == "sparse")
    token = first
    seen = {k: [] for k in ("logits", "tokens", "recall", "error", "counts")}
    for i in range(steps):
        if fed is not None and i > 0:
            token = jnp.asarray(fed[i - 1], jnp.int32)
        logits, state, previous, recall, error, counts = fn(params, token[:, None], state, previous)
        logits = np.asarray(logits, np.float32)
        token = jnp.asarray(logits.argmax(-1), jnp.int32)
        seen["logits"].append(logits)
        seen["tokens"].append(np.asarray(token))
        seen["recall"].append(np.asarray(recall))
        seen["error"].append(np.asarray(error))
        seen["counts"].append(np.asarray(counts))
    return {k: np.stack(v) for k, v in seen.items()}


def _decode_fn(step, config: SparseConfig, sparse: bool):
    def decode(params, tokens, state, previous):
        found = {}

        def probe(q, k, v, state, *, layer, **options):
            if not isinstance(layer, (int, np.integer)):
                raise ValueError(
                    "compare_sparse needs each layer's index as a Python int (a step that "
                    "scans over its layers passes a traced one)"
                )
            if q.shape[1] != 1 or options.get("query_seq_lengths") is not None:
                raise ValueError("compare_sparse decodes one row per sequence and step")
            if options.get("soft_cap") is not None:
                raise ValueError("compare_sparse's sparse reference takes no soft_cap")
            lengths = state.lengths + 1  # the new row included
            out, state = _dense_attention(q, k, v, state, layer=layer, **options)
            spec = state.spec
            keys = from_bits(state.staging[layer, 0], spec.dtype)
            values = from_bits(state.staging[layer, 1], spec.dtype)
            scale = options.get("scale") or 1.0 / math.sqrt(q.shape[-1])
            got = sparse_measure.measure(
                config, q[:, 0], keys, values, lengths, spec.block_tokens, previous[layer], scale
            )
            found[int(layer)] = got
            if sparse:
                out = got.sparse[:, None].astype(out.dtype)
            return out, state

        logits, state = step(params, tokens, state, probe)
        layers = [found[i] for i in sorted(found)]
        if sorted(found) != list(range(previous.shape[0])):
            raise ValueError(
                f"the step called attention for layers {sorted(found)}; the cache has "
                f"{previous.shape[0]}"
            )
        logits = jnp.asarray(logits)
        return (
            logits[:, -1] if logits.ndim == 3 else logits,
            state,
            jnp.stack([g.selection for g in layers]),
            jnp.stack([g.recall for g in layers]),
            jnp.stack([g.read_error for g in layers]),
            jnp.stack([g.counts for g in layers]),
        )

    return jax.jit(decode, donate_argnums=(2,))
