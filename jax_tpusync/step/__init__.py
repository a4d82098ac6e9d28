"""One layer of a decode (or prefill-chunk) step over an offloaded KV cache.

The entry point is :func:`jax_tpusync.prefetching_attention` (:mod:`jax_tpusync.attention`);
its modules, lowest first (each imports only those above it in this list, and the
package's lower layers: state, ops, backend, blocks, quantize, kernels, mesh_layout,
sparse):

* :mod:`~jax_tpusync.step.plan`: the unit walk: which positions each unit of a layer
  covers, their segments in the tier, the unit ``prefetch_depth`` ahead, the refusal of an
  out-of-range traced layer;
* :mod:`~jax_tpusync.step.unit`: one unit's attention: rows from staging (or anywhere),
  read in blocks on the CPU backend, through the reference or the Pallas kernel;
* :mod:`~jax_tpusync.step.in_place`: a unit of a host tier attended to where the pool
  holds it (CPU backend), instead of fetched;
* :mod:`~jax_tpusync.step.resident`: a resident cache's layer over its device copy, and
  :func:`~jax_tpusync.resident_attention`, the device-resident baseline;
* :mod:`~jax_tpusync.step.streamed`: the write-back, then the layer's units, each fetched
  into staging ahead of its attention (or read in place);
* :mod:`~jax_tpusync.step.sparse_layer`: a sparse decode layer (``spec.sparse``): the
  exact selection, the predicted walk fetched layer-ahead and the late blocks' second
  walk, both through the streamed step over compacted block tables;
* :mod:`~jax_tpusync.step.device`: one device's layer: the checks, the write-back, then
  resident, sparse or streamed;
* :mod:`~jax_tpusync.step.sharded`: a mesh cache's layer, one device's per shard inside
  ``shard_map``, and the refusal of a single-device cache used across devices.
"""
